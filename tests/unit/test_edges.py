"""Rough edges a new user hit, each pinned by a test: output, refusals and messages of the commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import run_cli


def _flat(text: str) -> str:
    """Console text with table borders and line wrapping removed (words joined by single spaces)."""
    for ch in "│┃║":
        text = text.replace(ch, " ")
    return " ".join(text.split())


def _llava_project(root: Path, rows: list[dict]) -> Path:
    (root / "d.json").write_text(json.dumps(rows))
    (root / "vlmctl.yaml").write_text("project: {name: v}\ndata:\n  sources:\n    - {path: d.json, format: llava}\n"
                                      "  num_proc: 1\n")
    return root


def _turns(question: str = "<image>\nWhat color?") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": "red"}]


# ------------------------------------------------------------------------------- 1: rich markup in user values


def test_validate_prints_paths_and_text_with_brackets_as_they_are(tmp_path, capsys, monkeypatch):
    _llava_project(tmp_path, [{"id": "a", "image": "[red]2.jpg", "conversations": _turns()},
                              {"id": "b", "image": "/abs/[/x]3.jpg", "conversations": _turns()}])
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "validate"], capsys)
    text = out + err
    assert code == 1, text  # samples rejected, not a crash
    assert "MarkupError" not in text and "[red]2.jpg" in text and "[/x]3.jpg" in text


# --------------------------------------------------------------------- 2: train after model.* changed since build

TOKENIZER_TEXTS = ["What color is the triangle? Answer with one word. red green blue yes no 0 1 2 3"] * 20


@pytest.fixture
def built_project(tmp_path, monkeypatch):
    """A tiny model built (default model.dtype bf16) and prepared training shards."""
    from shapes_shards import write_shapes_shards
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    write_shapes_shards(tmp_path / "data", 4)
    build_model(ModelSection(preset="tiny", init="random", output_dir=tmp_path / "model"), tokenizer_texts=TOKENIZER_TEXTS)
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\ndata: {prepared_dir: data/prepared}\n"
                                          "model: {preset: tiny, init: random, output_dir: model}\n"
                                          "train: {launcher: none, output_dir: runs}\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_train_refuses_a_model_changed_since_the_build(built_project, capsys, monkeypatch):
    import vlmctl.train.launch as L
    from vlmctl.config import load_config

    def fail(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(L, "run_in_process", fail)
    code, out, err = run_cli(["train", "model.projector=pixel_shuffle"], capsys)
    text = _flat(out + err)
    assert code == 2, text
    assert "model.projector: built with 'mlp2x_gelu', now 'pixel_shuffle'" in text and "vlmctl model build --force" in text
    assert not (built_project / "runs").exists() or not any((built_project / "runs").iterdir())
    cfg = load_config(built_project / "vlmctl.yaml")
    L.check_built_settings(cfg, str(cfg.model.output_dir))  # unchanged: no complaint
    # the storage dtype is not the model trained: training loads the weights in its own dtype
    L.check_built_settings(cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": "fp32"})}), str(cfg.model.output_dir))
    # asked to, train rebuilds the model with the new settings first
    monkeypatch.setattr(L, "run_in_process", lambda run_dir: "done")
    code, out, err = run_cli(["train", "--rebuild-model", "model.projector=pixel_shuffle", "train.run_name=rebuilt"], capsys)
    assert code == 0 and "rebuilt" in out, out + err
    assert json.loads((built_project / "model" / "vlmctl_model.json").read_text())["settings"]["projector"] == "pixel_shuffle"


# ---------------------------------------------------- 3: deepspeed_config without DeepSpeed, zero2 not installed


def test_deepspeed_config_with_another_strategy_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "ds.json").write_text("{}")
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\ntrain: {strategy: ddp, deepspeed_config: ds.json}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["train", "--dry-run"], capsys)
    text = _flat(out + err)
    assert code == 2 and "train.deepspeed_config" in text and "zero2" in text, text
    code, out, err = run_cli(["train", "--dry-run", "train.strategy=zero3"], capsys)
    assert "train.deepspeed_config" not in _flat(out + err)  # zero3 takes it; the dry run goes on to the data check
    assert code == 2 and "no prepared training shards" in _flat(out + err), out + err


def test_dry_run_of_zero2_without_deepspeed_says_so(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: None if name.split(".")[0] == "deepspeed" else real(name, package))
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["train", "--dry-run", "train.strategy=zero2"], capsys)
    text = _flat(out + err)
    assert code == 2 and "deepspeed" in text and "vlmctl[deepspeed]" in text, text


# ------------------------------------------------ 4: eval --task caption checks its packages first, keeps answers


def _hide_modules(monkeypatch, *names: str) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: None if name.split(".")[0] in names else real(name, package))


def test_caption_eval_without_pycocoevalcap_fails_before_loading_the_model(tmp_path, monkeypatch):
    import vlmctl.evaluation.runner as runner
    from vlmctl.data.sample import Sample
    from vlmctl.errors import UsageError

    _hide_modules(monkeypatch, "pycocoevalcap")
    monkeypatch.setattr(runner, "load_for_generation", lambda *a, **k: pytest.fail("the model was loaded"))
    sample = Sample(id="c", messages=[{"role": "user", "content": [{"type": "text", "text": "Describe."}]},
                                      {"role": "assistant", "content": [{"type": "text", "text": "a red square"}]}])
    with pytest.raises(UsageError, match="pycocoevalcap") as info:
        runner.run_eval(tmp_path / "model", [sample], task="caption", out_dir=tmp_path / "out")
    assert "vlmctl[eval]" in info.value.hint


def test_the_generated_answers_are_written_when_scoring_fails(built_project, monkeypatch):
    import vlmctl.evaluation.runner as runner
    from vlmctl.data.loader import ShardDataset
    from vlmctl.errors import VlmctlError

    def broken(task, records):
        raise VlmctlError("scoring broke")

    monkeypatch.setattr(runner, "score_records", broken)
    data = ShardDataset.from_dir(built_project / "data" / "prepared" / "train")
    out = built_project / "eval-out"
    with pytest.raises(VlmctlError, match="scoring broke"):
        runner.run_eval(built_project / "model", [data[0], data[1]], task="vqa", out_dir=out, max_new_tokens=2)
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [data[0].id, data[1].id] and all("prediction" in r for r in rows)


# -------------------------------------------------------------------------- 7: did-you-mean, readable messages


@pytest.mark.parametrize("override,expected", [
    ("train.lora_rank=8", "unknown key train.lora_rank: did you mean train.lora.r?"),
    ("train.epochs=2", "did you mean train.num_epochs?"),
    ("train.lr=1e-4", "did you mean train.learning_rate?"),
    ("train.micro_batch_size=1.5", "train.micro_batch_size = 1.5: should be an integer or 'auto'"),
    ("train.report_to=tensorboard", "train.report_to=[tensorboard]"),
])
def test_config_errors_suggest_the_key_and_say_what_it_takes(tmp_path, capsys, monkeypatch, override, expected):
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["config", "show", override], capsys)
    text = _flat(out + err)
    assert code == 2 and expected in text, text
    assert "Input should be" not in text and ".int " not in text and "literal[" not in text


@pytest.mark.parametrize("args,expected", [(["--epochs", "2"], "train.num_epochs=2"),
                                           (["--lora-rank=8"], "train.lora.r=8")])
def test_an_option_that_is_a_config_key_points_at_the_override(tmp_path, capsys, monkeypatch, args, expected):
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["train", *args], capsys)
    text = _flat(out + err)
    assert code == 2 and "no such option" in text and expected in text, text


# ------------------------------------------------------------------------- 10: files follow the process's umask


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_init_and_model_build_honour_the_umask(tmp_path, capsys, mask):
    import os
    import stat

    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    old = os.umask(mask)
    try:
        code, out, err = run_cli(["init", str(tmp_path / "p"), "--template", "tiny"], capsys)
        assert code == 0, out + err
        build_model(ModelSection(preset="tiny", init="random", output_dir=tmp_path / "model"), tokenizer_texts=TOKENIZER_TEXTS)
    finally:
        os.umask(old)
    for f in (tmp_path / "p" / "vlmctl.yaml", tmp_path / "p" / "data" / "README.md", tmp_path / "model" / "model.safetensors"):
        assert mode(f) == 0o666 & ~mask, f
    for d in (tmp_path / "p" / "data" / "raw", tmp_path / "model"):
        assert mode(d) == 0o777 & ~mask, d


def test_a_real_option_is_not_taken_for_a_config_key():
    from vlmctl.cli.app import _option_as_config_key

    assert _option_as_config_key(["push", "x", "--repo-id", "a/b"]) is None
    assert _option_as_config_key(["data", "validate", "--max-length", "3"])[1].endswith("data.max_length=3")


# ------------------------------------------------------------------------------- 12 and 13: exit codes, -q / -v


@pytest.mark.parametrize("args", [["chat", "nothere"], ["eval", "nothere"], ["generate", "nothere", "--input", "x.jsonl"],
                                  ["convert", "nothere", "-o", "out"], ["push", "nothere", "--repo-id", "a/b", "--dry-run"]])
def test_a_missing_model_folder_is_the_same_usage_error_everywhere(tmp_path, capsys, monkeypatch, args):
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(args, capsys)
    assert code == 2 and "no model folder at" in _flat(out + err), out + err


def test_ctrl_c_at_the_chat_prompt_exits_130(monkeypatch):
    import typer

    from vlmctl.cli import chat

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(chat.console, "input", interrupt)
    with pytest.raises(typer.Exit) as info:
        chat._loop(None, interactive=True)
    assert info.value.exit_code == 130


def test_quiet_prints_the_result_line_and_verbose_adds_detail(tmp_path, capsys, monkeypatch):
    _llava_project(tmp_path, [{"id": f"s{i}", "image": f"gone{i}.png", "conversations": _turns()} for i in range(5)])
    monkeypatch.chdir(tmp_path)
    code, quiet, _ = run_cli(["data", "validate", "-q"], capsys)
    assert code == 1 and quiet.strip() == "5 of 5 samples would be rejected (missing_image 5)"
    code, plain, _ = run_cli(["data", "validate"], capsys)
    code, loud, _ = run_cli(["data", "validate", "-v"], capsys)
    assert plain.count("does not exist") == 3 and loud.count("does not exist") == 5
    assert "checked 5 samples" in loud and "checked 5 samples" not in plain


# ------------------------------------------------------------------ 14: data validate FILE --image-root --format


def test_validate_a_file_with_its_image_root_and_format(tmp_path, capsys, monkeypatch):
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (64, 64), "red").save(tmp_path / "imgs" / "a.png")
    (tmp_path / "sub.json").write_text(json.dumps([{"id": "a", "image": "a.png", "conversations": _turns()}]))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "validate", "sub.json"], capsys)
    text = _flat(out + err)
    assert code == 1 and "Every image is missing" in text and "--image-root" in text, text
    code, out, err = run_cli(["data", "validate", "sub.json", "--image-root", "imgs", "--format", "llava"], capsys)
    assert code == 0 and "none would be rejected" in out, out + err
    code, out, err = run_cli(["data", "validate", "sub.json", "--image-root", "imgs", "--format", "messages"], capsys)
    assert code != 0  # the format given is the format read


# -------------------------------------------------------------- 15: an empty val split is flagged, eval says why


def test_an_empty_val_split_is_flagged_at_prepare_and_eval_names_the_fix(tmp_path, capsys, monkeypatch):
    from PIL import Image

    from vlmctl.errors import DataError
    from vlmctl.evaluation.runner import load_samples

    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    _llava_project(tmp_path, [{"id": f"s{i}", "image": "red.png", "conversations": _turns(f"<image>\nColor {i}?")}
                              for i in range(4)])
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "prepare", "data.val_ratio=0"], capsys)
    text = _flat(out + err)
    assert code == 0 and "The val split is empty" in text and "data.val_ratio" in text, text
    with pytest.raises(DataError, match="val split .* is empty") as info:
        load_samples("val", tmp_path / "data" / "prepared")
    assert "data.val_ratio" in info.value.hint


# ------------------------------------------ 16: no folder left by a run that never started; a finished run says so


def test_a_run_that_fails_before_training_leaves_no_folder(built_project, capsys, monkeypatch):
    import vlmctl.train.launch as L
    from vlmctl.errors import ModelError

    def fails(run_dir):
        assert (run_dir / "config.yaml").is_file()
        raise ModelError("the model does not load")

    monkeypatch.setattr(L, "run_in_process", fails)
    code, out, err = run_cli(["train", "train.run_name=first"], capsys)
    assert code == 1 and "the model does not load" in out + err
    assert not (built_project / "runs" / "first").exists()
    code, out, err = run_cli(["train", "train.run_name=first"], capsys)  # the same name again: not "already holds a run"
    assert "already holds a run" not in out + err and "the model does not load" in out + err


def test_resuming_a_finished_run_says_it_is_finished(built_project, capsys):
    import vlmctl.train.launch as L
    from vlmctl.config import load_config

    run = built_project / "runs" / "done"
    (run / "checkpoints" / "checkpoint-3").mkdir(parents=True)
    (run / "checkpoints" / "checkpoint-3" / "trainer_state.json").write_text(
        json.dumps({"step": 3, "epoch": 1.5, "consumed_micro_batches": 6}))
    (run / "final").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    code, out, err = run_cli(["train", "--resume", "train.run_name=done", "train.max_steps=3"], capsys)
    text = _flat(out + err)
    assert code == 2 and "is finished" in text and "train.max_steps" in text, text
    train = load_config(built_project / "vlmctl.yaml").train
    for max_steps, epochs, finished in [(5, 1.0, False), (None, 1.0, True), (None, 2.0, False)]:
        train.max_steps, train.num_epochs = max_steps, epochs
        if finished:
            with pytest.raises(Exception, match="is finished"):
                L.check_unfinished(run, train)
        else:
            L.check_unfinished(run, train)


# -------------------------------------------------------------- 17: the same parameter counts in build and train


def test_train_reports_the_parameter_counts_of_the_build_with_lora(built_project):
    from vlmctl.config import LoraSection
    from vlmctl.models import load_model
    from vlmctl.train import setup
    from vlmctl.train.report import built_parameters

    info = json.loads((built_project / "model" / "vlmctl_model.json").read_text())
    model, _, family = load_model(built_project / "model", dtype="fp32")
    parts = setup.model_parts(model, family)
    model = setup.apply_lora(model, LoraSection(r=4, alpha=8), parts, {"projector"})
    counted = setup.part_parameters(model, setup.model_parts(model, family))
    assert counted != {k: info["parameters"][k] for k in counted}  # adapters and the projector's copy included
    built, adapters = built_parameters(model, setup.model_parts(model, family), counted)
    assert built == {k: info["parameters"][k] for k in counted}
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert adapters == lora > 0


# ------------------------------------------------------------------------------------------ 18: presets listed


def test_presets_are_listed_by_their_command_and_in_build_help(capsys):
    from vlmctl.models.build import PRESET_DIR

    names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    code, out, err = run_cli(["model", "presets", "--json"], capsys)
    assert code == 0 and sorted(json.loads(out)) == names and "tiny SigLIP" in json.loads(out)["tiny"]
    code, out, err = run_cli(["model", "build", "--help"], capsys)
    assert code == 0 and all(name in _flat(out).replace(" ", "") for name in names)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert "`vlmctl model presets` lists them" in doc


# ------------------------------------------------------------------- 19: `vlmctl init llava` says what it made


def test_init_with_a_template_name_as_folder_warns(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["init", "llava"], capsys)
    assert code == 0 and "warning" in err and "--template llava" in _flat(err), err
    assert "tiny" in (tmp_path / "llava" / "vlmctl.yaml").read_text()
    code, out, err = run_cli(["init", "qwen", "--template", "llava"], capsys)
    assert code == 0 and "warning" not in err
    code, out, err = run_cli(["init", "tiny"], capsys)
    assert code == 0 and "warning" not in err


# -------------------------------------------------- 5: an interrupted run is named; --resume --dry-run names it too


def _interrupted(root: Path, name: str, step: int) -> Path:
    run = root / "runs" / name
    (run / "checkpoints" / f"checkpoint-{step}").mkdir(parents=True)
    (run / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").write_text(
        json.dumps({"step": step, "epoch": 0.5, "consumed_micro_batches": step}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": step}) + "\n")
    return run


def test_a_new_run_names_the_interrupted_one_and_dry_run_resumes_the_same(built_project, capsys, monkeypatch):
    import vlmctl.train.launch as L

    older = _interrupted(built_project, "p-finetune-20260101-000000", 2)
    newest = _interrupted(built_project, "p-finetune-20260102-000000", 4)
    code, out, err = run_cli(["train", "--resume", "--dry-run"], capsys)
    assert code == 0 and str(newest) in out and str(older) not in out, out + err
    code, out, err = run_cli(["train", "--dry-run"], capsys)
    assert code == 0 and str(newest) not in out
    import vlmctl.checkpoints

    seen = []
    monkeypatch.setattr(L, "run_in_process", lambda run_dir: seen.append(run_dir) or "done")
    monkeypatch.setattr(vlmctl.checkpoints, "check_checkpoint", lambda path: {})  # the folders hold no weights
    code, out, err = run_cli(["train", "--resume"], capsys)
    assert code == 0 and seen == [newest]
    code, out, err = run_cli(["train"], capsys)
    text = _flat(out + err)
    assert code == 0 and "p-finetune-20260102-000000 stopped at step 4" in text and "vlmctl train --resume" in text
    assert seen[-1] != newest


# ------------------------------------------------------- 6: bench uses the project's shapes, n/a where none exists


def test_bench_defaults_to_the_projects_shapes(built_project):
    from vlmctl.cli.bench import project_shapes
    from vlmctl.config import load_config
    from vlmctl.models.load import read_build_info

    cfg = load_config(built_project / "vlmctl.yaml", ["data.max_length=256"])
    info = read_build_info(cfg.model.output_dir)
    sizes, text = project_shapes(cfg, None, None, 1)
    assert sizes == str(info["image_size"])
    low, high = (int(x) for x in text.split(","))
    assert low == 64 and high + info["visual_tokens_per_image"] + 32 == 256
    assert project_shapes(cfg, "448", "10,20", 1) == ("448", "10,20")  # flags win


def test_bench_says_n_a_for_figures_a_cpu_run_does_not_have(built_project, capsys, monkeypatch):
    import vlmctl.bench as bench

    result = bench.BenchResult(name="tiny", steps=2, world_size=1, strategy="ddp", tokens_per_s=100.0,
                               text_tokens_per_s=50.0, visual_tokens_per_s=50.0, samples_per_s=1.0, step_time_s=0.5,
                               mfu=0.0, peak_memory_gib=0.0, tokens_per_step=50.0, workload="chat", on_gpu=False)
    monkeypatch.setattr(bench, "benchmark", lambda *a, **k: result)
    code, out, err = run_cli(["bench", "--steps", "1"], capsys)
    text = _flat(out)
    assert code == 0 and "MFU (ViT included) n/a (CPU)" in text and "peak memory n/a (CPU)" in text, out + err
    assert "0.0%" not in text.split("MFU")[1][:20]


def test_bench_names_its_slowest_measured_step(built_project, capsys, monkeypatch):
    # an outlier step (a compilation for a new shape) only raises the mean step time; the table names it
    import vlmctl.bench as bench

    result = bench.BenchResult(name="tiny", steps=4, world_size=2, strategy="fsdp", tokens_per_s=100.0,
                               text_tokens_per_s=50.0, visual_tokens_per_s=50.0, samples_per_s=1.0, step_time_s=1.2,
                               mfu=0.0, peak_memory_gib=0.0, tokens_per_step=50.0, workload="chat",
                               step_times_s=[1.0, 1.04, 1.8, 0.98])
    monkeypatch.setattr(bench, "benchmark", lambda *a, **k: result)
    code, out, err = run_cli(["bench", "--steps", "4"], capsys)
    assert code == 0 and "median / slowest step 1,020 / 1,800 ms (measured step 3 of 4)" in _flat(out), out + err
    # the collector's pause in that step, where one was counted
    result.step_gc_s, result.gc_full = [0.0, 0.0, 0.31, 0.0002], 1
    code, out, err = run_cli(["bench", "--steps", "4"], capsys)
    assert code == 0 and "(measured step 3 of 4, 310 ms of it in the garbage collector)" in _flat(out), out + err


# ---------------------------------------------------------------- 8: a Hub id where a model folder is expected


def test_a_hub_id_is_named_as_such_with_the_cache_and_the_fetch(tmp_path, capsys, monkeypatch):
    import huggingface_hub

    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    for args in (["chat", "Qwen/Qwen2-VL-2B-Instruct"], ["eval", "Qwen/Qwen2-VL-2B-Instruct"]):
        code, out, err = run_cli(args, capsys)
        text = _flat(out + err)
        assert code == 2 and "is a Hugging Face Hub id" in text and "not in the local Hugging Face cache" in text, text
        assert "hf download Qwen/Qwen2-VL-2B-Instruct" in text and "pass MODEL" not in text
    snapshot = tmp_path / "cache" / "snapshots" / "abc"
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: str(snapshot / name))
    code, out, err = run_cli(["chat", "Qwen/Qwen2-VL-2B-Instruct"], capsys)
    text = _flat(out + err)
    assert code == 2 and "in the local Hugging Face cache at" in text and "pass that folder" in text, text
    assert str(snapshot) in text.replace(" ", "")  # (a long path wraps over lines)
    code, out, err = run_cli(["chat", "nothere"], capsys)
    assert "Hub id" not in out + err  # a plain missing folder stays one


# ------------------------------------ 9: the demo's "train longer" keeps folder and overrides; convert --adapter-only


def test_the_demo_train_longer_hint_repeats_the_folder_and_overrides():
    from types import SimpleNamespace

    from vlmctl.cli.demo import _verdict

    result = SimpleNamespace(learned=False, projector="mlp2x_gelu", frozen=[], modality="video", steps=300)
    line = _verdict(result, 1.2, (Path("my demo"), ["train.learning_rate=1e-3", "train.max_steps=300"], 800))
    assert ("vlmctl demo 'my demo' --modality video --num-samples 800 --force train.learning_rate=1e-3 "
            "train.max_steps=600") in line


def test_convert_adapter_only_of_a_lora_run_takes_the_checkpoint_adapter(built_project, capsys):
    code, out, err = run_cli(["train", "train.run_name=lora", "train.stage=finetune", "train.lora.r=4", "train.lora.alpha=8",
                              "train.max_steps=2", "train.save_steps=2", "train.num_workers=0", "train.precision=fp32",
                              "train.strategy=ddp", "train.nproc_per_node=1", "data.max_length=512",
                              "train.tokens_per_batch=256"], capsys)
    assert code == 0, out + err
    run = built_project / "runs" / "lora"
    assert not (run / "final" / "adapter_config.json").exists()  # the final export is merged
    code, out, err = run_cli(["convert", str(run), "--adapter-only", "-o", str(built_project / "adapter"), "--no-verify"], capsys)
    assert code == 0, out + err
    assert (built_project / "adapter" / "adapter_config.json").is_file()


# ---------------------------------------------------------------------- 11: known benign warnings are filtered


def test_known_benign_warnings_are_filtered_and_others_kept():
    import warnings

    from vlmctl.train.report import filter_known_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_known_warnings()
        warnings.warn("FSDP2-wrapped module (FSDPLlavaForConditionalGeneration) returned a view tensor. An in-place "
                      "op on this view ...", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in seen] == ["something else"]


# -------------------------------------------------------- 22: a LLaMA-Factory dataset_info.json and a data set name

REAL = Path(__file__).resolve().parents[3] / "shared" / "data" / "real" / "llamafactory_mllm_demo"


def _llamafactory_folder(tmp_path: Path) -> Path:
    import shutil

    data = tmp_path / "data"
    shutil.copytree(REAL if REAL.is_dir() else Path("/work/shared/data/real/llamafactory_mllm_demo"), data)
    (data / "alpaca_demo.json").write_text(json.dumps([
        {"instruction": "Describe the picture.", "input": "Be brief.", "output": "Two players.", "image": ["mllm_demo_data/1.jpg"],
         "history": [["Hi", "Hello"]]}]))
    (data / "renamed.json").write_text(json.dumps([
        {"dialog": [{"speaker": "me", "text": "<image>Who?"}, {"speaker": "bot", "text": "A player."}], "pics": ["mllm_demo_data/2.jpg"]}]))
    (data / "dataset_info.json").write_text(json.dumps({
        "mllm_demo": {"file_name": "mllm_demo.json", "formatting": "sharegpt",
                      "columns": {"messages": "messages", "images": "images"},
                      "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}},
        "alpaca_demo": {"file_name": "alpaca_demo.json", "formatting": "alpaca", "columns": {"images": "image", "history": "history"}},
        "renamed": {"file_name": "renamed.json", "columns": {"messages": "dialog", "images": "pics"},
                    "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "me", "assistant_tag": "bot"}},
        "on_the_hub": {"hf_hub_url": "someone/data"}}))
    return data


def test_a_llamafactory_dataset_info_entry_is_read_with_its_mapping(tmp_path):
    from vlmctl.config.data import DataSource
    from vlmctl.data.formats import detect_format, read_source
    from vlmctl.data.sample import Sample

    data = _llamafactory_folder(tmp_path)
    info = str(data / "dataset_info.json")
    assert detect_format(info) == "llamafactory"
    demo = list(read_source(DataSource(path=info, dataset="mllm_demo", format="llamafactory")))
    raw = json.loads((data / "mllm_demo.json").read_text())
    assert all(isinstance(s, Sample) for s in demo) and len(demo) == len(raw)
    assert demo[0].source == "mllm_demo" and len(demo[0].images) == len(raw[0]["images"])
    assert [m["role"] for m in demo[0].messages] == [m["role"] for m in raw[0]["messages"]]
    (alpaca,) = read_source(DataSource(path=info, dataset="alpaca_demo", format="llamafactory"))
    assert [m["role"] for m in alpaca.messages] == ["user", "assistant", "user", "assistant"] and len(alpaca.images) == 1
    assert {"type": "text", "text": "Describe the picture.\nBe brief."} in alpaca.messages[2]["content"]
    (renamed,) = read_source(DataSource(path=info, dataset="renamed", format="llamafactory"))
    assert [m["role"] for m in renamed.messages] == ["user", "assistant"] and len(renamed.images) == 1


def test_a_llamafactory_source_in_the_project_validates_and_names_the_data_sets(tmp_path, capsys, monkeypatch):
    data = _llamafactory_folder(tmp_path)
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\ndata:\n  sources:\n"
                                          "    - {path: data/dataset_info.json, dataset: mllm_demo}\n  num_proc: 1\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "validate"], capsys)
    assert code == 0 and "none would be rejected" in out, out + err
    for dataset, expected in (("nothing", "alpaca_demo, mllm_demo, on_the_hub, renamed"), ("on_the_hub", "hf_hub_url")):
        (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\ndata:\n  sources:\n"
                                              f"    - {{path: data/dataset_info.json, dataset: {dataset}}}\n  num_proc: 1\n")
        code, out, err = run_cli(["data", "validate"], capsys)
        assert code != 0 and expected in _flat(out + err), out + err
    assert data.is_dir()


# ------------------------------------------------------------------ 20: the video demo's clips are reproducible


def test_the_same_frames_always_encode_to_the_same_clip():
    import hashlib

    import numpy as np

    pytest.importorskip("av")
    from vlmctl.data.synthetic_video import encode_mp4

    for seed in range(10):  # x264's SIMD code gave one of two encodings of 56 px frames, by the process's state
        frames = np.random.default_rng(seed).integers(0, 255, (4, 56, 56, 3), dtype=np.uint8)
        assert len({hashlib.md5(encode_mp4(frames, 4)).hexdigest() for _ in range(40)}) == 1, seed


# ------------------------------------------------- 21: the README's captured demo panel is what the demo prints


def _readme_demo_panel() -> list[str]:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(readme) if line.startswith("╭─ vlmctl demo"))
    end = next(i for i in range(start, len(readme)) if readme[i].startswith("╰"))
    return readme[start:end + 1]


def test_the_readme_demo_panel_is_what_the_demo_prints_for_its_figures():
    """The README's captured panel, rendered again from the figures it shows (times, counts, scores, folders):
    every other character of it (labels, layout, the verdict, the next commands) must be today's output."""
    import re

    from rich.console import Console

    from vlmctl.cli import demo as cli_demo
    from vlmctl.demo import DemoResult, TypeScore

    panel = _readme_demo_panel()
    text = "\n".join(line.strip("│ ") for line in panel)
    seconds = {m[0]: float(m[1]) for m in re.findall(r"^(init|prepare|build|train|eval)\s+([\d.]+)$", text, re.M)}
    scores = [TypeScore(q, int(n), float(a) / 100, float(b) / 100, ans)
              for q, n, a, b, ans in re.findall(r"^(\w+)\s+│\s+(\d+) │\s+([\d.]+)% │\s+([\d.]+)% \('(\w+)'\)", text, re.M)]
    overall = re.search(r"^overall\s+│\s+(\d+) │\s+([\d.]+)% │\s+([\d.]+)%", text, re.M)
    train = re.search(r"train: (\w+) x(\d+) \((\w+)\), (\d+) samples, (\d+) steps, final loss ([\d.]+)", text)
    folder = Path(re.search(r"outputs in (\S+)", text)[1])
    run = re.search(r"training run\s+(\S+)", text)[1]
    result = DemoResult(folder=folder, launcher=train[1], nproc=int(train[2]), strategy=train[3], stage_seconds=seconds,
                        scores=scores, overall=float(overall[2]) / 100, baseline_overall=float(overall[3]) / 100,
                        train_samples=int(train[4]), val_samples=int(overall[1]), steps=int(train[5]),
                        final_loss=float(train[6]), prepared_dir=folder / "data" / "prepared",
                        model_dir=folder / "outputs" / "model", run_dir=folder / run,
                        eval_dir=folder / "outputs" / "eval" / f"{Path(run).name}-vqa")
    console = Console(width=len(panel[0]), record=True, highlight=False, color_system=None, force_terminal=False)
    original = cli_demo.console
    cli_demo.console = console
    try:
        cli_demo._render(result)
    finally:
        cli_demo.console = original
    assert console.export_text().rstrip("\n").splitlines() == panel


