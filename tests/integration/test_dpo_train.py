"""`vlmctl train` with `train.objective: dpo` on CPU: a tiny LLaVA on shapes-VQA preference pairs (the correct
answer chosen, another answer of the same question type rejected), with each reference (a frozen copy, the LoRA
base with the adapter off, log-probs precomputed before the first step), in one process, on 2 ranks under FSDP2
and under ZeRO-3, and resumed from a checkpoint.

At the first step the policy is the reference, so every pair's margin is 0 and the sigmoid loss is exactly
log 2 (DPO, arXiv 2305.18290, Eq. 7): each run is checked against that, then for learning."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from preference_data import write_pair_shards
from train_runner import RunsAhead, run_train, start_train

RUN_TIMEOUT = 240


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_models) -> Path:

    root = tmp_path_factory.mktemp("dpo")
    write_pair_shards(root / "data", 12)
    shutil.copytree(tiny_models("tiny", shapes=True, dtype="fp32"), root / "model")
    (root / "vlmctl.yaml").write_text("""
project: {name: d}
data: {prepared_dir: data/prepared, max_length: 512}
model: {preset: tiny, init: random, output_dir: model}
train:
  objective: dpo
  dpo: {beta: 0.5}
  stage: full
  strategy: ddp
  nproc_per_node: 1
  precision: fp32
  learning_rate: 1.0e-3
  warmup_ratio: 0.0
  tokens_per_batch: 4000
  max_steps: 6
  save_steps: 3
  logging_steps: 1
  num_workers: 0
  output_dir: runs
""")
    return root


def _run(project: Path, *args: str, timeout: int = RUN_TIMEOUT) -> str:
    return run_train(project / "vlmctl.yaml", *args, timeout=timeout)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _check_learns(run: Path) -> list[dict]:
    got = rows(run)
    assert [r["step"] for r in got] == list(range(1, 7))
    first = got[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy is the reference at step 1
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies"):
        assert key in first
    assert got[-1]["loss"] < math.log(2) - 0.1  # the same pairs every step (one row holds them all)
    assert got[-1]["rewards/margins"] > 0
    assert (run / "final" / "model.safetensors").is_file() or (run / "final" / "adapter_model.safetensors").is_file()
    return got


@pytest.fixture(scope="module")
def one_process_runs(project):
    """The LoRA run and the frozen-reference run, one process each: the second starts while the first one's test waits
    (RunsAhead), so the two share the 2 cores. Both end before the precomputed run adds a val split to the data."""
    runs = RunsAhead({
        "lora": lambda: start_train(project / "vlmctl.yaml", "--launcher", "none", "train.run_name=lora", "train.stage=finetune",
                                    "train.lora.r=8", "train.lora.alpha=16", "train.dpo.reference=adapter_disabled",
                                    "train.learning_rate=1.0e-2"),
        "frozen": lambda: start_train(project / "vlmctl.yaml", "--launcher", "none", "train.run_name=frozen"),
    }, timeout=2 * RUN_TIMEOUT)
    yield runs
    runs.close()


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_lora_reference_is_the_base_with_the_adapter_off(project, one_process_runs):
    one_process_runs.output("lora")
    _check_learns(project / "runs" / "lora")


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_one_process_frozen_and_precomputed_references_agree(project, one_process_runs):
    one_process_runs.output("frozen")
    frozen = _check_learns(project / "runs" / "frozen")
    # the val split: the training pairs again, so the val loss at a step reads the pairs the step trained on
    val = project / "data" / "prepared" / "val"
    shutil.copytree(project / "data" / "prepared" / "train", val, dirs_exist_ok=True)
    try:  # padded micro-batches of pairs (the tiny template's packing: false): the packed run's figures
        _run(project, "--launcher", "none", "train.run_name=pre", "train.dpo.reference=precomputed", "train.eval_steps=3",
             "train.packing=false", "train.micro_batch_size=12")
    finally:
        shutil.rmtree(val)
    pre = _check_learns(project / "runs" / "pre")
    stored = json.loads((project / "runs" / "pre" / "reference_logps.json").read_text())
    assert len(stored) >= 8 and all(c < 0 and r < 0 for c, r in stored.values())
    val_rows = [r for r in pre if "val_loss" in r]
    assert len(val_rows) == 2 and val_rows[1]["val_loss"] < val_rows[0]["val_loss"] < math.log(2)
    assert val_rows[1]["val_rewards/margins"] > 0 and "val_rewards/accuracies" in val_rows[0]  # TRL's eval rewards
    assert len(frozen) == len(pre) == 6
    for a, b in zip(frozen, pre):  # one pair per forward and padded rows vs packed rows: the same sums up to rounding
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], abs=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_fsdp_two_ranks_precomputed_resume_reproduces_the_run(project):
    args = ["--launcher", "torchrun", "--nproc-per-node", "2", "train.nproc_per_node=2", "train.tokens_per_batch=2000", "train.strategy=fsdp",
            "train.run_name=fsdp", "train.dpo.reference=precomputed"]
    _run(project, *args)
    run = project / "runs" / "fsdp"
    before = _check_learns(run)
    shutil.rmtree(run / "checkpoints" / "checkpoint-6")
    shutil.rmtree(run / "final")
    _run(project, *args, "--resume")
    assert [r["loss"] for r in rows(run)] == [r["loss"] for r in before]  # bitwise on CPU


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_TIMEOUT)
def test_zero3_two_ranks_frozen_reference_trains_and_resumes(project):
    # The first DeepSpeed run on a machine compiles its CPU communication op (1-2 min, cached afterwards).
    args = ["--launcher", "torchrun", "--nproc-per-node", "2", "train.nproc_per_node=2", "train.tokens_per_batch=2000", "train.strategy=zero3",
            "train.run_name=zero3"]
    _run(project, *args, timeout=2 * RUN_TIMEOUT)
    run = project / "runs" / "zero3"
    before = _check_learns(run)
    shutil.rmtree(run / "checkpoints" / "checkpoint-6")
    shutil.rmtree(run / "final")
    _run(project, *args, "--resume")
    assert [r["loss"] for r in rows(run)] == [r["loss"] for r in before]


def test_dpo_on_conversation_shards_stops_before_loading_the_model(tmp_path, capsys):
    from cli_runner import run_cli
    from shapes_shards import write_shapes_shards

    write_shapes_shards(tmp_path / "data", 4)
    (tmp_path / "vlmctl.yaml").write_text("project: {name: c}\ndata: {prepared_dir: data/prepared}\n"
                                          "model: {preset: tiny, init: random, output_dir: model}\n"
                                          "train: {objective: dpo, strategy: ddp, nproc_per_node: 1, output_dir: runs}\n")
    code, _, err = run_cli(["-c", str(tmp_path / "vlmctl.yaml"), "train", "--launcher", "none"], capsys)
    assert code != 0 and "train.objective dpo trains on preference pairs" in err and "data.kind=preference" in err
