"""`vlmctl train` and `vlmctl bench` end to end on one GPU: a run killed after its checkpoint resumes to the
uninterrupted run's loss curve (LoRA dropout draws from the CUDA generator, which the checkpoint carries), and the
start-up probe sizes the batch and checkpointing of a run left at `auto` (its memory trials on the card).

Tolerance: the resumed losses within rel 1e-4 of the uninterrupted ones, in fp32 (GPU kernels that sum with atomics
are not bitwise reproducible; in bf16 two identical runs already differ by more; a wrong dropout mask moves the loss
by far more)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TIMEOUT = 240


@pytest.fixture(scope="module")
def project(built, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    (root / "vlmctl.yaml").write_text(f"""
project: {{name: gpu}}
data: {{prepared_dir: {built / 'data' / 'prepared'}, max_length: 512}}
model: {{preset: tiny-qwen2.5-vl, init: random, dtype: fp32, output_dir: {built / 'tiny-qwen2.5-vl'}}}
train:
  stage: finetune
  strategy: fsdp
  nproc_per_node: 1
  precision: fp32
  # compiled fp32 LoRA layers fail in inductor's partitioner on torch 2.11 ("Node add_550 was invalid, but is
  # output"); this test is about resuming, the compiled paths are test_training_paths.py's
  compile: off
  learning_rate: 1.0e-3
  warmup_ratio: 0.0
  tokens_per_batch: 420
  max_steps: 6
  save_steps: 3
  logging_steps: 1
  num_workers: 0
  output_dir: runs
  lora: {{r: 8, alpha: 16, dropout: 0.5}}
""")
    return root


def _cli(project: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "vlmctl", "-c", str(project / "vlmctl.yaml"), *args], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _run(project: Path, *args: str) -> str:
    proc = _cli(project, *args)
    try:
        out = proc.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"vlmctl {' '.join(args)} did not finish in {TIMEOUT} s:\n{proc.communicate()[0][-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_a_killed_gpu_run_resumes_to_the_uninterrupted_curve(project):
    _run(project, "train", "train.run_name=whole")
    whole = losses(project / "runs" / "whole")
    assert len(whole) == 6
    run = project / "runs" / "killed"
    proc = _cli(project, "train", "train.run_name=killed")
    deadline = time.monotonic() + TIMEOUT
    while not (run / "checkpoints" / "checkpoint-3").is_dir() or any(p.name.startswith(".") for p in (run / "checkpoints").iterdir()):
        assert proc.poll() is None or (run / "checkpoints" / "checkpoint-3").is_dir(), proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "no checkpoint-3 in time"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for p in (run / "checkpoints").iterdir():
        if p.name != "checkpoint-3":
            subprocess.run(["rm", "-rf", str(p)], check=True)
    subprocess.run(["rm", "-rf", str(run / "final")], check=True)
    _run(project, "train", "--resume", "train.run_name=killed")
    resumed = losses(run)
    assert resumed[:3] == pytest.approx(whole[:3], rel=1e-4)
    assert resumed[-3:] == pytest.approx(whole[-3:], rel=1e-4)


def test_the_startup_probe_sizes_an_auto_run_on_the_card(project):
    out = _run(project, "--quiet", "bench", "--json", "--steps", "2", "--warmup", "1", "train.tokens_per_batch=auto",
               "train.activation_checkpointing=auto")
    result = json.loads(out[out.index("{"):])
    trials = (result["auto"] or {}).get("trials")
    assert trials, result  # [mode, tokens, peak GiB, seconds, out of memory]
    assert all(peak > 0 for _, _, peak, _, oom in trials if not oom)
    assert "tokens per row" in result["settings"] and "[auto" in result["settings"] or "auto" in result["settings"]
    assert 0 < result["peak_memory_gib"] and result["tokens_per_s"] > 0
