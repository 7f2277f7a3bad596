"""`vlmctl train` with `train.objective: dpo` on one GPU with the defaults a GPU run gets (bf16, varlen attention,
liger-kernel's patched forwards, compiled layers, FSDP2): liger's forward hands the LM head every position when it
gets no labels, which the answers' log-probs must survive (`kernels.chunked_loss_head`), and the frozen reference
is compiled and sharded like the policy.

At the first step the policy is the reference: margins 0 and the sigmoid loss log 2 (in bf16 both sides run the
same kernels on the same weights, so the tolerance is rounding: 1e-2)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT = 420


@pytest.fixture(scope="module")
def project(built, tmp_path_factory) -> Path:
    from preference_data import write_pair_shards

    root = tmp_path_factory.mktemp("dpo")
    write_pair_shards(root / "data", 24)
    (root / "vlmctl.yaml").write_text(f"""
project: {{name: dpo}}
data: {{prepared_dir: data/prepared, max_length: 512}}
model: {{preset: tiny-qwen2.5-vl, init: random, output_dir: {built / 'tiny-qwen2.5-vl'}}}
train:
  objective: dpo
  dpo: {{beta: 0.5}}
  stage: full
  strategy: fsdp
  nproc_per_node: 1
  learning_rate: 1.0e-3
  warmup_ratio: 0.0
  tokens_per_batch: 4000
  max_steps: 5
  save_steps: 100
  logging_steps: 1
  num_workers: 0
  output_dir: runs
""")
    return root


def _train(project: Path, *overrides: str) -> list[dict]:
    name = overrides[0].split("=")[-1]
    proc = subprocess.run([sys.executable, "-m", "vlmctl", "-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none",
                           f"train.run_name={name}", *overrides], cwd=project, capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run = project / "runs" / name
    plan = json.loads((run / "plan.json").read_text())
    decided = plan["decisions"]
    assert decided["liger"]["value"] and decided["precision"]["value"] == "bf16", decided
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("reference", ["frozen", "precomputed"])
def test_dpo_trains_on_the_gpu_defaults(project, reference):
    rows = _train(project, f"train.dpo.reference={reference}")
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-2)
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=2e-2)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.05 and rows[-1]["rewards/margins"] > 0
