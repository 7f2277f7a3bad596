"""SIGTERM while a run validates, in one process (`--launcher none`) on the tiny model: the run finishes the step,
saves and stops with one line whose resume command keeps the run's command-line settings; that command, run as
printed, continues from the checkpoint and finishes, and the best checkpoint survived `save_total_limit` and is
the one `final/best_checkpoint.json` names."""

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

TOKENIZER_TEXTS = ["What color is the triangle? How many circles are there? What shape is the red object? "
                   "red green blue yellow purple yes no 0 1 2 3"] * 20


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    root = tmp_path_factory.mktemp("best-faults")
    write_shapes_shards(root / "data", 24)
    write_shapes_shards(root / "held", 6, text_only_every=3)
    shutil.move(root / "held" / "prepared" / "train", root / "data" / "prepared" / "val")
    build_model(ModelSection(preset="tiny", init="random", output_dir=root / "model"), tokenizer_texts=TOKENIZER_TEXTS)
    (root / "vlmctl.yaml").write_text("""
project: {name: b}
data: {prepared_dir: data/prepared, max_length: 512}
model: {preset: tiny, init: random, output_dir: model}
train: {stage: full, strategy: ddp, nproc_per_node: 1, precision: fp32, learning_rate: 1.0e-3, warmup_ratio: 0.0,
        micro_batch_size: 2, tokens_per_batch: 192, max_steps: 4, save_steps: 100, logging_steps: 1, num_workers: 0,
        output_dir: runs}
""")
    return root


@pytest.mark.timeout(600)
def test_sigterm_during_validation_saves_stops_and_resumes_with_the_runs_settings(project, capsys, monkeypatch):
    from vlmctl.train import validation

    monkeypatch.chdir(project)
    evaluate = validation.Validator.evaluate

    def signalled(self, step):  # the signal comes while the val batches run, at the second validation
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self, step)

    monkeypatch.setattr(validation.Validator, "evaluate", signalled)
    settings = ["train.max_steps=8", "train.eval_steps=2", "train.save_best=val_loss", "train.save_total_limit=1",
                "train.learning_rate=5e-3"]
    code, out, err = run_cli(["train", "--launcher", "none", "train.run_name=faults", *settings], capsys)
    assert code == 128 + signal.SIGTERM, out + err
    run = project / "runs" / "faults"
    stops = [line for line in (out + err).splitlines() if "stopped by signal" in line]
    assert len(stops) == 1 and "Traceback" not in out + err
    command = shlex.split(re.search(r"Continue with `([^`]+)`", " ".join((out + err).split())).group(1))
    assert command[:2] == ["vlmctl", "train"] and "--resume" in command and "train.run_name=faults" in command
    assert all(s in command for s in settings) and ["--launcher", "none"] == command[2:4]
    # the step after the signal was saved; the best so far is kept past save_total_limit=1
    state = json.loads((run / "checkpoints" / "checkpoint-5" / "trainer_state.json").read_text())
    assert state["reason"] == "signal" and state["best"]["step"] in (2, 4)
    best = state["best"]["step"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted({f"checkpoint-{best}", "checkpoint-5"})
    monkeypatch.setattr(validation.Validator, "evaluate", evaluate)
    code, out, err = run_cli(command[1:], capsys)  # as printed
    assert code == 0, out + err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4, 6, 8]
    assert all(r["lr"] <= 5e-3 for r in rows) and max(r["lr"] for r in rows) > 1e-3  # the run's learning rate, kept
    record = json.loads((run / "final" / "best_checkpoint.json").read_text())
    assert (run / "checkpoints" / f"checkpoint-{record['step']}" / "trainer_state.json").is_file()
    assert len(list((run / "checkpoints").iterdir())) <= 2 and not list((run / "checkpoints").glob(".*"))
