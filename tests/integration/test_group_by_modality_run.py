"""`train.group_by_modality` in a real run: 2 ranks under FSDP2 on CPU (torchrun), half the samples text-only, 2
accumulated packed rows (or padded micro-batches) per rank and step. Every step is one modality on both ranks, so a text-only step runs the
vision tower on no rank (no dummy image) and an image step on every rank; a rank that skipped the tower while the
other ran it would hang FSDP2's all-gathers, which the timeout turns into a failure.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shapes_shards import write_shapes_shards
from train_runner import RunsAhead, start_train

RUN_TIMEOUT = 150


def _start(root: Path, packing: bool, model: Path):
    """Build the project in `root` (a copy of the tiny `model`, 48 samples, half text-only) and start its 2-rank run."""
    root.mkdir()
    write_shapes_shards(root / "data", 48, text_only_every=2)
    shutil.copytree(model, root / "model")
    (root / "vlmctl.yaml").write_text(f"""
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
    return start_train(root / "vlmctl.yaml", "--launcher", "torchrun", "--nproc-per-node", "2")


PACKING = [True, False]


@pytest.fixture(scope="module")
def grouped_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("grouped")


@pytest.fixture(scope="module")
def grouped_runs(grouped_root, tiny_models):
    """The packed and the padded run, each in a project `<grouped_root>/packing=<bool>`; the second starts while the
    first one's test waits (RunsAhead), so two runs share the cores: twice the time of one to wait for."""
    model = tiny_models("tiny", shapes=True, dtype="bf16")
    runs = RunsAhead({f"packing={p}": (lambda p=p: _start(grouped_root / f"packing={p}", p, model)) for p in PACKING},
                     timeout=2 * RUN_TIMEOUT)
    yield runs
    runs.close()


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
@pytest.mark.parametrize("packing", PACKING)
def test_fsdp_two_ranks_train_one_modality_per_step_without_dummies(grouped_root, grouped_runs, packing):
    grouped_runs.output(f"packing={packing}")
    run = grouped_root / f"packing={packing}" / "runs" / "grouped"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["loss"] == r["loss"] > 0 for r in rows)
    assert all(r["dummy_images"] == 0 for r in rows)  # no rank ran a dummy image
    visual = [r["visual_tokens"] for r in rows]
    assert 0 in visual and any(v > 0 for v in visual), visual  # text-only steps and image steps both ran
    assert (run / "final" / "model.safetensors").is_file()