def test_the_readme_demo_counts_are_those_of_todays_data(tmp_path, capsys, monkeypatch):
    """The captured run's sample counts (generated, kept, train and val) are what init and data prepare give now."""
    monkeypatch.chdir(tmp_path)
    assert run_cli(["init", "demo", "--template", "tiny"], capsys)[0] == 0
    code, out, err = run_cli(["-c", "demo/vlmctl.yaml", "data", "prepare", "--json"], capsys)
    assert code == 0, err
    manifest = json.loads((tmp_path / "demo" / "data" / "prepared" / "manifest.json").read_text())
    train, val = manifest["splits"]["train"]["samples"], manifest["splits"]["val"]["samples"]
    kept = train + val
    text = "\n".join(_readme_demo_panel()) + "\n".join((Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines())
    assert f"{kept}/{kept}" in text and f"{train} samples, 600 steps" in text and f"exact match on {val} val samples" in text


def test_the_readme_chat_transcript_is_what_chat_prints(built_project, capsys, monkeypatch):
    """Every line of the README's chat transcript but the model's answers (a trained model's) is what `vlmctl chat`
    prints today for the same input."""
    import io
    import sys

    from PIL import Image

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(readme) if line.startswith("$ cd my-demo && vlmctl chat"))
    transcript = readme[start + 1:readme.index("```", start)]
    assert transcript[0].startswith("using outputs/runs/") and "pass MODEL for another" in transcript[0]
    transcript = transcript[1:]  # the default model's line (stderr); MODEL is given here
    for name in ("color-00000.png", "count-00002.png"):
        (built_project / "data" / "raw" / "images").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 64), "red").save(built_project / "data" / "raw" / "images" / name)
    said = [line.removeprefix("you › ") for line in transcript if line.startswith("you › ")]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(said) + "\n"))
    monkeypatch.setenv("COLUMNS", "300")  # the header on one line, as in the README
    code, out, err = run_cli(["chat", str(built_project / "model"), "--max-new-tokens", "2"], capsys)
    assert code == 0, out + err
    printed = [line for line in out.splitlines() if line.strip()]
    assert printed[0].split(" (cpu, float32). ")[1] == transcript[0].split(" (cpu, float32). ")[1]
    assert [line for line in printed[1:] if not line.startswith("model ›")] == \
        [line for line in transcript[1:] if not line.startswith("model ›")]
    assert sum(line.startswith("model ›") for line in printed) == sum(line.startswith("model ›") for line in transcript)
