"""Validation during training (`train.eval_steps`), the best checkpoint (`train.save_best`) and early stopping
(`train.early_stopping_patience`), run by `vlmctl train` on CPU: one process (full and LoRA), 2-rank FSDP2, 2-rank
ZeRO-3 and sequence parallelism 2 (torchrun, gloo), on a tiny model with a 12-sample val split. The val loss is
checked against the same figure computed apart on the exported weights, sample by sample. SIGTERM during a
validation saves and stops with a resume command that keeps the run's settings, and that command finishes the run
with its best checkpoint kept past `save_total_limit`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
from pathlib import Path

import pytest

from cli_runner import run_cli
from shapes_shards import write_shapes_shards
from train_runner import RunsAhead, run_train, start_train

TIMEOUT = 300


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_models) -> Path:
    """A built tiny model, 48 training and 12 val samples (prepared shards), a vlmctl.yaml that validates."""

    root = tmp_path_factory.mktemp("validation")
    write_shapes_shards(root / "data", 48)
    write_shapes_shards(root / "held", 12, text_only_every=4)
    shutil.move(root / "held" / "prepared" / "train", root / "data" / "prepared" / "val")
    shutil.copytree(tiny_models("tiny", shapes=True, dtype="bf16"), root / "model")
    (root / "vlmctl.yaml").write_text("""
project: {name: v}
data: {prepared_dir: data/prepared, max_length: 512}
model: {preset: tiny, init: random, output_dir: model}
train:
  stage: full
  strategy: ddp
  nproc_per_node: 1
  precision: fp32
  learning_rate: 2.0e-3
  warmup_ratio: 0.0
  micro_batch_size: 2
  tokens_per_batch: 192
  max_steps: 6
  save_steps: 100
  logging_steps: 1
  eval_steps: 2
  num_workers: 0
  output_dir: runs
