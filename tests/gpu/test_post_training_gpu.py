"""`vlmctl train` with `train.objective: dpo` and `grpo` on one GPU with the defaults a GPU run gets (bf16, varlen
attention, liger-kernel's patched forwards, compiled layers, FSDP2 over an NCCL process group). DPO: liger's forward
hands the LM head every position when it gets no labels, which the answers' log-probs must survive
(`kernels.chunked_loss_head`), and the frozen reference is compiled and sharded like the policy. GRPO: the rollouts
are generated from left-padded rows (sdpa, not the varlen kernel; compiled layers run eagerly) and the step's
statistics are all-reduced on the GPU.

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


def _train(project: Path, *overrides: str, name: str | None = None) -> list[dict]:
    name = name or overrides[0].split("=")[-1]
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


def test_grpo_generates_and_trains_on_the_gpu_defaults(project, built):
    # num_iterations 2: steps 1 and 3 generate, step 2 trains again on step 1's rollouts against their log-probs
    # scored at generation time (on the GPU model, from the rows' CPU tensors)
    rows = _train(project, "train.objective=grpo", f"data.prepared_dir={built / 'data' / 'prepared'}",
                  "train.micro_batch_size=2", "train.grpo.group_size=4", "train.grpo.max_new_tokens=8", "train.max_steps=3",
                  "train.grpo.num_iterations=2", name="grpo")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollouts"] for r in rows] == [8, 0, 8]
    assert rows[1]["reward"] == rows[0]["reward"] and rows[1]["label_tokens"] == rows[0]["label_tokens"]
    for r in (rows[0], rows[2]):
        assert r["rollouts_per_s"] > 0 and r["time/rollout_s"] > 0 and r["time/train_s"] > 0
        # rollouts from the decoding engine's replica: its log-probs are the trainer's up to bf16 rounding
        assert 0 <= r["logprob_gap/mean"] < 0.1 and r["logprob_gap/max"] >= r["logprob_gap/mean"]
    for r in rows:
        assert math.isfinite(r["loss"]) and 0 <= r["reward"] <= 1
