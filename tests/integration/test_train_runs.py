"""`vlmctl train`: launch commands, samplers, DeepSpeed config, stages/LoRA, packing, and real multi-process runs on
CPU.

The multi-process tests share one built tiny model and one prepared data set (session fixture) and run 8 steps
of 2 ranks x one packed row of up to 192 tokens (about two image samples; `train.packing` is on by default). Every one of them has a timeout: a hang (e.g. a rank skipping the vision tower under
FSDP/ZeRO-3) fails the test instead of blocking the suite.
"""

from __future__ import annotations

import shutil
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from cli_runner import run_cli as run_cli_inprocess
from shapes_shards import write_shapes_shards
from train_runner import RunsAhead, run_train, start_train, wait_until

RUN_TIMEOUT = 150
# what the tiny models' tokenizer is trained on: the generated questions' words


# ----------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def project(tmp_path_factory, tiny_models) -> Path:
    """A project folder with a built tiny model, prepared shards and a vlmctl.yaml for 2-rank FSDP."""

    root = tmp_path_factory.mktemp("train")
    write_shapes_shards(root / "data", 96)
    shutil.copytree(tiny_models("tiny", shapes=True, dtype="bf16"), root / "model")
    (root / "vlmctl.yaml").write_text(f"""
project: {{name: t}}
data: {{prepared_dir: data/prepared, max_length: 512}}
model: {{preset: tiny, init: random, output_dir: model}}
train:
  stage: full
  strategy: fsdp
  nproc_per_node: 2
  precision: fp32
  learning_rate: 2.0e-3
  warmup_ratio: 0.0
  micro_batch_size: 2
  tokens_per_batch: 192
  max_steps: 8
  save_steps: 4
  logging_steps: 1
  num_workers: 0
  output_dir: runs
""")
    return root


def _cli(project: Path, *args: str) -> subprocess.Popen:
    return start_train(project / "vlmctl.yaml", *args)


def _run_cli(project: Path, *args: str, timeout: int = RUN_TIMEOUT) -> str:
    return run_train(project / "vlmctl.yaml", *args, timeout=timeout)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics(run)]


@pytest.fixture(scope="session")
def fsdp_run(project) -> Path:
    """The reference run: torchrun, 2 ranks, FSDP2, 8 steps, checkpoints at 4 and 8."""
    _run_cli(project, "--launcher", "torchrun", "--nproc-per-node", "2", "train.run_name=fsdp")
    return project / "runs" / "fsdp"


# ------------------------------------------------------------------------------------------- launch commands

def _loaded(project):
    from vlmctl.models import load_model

    return load_model(project / "model", dtype="fp32")


def test_align_and_lora_set_requires_grad_on_exactly_the_right_parameters(project):
    from vlmctl.config import LoraSection
    from vlmctl.train import setup

    model, _, family = _loaded(project)
    parts = setup.model_parts(model, family)
    counts = setup.apply_stage(model, parts, setup.trainable_parts("align", None))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("model.multi_modal_projector.") for n in trainable)
    assert counts["vision"] == counts["llm"] == 0 and counts["projector"] > 0
    assert setup.trainable_parts("finetune", ["projector"]) == {"vision", "llm"}

    model, _, family = _loaded(project)
    parts = setup.model_parts(model, family)
    trainable_parts = setup.trainable_parts("finetune", None)
    setup.apply_stage(model, parts, trainable_parts)
    peft_model = setup.apply_lora(model, LoraSection(r=4, alpha=8, dropout=0.0), parts, trainable_parts)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    lora = [n for n in trainable if ".lora_" in n]
    assert lora and all(".language_model.layers." in n for n in lora)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    others = [n for n in trainable if ".lora_" not in n]
    assert others and all("multi_modal_projector.modules_to_save" in n for n in others)


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}


def _changed(before: dict, after: dict) -> set[str]:
    import torch

    assert set(after) <= set(before)
    return {k for k in after if not torch.equal(before[k], after[k])}