""")
    return root


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


TORCHRUN = ("--launcher", "torchrun", "--nproc-per-node", "2", "train.nproc_per_node=2")


def _torchrun(project: Path, *overrides: str) -> str:
    return run_train(project / "vlmctl.yaml", *TORCHRUN, *overrides, timeout=TIMEOUT)


def _start_torchrun(project: Path, *overrides: str):
    return start_train(project / "vlmctl.yaml", *TORCHRUN, *overrides)


def _reference_val_loss(model_dir: Path, project: Path) -> float:
    """The val loss of a saved model computed apart: each val sample alone, summed nats / summed tokens."""
    from vlmctl.data.loader import ShardDataset
    from vlmctl.evaluation.loss import teacher_forced_loss
    from vlmctl.models import load_model

    model, processor, _ = load_model(model_dir, dtype="fp32")
    model.eval()
    data = ShardDataset.from_dir(project / "data" / "prepared" / "val")
    per_sample = teacher_forced_loss(model, processor, [data[i] for i in range(len(data))], batch_size=1)
    return sum(n for n, _ in per_sample) / sum(t for _, t in per_sample)


@pytest.mark.timeout(TIMEOUT)
def test_single_process_validates_keeps_the_best_and_draws_val_loss(project, capsys):
    code, out, err = run_cli(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.run_name=one",
                              "train.save_best=val_loss", "train.report_to=[tensorboard]"], capsys)
    assert code == 0, out + err
    run = project / "runs" / "one"
    logged = rows(run)
    val = [r for r in logged if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4, 6]
    assert all(r["val_loss"] > 0 and r["val_label_tokens"] > 0 for r in val)
    assert len({r["val_label_tokens"] for r in val}) == 1  # every val sample, every time
    assert "val loss" in out + err
    best = min(val, key=lambda r: r["val_loss"])
    assert val[-1]["best_val_loss"] == best["val_loss"] and val[-1]["best_step"] == best["step"]
    record = json.loads((run / "final" / "best_checkpoint.json").read_text())
    assert record["step"] == best["step"] and record["checkpoint"].endswith(f"checkpoint-{best['step']}")
    assert (run / "checkpoints" / f"checkpoint-{best['step']}").is_dir()
    state = json.loads((run / "checkpoints" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["best"]["value"] == best["val_loss"] and state["best"]["step"] == best["step"]
    # the step-6 validation ran on the final weights: the same figure computed apart, sample by sample
    assert val[-1]["val_loss"] == pytest.approx(_reference_val_loss(run / "final", project), rel=1e-4)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4, 6]
    assert (run / "loss.png").is_file()


@pytest.mark.timeout(2 * TIMEOUT)
def test_resume_keeps_the_best_so_far(project, capsys):
    base = ["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.run_name=resumed",
            "train.save_best=val_loss", "train.save_steps=4"]
    code, out, err = run_cli([*base, "train.max_steps=4"], capsys)
    assert code == 0, out + err
    run = project / "runs" / "resumed"
    # a best so far that no later validation beats, as if the run had been at its best at step 2
    state_file = run / "checkpoints" / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["best"]["step"] in (2, 4)
    state["best"].update(value=1e-3, step=2)
    state_file.write_text(json.dumps(state))
    code, out, err = run_cli([*base, "--resume", "train.max_steps=6"], capsys)
    assert code == 0, out + err
    val = [r for r in rows(run) if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4, 6]
    assert val[-1]["best_val_loss"] == 1e-3 and val[-1]["best_step"] == 2
    assert json.loads((run / "final" / "best_checkpoint.json").read_text())["step"] == 2
    assert (run / "checkpoints" / "checkpoint-2").is_dir()  # the best stays past save_total_limit's pruning


@pytest.fixture(scope="module")
def gloo_runs(project):
    """The 2-rank FSDP2 run and the sequence-parallel one, the second started while the first's test waits (they do
    not share a run folder)."""
    runs = RunsAhead({
        "fsdp": lambda: _start_torchrun(project, "train.strategy=fsdp", "train.run_name=fsdp", "train.save_best=val_loss",
                                        "train.save_total_limit=1", "train.save_steps=3"),
        # SP=2 on 2 ranks: one data-parallel rank, each row of 96 x 2 tokens split over the pair
        "sp": lambda: _start_torchrun(project, "train.strategy=fsdp", "train.run_name=sp", "train.sequence_parallel=2",
                                      "train.tokens_per_batch=96", "train.max_steps=2"),
    }, timeout=TIMEOUT)
    yield runs
    runs.close()


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 30)
def test_fsdp_two_ranks_validate_every_sample_once_and_keep_the_best_past_the_limit(project, gloo_runs):
    out = gloo_runs.output("fsdp")
    run = project / "runs" / "fsdp"
    val = [r for r in rows(run) if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4, 6] and "val loss" in out
    assert "returned a view tensor" not in out  # FSDP2's warning, benign for this loop, is filtered
    # 12 val samples in an odd number of packed rows over 2 ranks: a filler row is run but not counted, and the
    # figure is the one computed apart on the exported weights
    assert val[-1]["val_loss"] == pytest.approx(_reference_val_loss(run / "final", project), rel=1e-4)
    best = min(val, key=lambda r: r["val_loss"])["step"]
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == sorted({f"checkpoint-{best}", "checkpoint-6"})


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 30)
def test_sequence_parallel_validation_sums_the_slices_of_each_row(project, gloo_runs):
    gloo_runs.output("sp")
    run = project / "runs" / "sp"
    val = [r for r in rows(run) if "val_loss" in r]
    assert [r["step"] for r in val] == [2]
    assert val[0]["val_loss"] == pytest.approx(_reference_val_loss(run / "final", project), rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT)
def test_zero3_two_ranks_validate_and_stop_early(project):
    # a learning rate this high makes the val loss worse after its first figure: patience 1 stops at the next one
    out = _torchrun(project, "train.strategy=zero3", "train.run_name=zero3", "train.learning_rate=0.5",
                    "train.early_stopping_patience=1", "train.max_steps=20", "train.max_bad_steps=20")
    run = project / "runs" / "zero3"
    val = [r for r in rows(run) if "val_loss" in r]
    assert "early stopping" in out
    assert rows(run)[-1]["step"] == val[-1]["step"] < 20
    assert val[-1]["best_step"] < val[-1]["step"] and val[-1]["val_loss"] >= val[-1]["best_val_loss"]
    state = json.loads((run / "checkpoints" / f"checkpoint-{val[-1]['step']}" / "trainer_state.json").read_text())
    assert state["reason"] == "early_stop"
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.timeout(TIMEOUT)
def test_lora_run_validates_the_adapted_model(project, capsys):
    code, out, err = run_cli(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.run_name=lora",
                              "train.stage=finetune", "train.lora.r=4", "train.lora.alpha=8", "train.max_steps=2"], capsys)
    assert code == 0, out + err
    run = project / "runs" / "lora"
    val = [r for r in rows(run) if "val_loss" in r]
    assert [r["step"] for r in val] == [2]
    # the adapters are in the validated forward: its figure is the merged export's
    assert val[0]["val_loss"] == pytest.approx(_reference_val_loss(run / "final", project), rel=1e-4)


@pytest.mark.timeout(TIMEOUT)
def test_sigterm_during_validation_saves_stops_and_resumes_with_the_runs_settings(project, capsys, monkeypatch):
    from vlmctl.train import validation

    evaluate = validation.Validator.evaluate

    def signalled(self, step):  # the signal comes while the val batches run, at the second validation
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self, step)

    monkeypatch.setattr(validation.Validator, "evaluate", signalled)
    settings = ["train.save_best=val_loss", "train.save_total_limit=1", "train.learning_rate=5e-3"]
    code, out, err = run_cli(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.run_name=signalled",
                              *settings], capsys)
    assert code == 128 + signal.SIGTERM, out + err
    run = project / "runs" / "signalled"
    stops = [line for line in (out + err).splitlines() if "stopped by signal" in line]
    assert len(stops) == 1 and "Traceback" not in out + err
    command = shlex.split(re.search(r"Continue with `([^`]+)`", " ".join((out + err).split())).group(1))
    assert command[:4] == ["vlmctl", "train", "-c", str(project / "vlmctl.yaml")] and command[4:6] == ["--launcher", "none"]
    assert all(s in command for s in settings) and command[-2:] == ["--resume", "train.run_name=signalled"]
    # the step after the signal was saved; the best so far is kept past save_total_limit=1
    state = json.loads((run / "checkpoints" / "checkpoint-5" / "trainer_state.json").read_text())
    assert state["reason"] == "signal" and state["best"]["step"] in (2, 4)
    best = state["best"]["step"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted({f"checkpoint-{best}", "checkpoint-5"})
    monkeypatch.setattr(validation.Validator, "evaluate", evaluate)
    code, out, err = run_cli(command[1:], capsys)  # as printed
    assert code == 0, out + err
    logged = rows(run)
    assert [r["step"] for r in logged if "val_loss" in r] == [2, 4, 6]
    from vlmctl.config import load_config

    resumed = load_config(run / "config.yaml").train  # the resumed run's own config: the settings were kept
    assert (resumed.learning_rate, resumed.save_total_limit, resumed.save_best) == (5e-3, 1, "val_loss")
    record = json.loads((run / "final" / "best_checkpoint.json").read_text())
    assert (run / "checkpoints" / f"checkpoint-{record['step']}" / "trainer_state.json").is_file()
    assert len(list((run / "checkpoints").iterdir())) <= 2 and not list((run / "checkpoints").glob(".*"))
