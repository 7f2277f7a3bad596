"""`train.group_by_modality` in a real run: 2 ranks under FSDP2 on CPU (torchrun), half the samples text-only, 2
accumulated packed rows (or padded micro-batches) per rank and step. Every step is one modality on both ranks, so a text-only step runs the
vision tower on no rank (no dummy image) and an image step on every rank; a rank that skipped the tower while the
other ran it would hang FSDP2's all-gathers, which the timeout turns into a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shapes_shards import write_shapes_shards

RUN_TIMEOUT = 150
TOKENIZER_TEXTS = ["What color is the triangle? How many circles are there? Is the square left of the circle? "
                   "What shape is the red object? Answer with one word. red green blue yellow purple yes no 0 1 2 3"] * 20


def _train(project: Path, *overrides: str) -> str:
    """`vlmctl train` under torchrun (2 ranks) in its own process group, killed with its ranks on a timeout."""
    from vlmctl.distributed.env import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vlmctl", "-c", str(project / "vlmctl.yaml"), "train", "--launcher", "torchrun",
           "--nproc-per-node", "2", "--master-port", str(free_port()), *overrides]
    proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"training did not finish within {RUN_TIMEOUT}s (hang?):\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize("packing", [True, False])
def test_fsdp_two_ranks_train_one_modality_per_step_without_dummies(tmp_path, packing):
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    write_shapes_shards(tmp_path / "data", 48, text_only_every=2)
    build_model(ModelSection(preset="tiny", init="random", output_dir=tmp_path / "model"), tokenizer_texts=TOKENIZER_TEXTS)
    (tmp_path / "vlmctl.yaml").write_text(f"""
project: {{name: g}}
data: {{prepared_dir: data/prepared, max_length: 512}}
model: {{preset: tiny, init: random, output_dir: model}}
train:
  stage: full
  strategy: fsdp
  nproc_per_node: 2
  precision: fp32
  learning_rate: 2.0e-3
  warmup_ratio: 0.0
  packing: {str(packing).lower()}
  tokens_per_batch: 192
  micro_batch_size: 2
  gradient_accumulation_steps: 2
  group_by_modality: true
  max_steps: 6
  save_steps: 100
  logging_steps: 1
  num_workers: 0
  output_dir: runs
  run_name: grouped
""")
    _train(tmp_path)
    run = tmp_path / "runs" / "grouped"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["loss"] == r["loss"] > 0 for r in rows)
    assert all(r["dummy_images"] == 0 for r in rows)  # no rank ran a dummy image
    visual = [r["visual_tokens"] for r in rows]
    assert 0 in visual and any(v > 0 for v in visual), visual  # text-only steps and image steps both ran
    assert (run / "final" / "model.safetensors").is_file()