def assert_trained_exactly(project: Path, run: Path, what: str) -> None:
    """The final export differs from the built model in exactly the weights `what` ("projector" or "lora") trains.

    Saved files use transformers' checkpoint layout (keys may lack the `model.` prefix): match by part name.
    """
    import re

    before = _weights(project / "model")
    changed = _changed(before, _weights(run / "final"))
    projector = {k for k in before if "multi_modal_projector." in k}
    if what == "projector":
        assert changed == projector
        return
    lora_target = re.compile(r".*language_model\.(model\.)?layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
    llm = changed - projector
    # merged adapters change every targeted weight; biases, norms, embeddings and the vision tower stay as built
    assert llm == {k for k in before if lora_target.fullmatch(k)}
    assert changed & projector


@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize("mode", ["align", "lora"])
def test_in_process_run_changes_exactly_the_trained_weights(project, mode, capsys):
    overrides = ["train.max_steps=3", "train.save_steps=100", "train.strategy=ddp", f"train.run_name=none-{mode}"]
    if mode == "align":  # padded micro-batches here; the LoRA run packs
        overrides += ["train.stage=align", "train.report_to=[tensorboard]", "train.packing=false"]
    else:
        overrides += ["train.stage=finetune", "train.lora.r=4", "train.lora.alpha=8", "train.lora.dropout=0"]
    code, out, err = run_cli_inprocess(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", *overrides], capsys)
    assert code == 0, out + err
    run = project / "runs" / f"none-{mode}"
    assert_trained_exactly(project, run, "projector" if mode == "align" else "lora")
    assert (run / "loss.png").is_file()
    if mode == "align":
        assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    if mode == "lora":
        # train.activation_checkpointing was left auto: on CPU it resolves without a probe, recorded in the run's
        # plan; config.yaml keeps the project's own word
        from vlmctl.config import load_config
        from vlmctl.config.plan import read_plan

        assert load_config(run / "config.yaml").train.activation_checkpointing == "auto"
        assert read_plan(run).activation_checkpointing.value == "off"
        assert json.loads((run / "autotune.json").read_text())["reason"] == "no probe on CPU"
        state = json.loads((run / "checkpoints" / "checkpoint-3" / "trainer_state.json").read_text())
        assert state["lora"]["r"] == 4
        # target_modules: the adapted modules' names as a JSON list that peft accepts
        targets = state["lora"]["target_modules"]
        assert isinstance(targets, list) and "model.language_model.layers.0.self_attn.q_proj" in targets
        assert {t.rsplit(".", 1)[-1] for t in targets} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert all(t.startswith("model.language_model.layers.") for t in targets)
        from peft import LoraConfig

        assert LoraConfig(**{k: v for k, v in state["lora"].items() if k in LoraConfig.__dataclass_fields__}).target_modules == set(targets)
        rows = metrics(run)
        assert state["device"] == "cpu" and all(r["device"] == "cpu" for r in rows)
        seen = [r["tokens_seen"] for r in rows]
        assert seen == sorted(seen) and seen[0] == rows[0]["text_tokens"] + rows[0]["visual_tokens"]
        assert state["tokens_seen"] == seen[-1]
    from transformers import AutoModelForImageTextToText, AutoProcessor

    AutoModelForImageTextToText.from_pretrained(run / "final")
    AutoProcessor.from_pretrained(run / "final")


# ----------------------------------------------------------------------------------- multi-process (torchrun)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_torchrun_fsdp_two_ranks_trains_and_checkpoints(fsdp_run):
    rows = metrics(fsdp_run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert sum(r["loss"] for r in rows[-3:]) / 3 < sum(r["loss"] for r in rows[:3]) / 3 - 0.3
    ckpts = sorted(p.name for p in (fsdp_run / "checkpoints").iterdir())
    assert ckpts == ["checkpoint-4", "checkpoint-8"]
    state = json.loads((fsdp_run / "checkpoints" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["world_size"] == 2 and state["strategy"] == "fsdp" and state["family"] == "llava"
    assert (fsdp_run / "checkpoints" / "checkpoint-8" / ".metadata").is_file()
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(fsdp_run / "checkpoints" / "checkpoint-8")).read_metadata().state_dict_metadata
    assert "model.model.language_model.layers.0.self_attn.q_proj.weight" in keys
    assert "model.model.vision_tower.encoder.layers.0.mlp.fc1.weight" in keys
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(fsdp_run / "final")
    assert (fsdp_run / "config.yaml").is_file()


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_every_run_folder_has_train_log_with_the_startup_table_and_step_lines(project, fsdp_run, capsys):
    """torchrun (the reference run) and in-process runs copy the ranks' output into <run>/train.log while it
    still reaches the console."""
    log = (fsdp_run / "train.log").read_text()
    assert "world size" in log and "strategy" in log and "fsdp" in log  # the start-up table
    assert "step 1/8" in log and "step 8/8" in log and "tok/s" in log
    code, out, err = run_cli_inprocess(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.max_steps=2",
                                        "train.save_steps=100", "train.strategy=ddp", "train.run_name=log-none"], capsys)
    assert code == 0, out + err
    log = (project / "runs" / "log-none" / "train.log").read_text()
    assert "world size" in log and "step 2/2" in log and "tok/s" in log
    assert "step 2/2" in out + err  # still on the console


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_fsdp_two_ranks_match_single_process_with_the_same_global_batch(project, fsdp_run, capsys):
    # the packed bin list does not depend on the world size: 2 ranks x 1 row == 1 rank x 2 accumulated rows
    code, out, err = run_cli_inprocess(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none",
                                        "train.gradient_accumulation_steps=2", "train.run_name=single"], capsys)
    assert code == 0, out + err
    single = losses(project / "runs" / "single")
    two = losses(fsdp_run)
    assert len(single) == len(two) == 8
    for a, b in zip(single, two):
        assert abs(a - b) < 1e-4 * abs(a)


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 30)
def test_kill_9_then_resume_reproduces_the_uninterrupted_curve(project, fsdp_run):
    run = project / "runs" / "killed"
    proc = _cli(project, "train.run_name=killed")
    wait_until(proc, lambda: (run / "checkpoints" / "checkpoint-4").is_dir(), RUN_TIMEOUT, "checkpoint-4")
    os.killpg(proc.pid, signal.SIGKILL)  # launcher, torchrun and both ranks at once, like a lost node
    proc.wait()
    # Whatever the ranks wrote after step 4 is gone with a real crash at that point.
    for p in (run / "checkpoints").iterdir():
        if p.name != "checkpoint-4":
            subprocess.run(["rm", "-rf", str(p)], check=True)
    subprocess.run(["rm", "-rf", str(run / "final")], check=True)
    _run_cli(project, "--resume", "train.run_name=killed")
    resumed = metrics(run)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed] == losses(fsdp_run)  # bitwise on CPU
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_sigterm_finishes_the_step_saves_and_exits(project):
    run = project / "runs" / "term"
    proc = _cli(project, "train.run_name=term", "train.max_steps=200", "train.save_steps=1000")
    wait_until(proc, lambda: (run / "metrics.jsonl").is_file() and len(metrics(run)) >= 2, RUN_TIMEOUT, "2 steps logged")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    ckpts = list((run / "checkpoints").iterdir())
    assert len(ckpts) == 1
    state = json.loads((ckpts[0] / "trainer_state.json").read_text())
    assert state["reason"] == "signal" and state["step"] == metrics(run)[-1]["step"] < 200
    assert "stopped by signal" in out and "--resume" in out
    assert not (run / "final").exists()


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_torchrun_deepspeed_two_ranks_trains_checkpoints_and_resumes(project, stage):
    # The first DeepSpeed run on a machine compiles its CPU communication op (1-2 min, cached afterwards).
    # 100-token rows: one image sample, or only text samples (then the dummy image runs the vision tower)
    _run_cli(project, "--strategy", stage, f"train.run_name={stage}", "train.max_steps=6", "train.save_steps=3",
             "train.tokens_per_batch=100", timeout=2 * RUN_TIMEOUT)
    run = project / "runs" / stage
    rows = metrics(run)
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    assert sum(r["dummy_images"] for r in rows) > 0  # a text-only rank did not hang ZeRO
    for step in (3, 6):
        ckpt = run / "checkpoints" / f"checkpoint-{step}"
        assert (ckpt / "latest").read_text().strip() == f"global_step{step}"
        assert json.loads((ckpt / "trainer_state.json").read_text())["format"] == "deepspeed"
    assert (run / "final" / "model.safetensors").is_file()
    if stage == "zero3":  # DeepSpeed's own load path: resume from step 3 reproduces steps 4-6 exactly
        subprocess.run(["rm", "-rf", str(run / "checkpoints" / "checkpoint-6"), str(run / "final")], check=True)
        _run_cli(project, "--strategy", stage, "--resume", f"train.run_name={stage}", "train.max_steps=6", "train.save_steps=3",
                 "train.tokens_per_batch=100")
        assert losses(run) == [r["loss"] for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_torchrun_fsdp_lora_with_accumulation_trains_only_adapters_and_projector(project):
    _run_cli(project, "train.run_name=fsdp-lora", "train.stage=finetune", "train.lora.r=4", "train.lora.alpha=8",
             "train.lora.dropout=0", "train.gradient_accumulation_steps=2", "train.max_steps=3", "train.save_steps=3")
    run = project / "runs" / "fsdp-lora"
    assert len(metrics(run)) == 3
    assert_trained_exactly(project, run, "lora")


@pytest.mark.timeout(RUN_TIMEOUT)
def test_accumulation_matches_a_larger_micro_batch(project, capsys):
    base = ["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.group_by_length=false", "train.packing=false",
            "train.max_steps=3", "train.save_steps=100"]
    # the second run also applies the processor in a DataLoader worker process
    for name, extra in (("mb4", ["train.micro_batch_size=4"]), ("mb2x2", ["train.gradient_accumulation_steps=2", "train.num_workers=1"])):
        code, out, err = run_cli_inprocess([*base, f"train.run_name={name}", *extra], capsys)
        assert code == 0, out + err
    big, accumulated = losses(project / "runs" / "mb4"), losses(project / "runs" / "mb2x2")
    assert len(big) == len(accumulated) == 3  # a run that logs no row must not pass the comparison
    for a, b in zip(big, accumulated, strict=True):
        assert abs(a - b) < 1e-5 * abs(a)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_accelerate_launch_ddp_two_ranks(project):
    # padded micro-batches across processes (packing is covered by the fsdp runs)
    out = _run_cli(project, "--launcher", "accelerate", "--strategy", "ddp", "train.run_name=ddp", "train.max_steps=4", "train.save_steps=4",
                   "train.packing=false")
    run = project / "runs" / "ddp"
    rows = metrics(run)
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]
    state = json.loads((run / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["strategy"] == "ddp"
    assert "accelerate launch" in out



def _capture_packed_sampler(monkeypatch) -> list:
    """Record the PackedBatchSampler a run creates (to replay its bins as padded micro-batches)."""
    from vlmctl.data import loader

    made = []
    original = loader.PackedBatchSampler.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(loader.PackedBatchSampler, "__init__", init)
    return made


def _assert_packed_equals_padded(project: Path, name: str, capsys, monkeypatch, steps: int = 4, extra: tuple = ()) -> list[dict]:
    """Train `steps` packed steps, then the same samples per step as padded micro-batches: same losses and norms."""
    from vlmctl.data import loader

    base = ["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.strategy=ddp", f"train.max_steps={steps}",
            "train.save_steps=100", "train.warmup_ratio=0", *extra]
    made = _capture_packed_sampler(monkeypatch)
    code, out, err = run_cli_inprocess([*base, f"train.run_name={name}-packed"], capsys)
    assert code == 0, out + err
    assert len(made) == 1
    sampler = made[0]
    monkeypatch.setattr(loader, "DistributedBatchSampler", lambda *a, **k: sampler)  # replay the packed bins, padded
    code, out, err = run_cli_inprocess([*base, f"train.run_name={name}-padded", "train.packing=false"], capsys)
    assert code == 0, out + err
    packed, padded = metrics(project / "runs" / f"{name}-packed"), metrics(project / "runs" / f"{name}-padded")
    assert len(packed) == len(padded) == steps
    for p, q in zip(packed, padded):
        assert (p["label_tokens"], p["text_tokens"], p["visual_tokens"]) == (q["label_tokens"], q["text_tokens"], q["visual_tokens"])
        assert p["loss"] == pytest.approx(q["loss"], rel=2e-5)
        assert p["grad_norm"] == pytest.approx(q["grad_norm"], rel=2e-4)
    return packed


@pytest.mark.timeout(RUN_TIMEOUT)
def test_packed_run_matches_padded_run_on_the_same_batches(project, capsys, monkeypatch):
    rows = _assert_packed_equals_padded(project, "eq-llava", capsys, monkeypatch)
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.fixture(scope="module")
def qwen_project(tmp_path_factory, tiny_models) -> Path:
    """The tiny Qwen2.5-VL preset (mRoPE, image-only processor) with the same generated data."""

    root = tmp_path_factory.mktemp("train-qwen")
    write_shapes_shards(root / "data", 36)
    shutil.copytree(tiny_models("tiny-qwen2.5-vl", shapes=True, dtype="bf16"), root / "model")
    (root / "vlmctl.yaml").write_text("""
project: {name: q}
data: {prepared_dir: data/prepared, max_length: 512}
model: {preset: tiny-qwen2.5-vl, init: random, output_dir: model}
train: {stage: full, precision: fp32, learning_rate: 2.0e-3, tokens_per_batch: 96, logging_steps: 1, num_workers: 0, output_dir: runs}
""")
    return root


@pytest.mark.timeout(RUN_TIMEOUT)
def test_qwen2_5_vl_packed_run_with_mrope_matches_padded(qwen_project, capsys, monkeypatch):
    # Padded Qwen-VL batches get their mRoPE positions from the model itself, row by row; the packed run passes
    # (4, 1, T) positions computed per sample. Equal losses mean the packed positions are right.
    from vlmctl.families import qwen_vl as spec

    shapes = []
    original = spec.mrope_prepare

    def spy(*args, **kwargs):
        prepare = original(*args, **kwargs)

        def wrapped(batch):
            out = prepare(batch)
            shapes.append((tuple(out["position_ids"].shape), out["input_ids"].shape[1], len(out["seq_lens"])))
            return out

        return wrapped

    monkeypatch.setattr(spec, "mrope_prepare", spy)
    rows = _assert_packed_equals_padded(qwen_project, "eq-qwen", capsys, monkeypatch, steps=3)
    # prepared ahead of the step (loop.prefetch): at least the 3 consumed rows
    assert len(shapes) >= 3 and all(s == (4, 1, t) and n > 1 for s, t, n in shapes)
    assert sum(r["visual_tokens"] for r in rows) > 0



# Two 8-step torchrun FSDP2 runs without gradient clipping and without compute balancing: plain AdamW and AdamW
# stepped in backward. Both tests below read the first; the second starts with it (RunsAhead).
UNCLIPPED = ("train.max_grad_norm=0", "train.balance=off")
OIB = (*UNCLIPPED, "train.optimizer_in_backward=true")


@pytest.fixture(scope="module")
def unclipped_runs(project):
    runs = RunsAhead({"adamw-noclip": lambda: _cli(project, "train.run_name=adamw-noclip", *UNCLIPPED),
                      "oib": lambda: _cli(project, "train.run_name=oib", *OIB)}, timeout=2 * RUN_TIMEOUT)
    yield runs
    runs.close()


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 30)
def test_text_only_rank_runs_a_dummy_image_and_does_not_hang(project, unclipped_runs):
    # With every third sample text-only and 2 samples per rank, some steps give one rank only text: that rank
    # appends a zero-weighted dummy image so FSDP's collective gathers of the vision tower line up. Compute
    # balancing (on by default with 2 ranks) spreads the image samples over the ranks, so it is off here.
    unclipped_runs.output("adamw-noclip")
    assert sum(r["dummy_images"] for r in metrics(project / "runs" / "adamw-noclip")) > 0


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_optimizer_in_backward_matches_adamw_and_resumes_bitwise(project, unclipped_runs):
    # the per-parameter AdamW stepped in backward is the same update as one AdamW stepped after it (no clipping)
    unclipped_runs.output("adamw-noclip")
    unclipped_runs.output("oib")
    ref, oib = metrics(project / "runs" / "adamw-noclip"), metrics(project / "runs" / "oib")
    assert len(ref) == len(oib) == 8
    for a, b in zip(ref, oib):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
    # its DCP checkpoint (one optimizer per parameter) resumes to the same curve
    run = project / "runs" / "oib"
    subprocess.run(["rm", "-rf", str(run / "checkpoints" / "checkpoint-8"), str(run / "final")], check=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in oib[:4]))
    _run_cli(project, "--resume", "train.run_name=oib", *OIB)
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in oib]


