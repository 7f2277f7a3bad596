"""What a new user meets first, each pinned by a test: help, refusals, defaults and messages of the commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli


def _flat(text: str) -> str:
    """Console text with table borders and line wrapping removed (words joined by single spaces)."""
    for ch in "│┃║╭╮╰╯─":
        text = text.replace(ch, " ")
    return " ".join(text.split())


# --------------------------------------------------------------------------------------------- --help: start-up


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["data", "validate", "-h"], ["train", "--resume", "-h"]])
def test_help_and_known_options_do_not_load_the_config_models(args):
    """The config models (every section) load only to name the config key of an unknown --option."""
    code = (
        "import sys\n"
        "from vlmctl.cli.app import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        "print('LOADED', [m for m in ('vlmctl.config',) if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "LOADED []" in out, out


def test_help_shows_no_value_type_beside_a_flag(capsys):
    code, out, _ = run_cli(["train", "--help"], capsys)
    assert code == 0
    assert "<bool>" not in out and "<int>" in out  # --nnodes takes a number; --resume, --dry-run, --help take none
    code, out, _ = run_cli(["convert", "--help"], capsys)
    assert "<bool>" not in out and "--no-merge-lora" in out


def _turns(question: str = "<image>\nWhat color?", answer: str = "red") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def _llava_project(root: Path, rows: list[dict], extra: str = "") -> Path:
    from PIL import Image

    Image.new("RGB", (64, 64), "red").save(root / "red.png")
    (root / "d.json").write_text(json.dumps(rows))
    (root / "vlmctl.yaml").write_text("project: {name: v}\ndata:\n  sources:\n    - {path: d.json, format: llava}\n"
                                      f"  num_proc: 1\n{extra}")
    return root


# ------------------------------------------------------------------------- data validate FILE: --format, --dataset


def test_validate_with_an_unknown_format_is_a_usage_error_listing_every_format(tmp_path, capsys, monkeypatch):
    from typing import get_args

    from vlmctl.cli.data import FORMATS
    from vlmctl.config.data import DataFormat

    (tmp_path / "d.json").write_text("[]")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "validate", "d.json", "--format", "bogus"], capsys)
    text = _flat(out + err)
    assert code == 2 and "Runtime error" not in text and "ValidationError" not in text, text
    assert "'bogus' is not one of" in text and "llamafactory" in text and "preference" in text, text
    assert FORMATS == get_args(DataFormat)
    code, out, _ = run_cli(["data", "validate", "--help"], capsys)
    assert all(name in _flat(out) for name in FORMATS)


def test_validate_reads_a_llamafactory_dataset_info_given_on_the_command_line(tmp_path, capsys, monkeypatch):
    from PIL import Image

    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    record = {"messages": [{"from": "human", "value": "<image>What color?"}, {"from": "gpt", "value": "red"}],
              "images": ["red.png"]}
    (tmp_path / "one.json").write_text(json.dumps([record]))
    (tmp_path / "two.json").write_text(json.dumps([record, record | {"messages": _turns("<image>\nShape?", "square")}]))
    entry = {"formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"one": {"file_name": "one.json", **entry},
                                                            "two": {"file_name": "two.json", **entry}}))
    monkeypatch.chdir(tmp_path)  # no vlmctl.yaml: the command line alone
    code, out, err = run_cli(["data", "validate", "dataset_info.json"], capsys)
    text = _flat(out + err)
    assert code == 2 and "--dataset" in text and "one, two" in text and "data.sources[]" not in text, text
    code, out, err = run_cli(["data", "validate", "dataset_info.json", "--dataset", "three"], capsys)
    assert code == 2 and "has no data set 'three'" in _flat(out + err) and "--dataset NAME" in _flat(out + err)
    code, out, err = run_cli(["data", "validate", "dataset_info.json", "--dataset", "two"], capsys)
    assert code == 0 and "2 samples checked, none would be rejected" in _flat(out + err), out + err
    (tmp_path / "dataset_info.json").write_text(json.dumps({"one": {"file_name": "one.json", **entry}}))
    code, out, err = run_cli(["data", "validate", "dataset_info.json"], capsys)  # the only data set
    assert code == 0 and "1 samples checked" in _flat(out + err), out + err
    code, out, err = run_cli(["data", "validate", "one.json", "--dataset", "one"], capsys)
    assert code == 2 and "dataset_info.json" in _flat(out + err), out + err


# ------------------------------------------------------------------ prepare: pairs expected, conversations given


def test_preparing_conversations_as_preference_data_names_the_likely_cause(tmp_path, capsys, monkeypatch):
    _llava_project(tmp_path, [{"id": f"s{i}", "image": "red.png", "conversations": _turns(f"<image>\nColor {i}?")}
                              for i in range(6)])
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "prepare", "data.kind=preference", "data.prepared_dir=data/pairs"], capsys)
    text = _flat(out + err)
    assert code != 0 and "missing_response" in text, text
    assert "conversations" in text and "not preference pairs" in text and "point data.sources at the pairs" in text, text
    assert "image_root" not in text and "min_kept_fraction (0 turns" not in text, text  # not the generic hint


# ------------------------------------------------------------------ prepare: one leakage group goes to train


def test_identical_samples_without_dedup_are_prepared_into_train(tmp_path, capsys, monkeypatch):
    rows = [{"id": f"s{i}", "image": "red.png", "conversations": _turns()} for i in range(8)]
    _llava_project(tmp_path, rows, extra="  dedup: false\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "prepare", "data.val_ratio=0.999999"], capsys)  # one group: hashed to val
    text = _flat(out + err)
    assert code == 0, text
    manifest = json.loads((tmp_path / "data" / "prepared" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["samples"] == 8 and manifest["splits"]["val"]["samples"] == 0
    assert manifest["splits"]["train"]["shards"] == ["train/train-00000.parquet"]
    assert "identical samples stay together" in text, text
    from vlmctl.data.loader import ShardDataset

    assert len(ShardDataset.from_dir(tmp_path / "data" / "prepared" / "train")) == 8
    assert (tmp_path / "data" / "prepared" / "val" / "val-00000.parquet").is_file()  # an empty val shard, as always


def test_two_groups_all_in_val_still_fail_with_the_ratio_hint(tmp_path, capsys, monkeypatch):
    rows = [{"id": f"s{i}", "image": "red.png", "conversations": _turns(f"<image>\nColor {i % 2}?")} for i in range(6)]
    _llava_project(tmp_path, rows, extra="  dedup: false\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "prepare", "data.val_ratio=0.999999"], capsys)
    assert code != 0 and "went to val" in _flat(out + err), out + err


# ------------------------------------------------------------------------------------ a wrong model.preset


def test_a_wrong_preset_is_refused_with_the_config_and_the_closest_name(tmp_path, capsys, monkeypatch):
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\nmodel: {preset: tiny, init: random}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["config", "show", "model.preset=qwen2.5-vl-3B"], capsys)
    text = _flat(out + err)
    assert code == 2 and "model.preset" in text and "did you mean qwen2.5-vl-3b?" in text, text
    assert "tiny-smolvlm" not in text and "vlmctl model presets" in text, text  # not the whole list
    from vlmctl.errors import ConfigError
    from vlmctl.models.build import load_preset

    with pytest.raises(ConfigError, match="did you mean tiny-qwen2.5-vl") as info:
        load_preset("tiny-qwen2.5vl")
    assert "model.preset" in info.value.hint


# ------------------------------------------------------------ overrides that do not go together: not the file


def test_overrides_that_do_not_go_together_are_blamed_not_the_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["config", "show", "train.save_best=val_loss"], capsys)
    text = _flat(out + err)
    assert code == 2 and "the command line's overrides are invalid" in text and "vlmctl.yaml is invalid" not in text, text
    assert "command-line override 'train.save_best=val_loss'" in text, text
    code, out, err = run_cli(["config", "show", "model.base=a/b", "model.vision=c/d"], capsys)
    text = _flat(out + err)
    assert "overrides are invalid" in text and "'model.base=a/b', 'model.vision=c/d'" in text, text
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\ntrain: {save_best: val_loss}\n")
    code, out, err = run_cli(["config", "show"], capsys)
    assert code == 2 and "vlmctl.yaml is invalid" in _flat(out + err)  # the file's own mistake stays the file's


# ------------------------------------------------------------------------- output piped or logged (not a TTY)


def test_validate_and_prepare_leave_no_progress_frame_when_piped(tmp_path, capsys, monkeypatch):
    _llava_project(tmp_path, [{"id": f"s{i}", "image": "red.png", "conversations": _turns(f"<image>\nColor {i}?")}
                              for i in range(4)])
    monkeypatch.chdir(tmp_path)
    for args in (["data", "validate"], ["data", "prepare"]):
        code, out, err = run_cli(args, capsys)
        assert code == 0, out + err
        assert "Validating" not in out + err and "Preparing" not in out + err and "samples/s" not in out + err, out + err


def test_the_demo_prints_each_stage_once_when_piped(tmp_path, capsys, monkeypatch):
    import vlmctl.demo as demo_lib
    import vlmctl.demo_post  # noqa: F401 - imported before the patch: it binds run_demo when first imported (by the
    # CLI, inside the patch, when no test before had imported it), and would keep the stand-in for the tests after
    from vlmctl.errors import VlmctlError

    def stages_then_stop(folder, *, progress, on_stage, **kwargs):
        for stage in demo_lib.STAGES:
            progress(stage, 1, 2)
            on_stage(stage, 1.0)
        raise VlmctlError("stopped after the stages")

    monkeypatch.setattr(demo_lib, "run_demo", stages_then_stop)
    code, out, err = run_cli(["demo", str(tmp_path / "d")], capsys)
    assert code == 1 and "stopped after the stages" in _flat(err), out + err
    for label in ("data prepare", "model build", "eval on the val split"):
        assert out.count(f"✓ {label}") == 1, out
    assert "━" not in out, out  # no bar drawn at the end


def test_a_model_export_prints_no_third_party_progress_bar(tmp_path, capfd, monkeypatch):
    import torch

    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_model
    from vlmctl.train import export

    build_model(ModelSection(preset="tiny", init="random", output_dir=tmp_path / "model"),
                tokenizer_texts=["What color is it? red green blue"] * 20)
    model, processor, _ = load_model(tmp_path / "model")
    monkeypatch.setattr(export, "_load_trained", lambda *a, **k: (model, processor))
    capfd.readouterr()
    export._write_final(tmp_path / "run", None, {}, source=str(tmp_path / "model"), lora=None, parts_trainable=set(),
                        out_dtype=torch.float32)
    out, err = capfd.readouterr()
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    assert "Writing model shards" not in out + err and "it/s" not in out + err, out + err


def test_reading_a_dcp_checkpoint_in_one_process_warns_nothing(tmp_path):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from vlmctl.checkpoints import read_dcp_tensors

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tensors = read_dcp_tensors(tmp_path / "ckpt")
    assert torch.equal(tensors["w"], torch.arange(6.0).reshape(2, 3))
    assert [str(w.message) for w in seen] == []


def test_the_run_plan_fits_100_columns():
    from vlmctl.config import TrainSection
    from vlmctl.config.plan import DeviceFacts, build_plan, plan_text

    plan = build_plan(TrainSection(), DeviceFacts(kind="cpu", memory_bytes=None, processes=2))
    lines = plan_text(plan).splitlines()
    assert any("liger-kernel" in line for line in lines)  # the longest reason is there, wrapped
    assert max(len(line.rstrip()) for line in lines) <= 100


# --------------------------------------------------------------- train --dry-run refuses what train refuses


def test_dry_run_stops_where_the_run_would_with_the_same_exit_code(write_config, capsys, monkeypatch):
    import vlmctl.train.launch as L

    monkeypatch.setattr(L, "spawn", lambda *a, **k: pytest.fail("a process was started"))
    cfg = write_config("project: {name: p}\ntrain: {launcher: torchrun}\n")
    code, out, err = run_cli(["-c", str(cfg), "train", "--dry-run"], capsys)
    assert code == 2 and "no prepared training shards" in _flat(err) and "torchrun" not in out, out + err
    code, out, err = run_cli(["-c", str(cfg), "train"], capsys)
    assert code == 2 and "no prepared training shards" in _flat(err), out + err


# ------------------------------------------------- the best checkpoint named relative to its run; convert's -o


def test_the_best_checkpoint_is_named_relative_to_the_run(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from vlmctl.train.validation import name_best

    run = tmp_path / "runs" / "r"
    (run / "final").mkdir(parents=True)
    said = []
    monkeypatch.setenv("RANK", "0")
    best = SimpleNamespace(metric="val_loss", value=1.25, step=40)
    name_best(run, SimpleNamespace(save_best=True, best=best), said.append)
    record = json.loads((run / "final" / "best_checkpoint.json").read_text())
    assert record == {"metric": "val_loss", "value": 1.25, "step": 40, "checkpoint": "checkpoints/checkpoint-40"}
    assert str(tmp_path) not in (run / "final" / "best_checkpoint.json").read_text()
    assert "checkpoint-40" in said[0]


def test_convert_help_says_where_the_output_goes_by_default(capsys):
    code, out, _ = run_cli(["convert", "--help"], capsys)
    assert code == 0 and "RUN/export-<step>" in _flat(out) and "SRC-hf" in _flat(out)


# ------------------------------------------------ the default model of chat / generate / eval / serve


def _run(root: Path, name: str, *, tokens: int, steps: int, finished: float, model_dir: Path | None = None,
         best_step: int | None = None) -> Path:
    import os

    run = root / name
    (run / "final").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "tokens_seen": tokens * s // steps}) + "\n"
                                               for s in range(1, steps + 1)))
    (run / "config.yaml").write_text(f"model: {{output_dir: {model_dir or root.parent / 'model'}}}\n")
    if best_step is not None:
        (run / "checkpoints" / f"checkpoint-{best_step}").mkdir(parents=True)
        (run / "final" / "best_checkpoint.json").write_text(json.dumps(
            {"metric": "val_loss", "value": 0.5, "step": best_step, "checkpoint": f"checkpoints/checkpoint-{best_step}"}))
    os.utime(run / "final", (finished, finished))
    return run


def test_a_short_run_after_a_long_one_does_not_become_the_default_model(tmp_path):
    from vlmctl.runs import project_model

    runs = tmp_path / "runs"
    long = _run(runs, "long", tokens=600_000, steps=600, finished=1000)
    _run(runs, "smoke", tokens=6_000, steps=6, finished=2000)
    choice = project_model(runs, tmp_path / "model")
    assert choice.path == long.resolve() / "final" and choice.export_from is None
    assert "longest-trained of 2 finished runs (600,000 tokens; the newest, smoke, 6,000)" in choice.reason


def test_a_run_started_from_another_runs_export_counts_its_tokens(tmp_path):
    from vlmctl.runs import project_model

    runs = tmp_path / "runs"
    sft = _run(runs, "sft", tokens=600_000, steps=600, finished=1000)
    dpo = _run(runs, "dpo", tokens=50_000, steps=50, finished=2000, model_dir=sft / "final")
    _run(runs, "smoke", tokens=6_000, steps=6, finished=3000)
    assert project_model(runs, tmp_path / "model").path == dpo.resolve() / "final"


def test_the_best_checkpoint_before_the_last_step_is_the_default(tmp_path):
    from vlmctl.runs import project_model

    runs = tmp_path / "runs"
    run = _run(runs, "early", tokens=400_000, steps=400, finished=1000, best_step=300).resolve()
    choice = project_model(runs, tmp_path / "model")
    assert choice.path == run / "export-300" and choice.export_from == run / "checkpoints" / "checkpoint-300"
    assert "best checkpoint of run early (val_loss 0.5000 at step 300; final/ is step 400)" in choice.reason
    (run / "export-300").mkdir()
    (run / "export-300" / "config.json").write_text("{}")
    choice = project_model(runs, tmp_path / "model")
    assert choice.path == run / "export-300" and choice.export_from is None  # exported once, then reused
    (run / "final" / "best_checkpoint.json").write_text(json.dumps({"metric": "val_loss", "value": 0.4, "step": 400}))
    assert project_model(runs, tmp_path / "model").path == run / "final"  # the best was the last step


def test_commands_say_which_model_they_chose_and_export_the_best_once(tmp_path, capsys, monkeypatch):
    import shutil

    import vlmctl.convert as convert_mod
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    build_model(ModelSection(preset="tiny", init="random", output_dir=tmp_path / "model"),
                tokenizer_texts=["What color is it? red green blue"] * 20)
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\nmodel: {preset: tiny, init: random, output_dir: model}\n"
                                          "train: {output_dir: runs}\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "q.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "What color?"},
                                                                {"role": "assistant", "content": "red"}]}) + "\n")
    args = ["generate", "--input", "q.jsonl", "--max-new-tokens", "1", "-o"]
    code, out, err = run_cli([*args, "p0.jsonl"], capsys)
    assert code == 0 and "using model: the project's model" in _flat(err), out + err
    run = _run(tmp_path / "runs", "early", tokens=400, steps=4, finished=1000, best_step=3).resolve()
    shutil.rmtree(run / "final")
    shutil.copytree(tmp_path / "model", run / "final")
    (run / "final" / "best_checkpoint.json").write_text(json.dumps({"metric": "val_loss", "value": 0.5, "step": 3}))
    exported = []

    def convert(src, out):  # the checkpoint's weights are the build's here
        exported.append(Path(src))
        shutil.copytree(tmp_path / "model", out)

    monkeypatch.setattr(convert_mod, "convert", convert)
    code, out, err = run_cli([*args, "p1.jsonl"], capsys)
    assert code == 0, out + err
    assert "using runs/early/export-3: the best checkpoint of run early" in _flat(err), err
    assert exported == [run / "checkpoints" / "checkpoint-3"] and (run / "export-3" / "config.json").is_file()
    code, out, err = run_cli([*args, "p2.jsonl"], capsys)
    assert code == 0 and len(exported) == 1 and "runs/early/export-3" in _flat(err), out + err


# ------------------------------------------------------------------ push: each evaluation once, no bookkeeping


def test_push_card_lists_the_latest_evaluation_once_and_uploads_no_marker(tmp_path, capsys, monkeypatch):
    import os

    from vlmctl.hub import find_eval_results, list_upload_files
    from vlmctl.outputs import write_marker

    model = tmp_path / "export"
    model.mkdir()
    (model / "config.json").write_text("{}")
    write_marker(model, "export")
    for i, (name, accuracy) in enumerate((("m-vqa", 0.25), ("m-vqa-2", 0.5))):  # two `vlmctl eval` runs
        out = tmp_path / "eval" / name
        out.mkdir(parents=True)
        write_marker(out, "eval")
        (out / "metrics.json").write_text(json.dumps({"task": "vqa", "model": str(model), "data": "val", "n": 8,
                                                      "metrics": {"accuracy": accuracy}}))
        os.utime(out / "metrics.json", (1000 + i, 1000 + i))
    (tmp_path / "eval" / "m-vqa-other").mkdir()
    (tmp_path / "eval" / "m-vqa-other" / "metrics.json").write_text(json.dumps(
        {"task": "vqa", "model": str(model), "data": "other.json", "n": 3, "metrics": {"accuracy": 1.0}}))
    results = find_eval_results(model, eval_dir=tmp_path / "eval")
    assert sorted((r["data"], r["metrics"]["accuracy"]) for r in results) == [("other.json", 1.0), ("val", 0.5)]
    assert [f.path for f in list_upload_files(model)] == ["config.json"]


# -------------------------------------------------------------------- train --help: the keys to set next


def test_train_help_names_the_keys_to_set_and_where_all_are(capsys, monkeypatch):
    from vlmctl.config import leaf_keys

    monkeypatch.setenv("COLUMNS", "400")  # each paragraph on one line
    code, out, _ = run_cli(["train", "--help"], capsys)
    assert code == 0 and "vlmctl config show" in out and "docs/config.md" in out
    import re

    named = set(re.findall(r"\btrain\.[a-z_.]*[a-z_]", out))
    assert {"train.max_steps", "train.learning_rate", "train.eval_steps", "train.lora.r"} <= named
    assert named <= {f"train.{key}" for key in leaf_keys(("train",))}, named  # every key named exists
    assert any(line.strip().startswith("Several nodes:") and "--launcher slurm." in line for line in out.splitlines())


def test_the_demo_panel_names_its_folder_as_typed_from_here(tmp_path, capsys, monkeypatch):
    from vlmctl.cli import demo as cli_demo
    from vlmctl.demo import DemoResult, TypeScore

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "my-demo"
    result = DemoResult(folder=folder, launcher="torchrun", nproc=2, strategy="fsdp", stage_seconds={"train": 1.0},
                        scores=[TypeScore("color", 4, 1.0, 0.25, "red")], overall=1.0, baseline_overall=0.25,
                        train_samples=10, val_samples=4, steps=2, final_loss=0.1, prepared_dir=folder / "data" / "prepared",
                        model_dir=folder / "outputs" / "model", run_dir=folder / "outputs" / "runs" / "r",
                        eval_dir=folder / "outputs" / "eval" / "r-vqa")
    cli_demo._render(result)
    out = capsys.readouterr().out
    assert "outputs in my-demo" in _flat(out) and str(tmp_path) not in out, out


# ------------------------------------------------------------ bench: the auto workload fits the project's pictures


def test_bench_auto_workload_takes_chat_for_sides_the_baseline_cannot_build(monkeypatch):
    from vlmctl import bench
    from vlmctl.config import ModelSection, TrainSection

    said = []
    section = ModelSection(preset="tiny-qwen2.5-vl", init="random")
    train = TrainSection(packing=True, tokens_per_batch=256)
    spec = bench.WorkloadSpec(image_sizes=(32,), text_tokens=(8, 64))  # the tiny template's 32 px pictures
    plan = bench.prepare(section, train, spec, steps=1, warmup=0, check_device=False, log=said.append)
    assert plan.spec.kind == "chat" and isinstance(plan.workload, bench.ChatWorkload)
    assert any("not multiples of the 28 px" in line for line in said), said
    plan = bench.prepare(section, train, bench.WorkloadSpec(image_sizes=(56,), text_tokens=(8, 64)), steps=1, warmup=0,
                         check_device=False)
    assert plan.spec.kind == "baseline"  # sides it can build: the baseline, as before
