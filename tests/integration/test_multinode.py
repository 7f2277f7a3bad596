"""`vlmctl train` over several nodes, on one machine: two launchers (`train.nnodes=2`, node_rank 0 and 1, one
rendezvous through torchrun's c10d) of 2 CPU processes each (gloo), full and hybrid FSDP2 sharding, a checkpoint of
the 4 ranks resumed on 1 node x 2 ranks (DCP resharding), and the generated sbatch script run end to end by a
stand-in SLURM (`tests/fake_slurm.py`: 2 nodes, one torchrun of 2 processes each).

The runs share one built tiny model and prepared data set (module fixture) and take 4 steps of one packed row per
rank. Every run has a timeout and kills its process groups (launchers, agents; the ranks die with their agent)
when it fails.
"""

from __future__ import annotations

import shutil
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_slurm import JOB_ID, install
from shapes_shards import write_shapes_shards

RUN_TIMEOUT = 240  # 4 ranks on 2 CPU cores


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_models) -> Path:
    """A built tiny model, prepared shards and a vlmctl.yaml for 4-step FSDP2 runs of 2 processes per node."""

    root = tmp_path_factory.mktemp("multinode")
    write_shapes_shards(root / "data", 48)
    shutil.copytree(tiny_models("tiny", shapes=True, dtype="bf16"), root / "model")
    (root / "vlmctl.yaml").write_text("""
project: {name: m}
data: {prepared_dir: data/prepared, max_length: 512}
model: {preset: tiny, init: random, output_dir: model}
train: {stage: full, strategy: fsdp, nproc_per_node: 2, precision: fp32, learning_rate: 2.0e-3, warmup_ratio: 0.0,
        tokens_per_batch: 192, max_steps: 4, save_steps: 2, logging_steps: 1, num_workers: 0, output_dir: runs}
""")
    return root


def _start(project: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`vlmctl train ARGS` in a process group of its own (killed whole when the test fails)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "vlmctl", "-c", str(project / "vlmctl.yaml"), "train", *args]
    return subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(procs: list[subprocess.Popen], timeout: int = RUN_TIMEOUT) -> list[str]:
    """Wait for every process; on a timeout or a failure kill all their process groups and fail with the output."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        outs += [proc.communicate()[0] for proc in procs[len(outs):]]
        pytest.fail(f"not finished within {timeout}s (hang?):\n" + "\n-----\n".join(o[-3000:] for o in outs))
    if any(p.returncode != 0 for p in procs):
        for proc in procs:  # a launcher that failed leaves the other node waiting in the rendezvous
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"exit codes {[p.returncode for p in procs]}:\n" + "\n-----\n".join(o[-4000:] for o in outs))
    return outs


def _two_nodes(project: Path, name: str, *overrides: str) -> list[str]:
    """Node 0 and node 1 started together, 2 processes each, one rendezvous on a free port of this machine."""
    from vlmctl.distributed.env import free_port

    port = str(free_port())
    common = ["--launcher", "torchrun", "--nproc-per-node", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", port, f"train.run_name={name}", *overrides]
    return _finish([_start(project, *common, "--node-rank", str(rank)) for rank in (0, 1)])


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _state(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").read_text())


def _chunks(checkpoint: Path, key: str) -> list[tuple[int, ...]]:
    """The offsets of the pieces DCP stored of tensor `key`: one per rank that holds a distinct shard."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata[key]
    return sorted(tuple(c.offsets) for c in meta.chunks)


WEIGHT = "model.model.language_model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def full_run(project) -> Path:
    """2 nodes x 2 processes, full sharding over the 4 ranks, checkpoints at steps 2 and 4."""
    _two_nodes(project, "full")
    return project / "runs" / "full"


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_two_nodes_of_two_processes_train_into_one_run_folder(full_run):
    rows = metrics(full_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert [_state(full_run, s)["world_size"] for s in (2, 4)] == [4, 4]
    # sharded over all 4 ranks: four pieces of every weight
    assert len(_chunks(full_run / "checkpoints" / "checkpoint-4", WEIGHT)) == 4
    assert (full_run / "final" / "model.safetensors").is_file()
    # node 0 locked the folder (released at its end) and wrote config.yaml; node 1 kept its own log next to node 0's
    assert not (full_run / ".lock").exists()
    assert "nnodes: 2" in (full_run / "config.yaml").read_text()
    logs = [(full_run / name).read_text() for name in ("train.log", "train-node1.log")]
    # the step lines come from global rank 0, on whichever node the rendezvous ordered first
    assert sum("step 4/4" in log for log in logs) == 1


@pytest.fixture(scope="module")
def hybrid_run(project) -> Path:
    """The same with hybrid sharding: sharded over the 2 processes of a node, replicated across the 2 nodes."""
    _two_nodes(project, "hybrid", "train.fsdp_sharding=hybrid")
    return project / "runs" / "hybrid"


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_hybrid_sharding_shards_within_a_node_and_matches_full_sharding(full_run, hybrid_run):
    run = hybrid_run
    full, hybrid = metrics(full_run), metrics(run)
    assert len(hybrid) == len(full) == 4
    for a, b in zip(full, hybrid):  # the same global batches; only the order of the gradient sums differs
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    # sharded over the 2 processes of a node and replicated across the nodes: two pieces of every weight
    checkpoint = run / "checkpoints" / "checkpoint-4"
    assert len(_chunks(checkpoint, WEIGHT)) == 2
    assert _state(run, 4)["world_size"] == 4


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_a_checkpoint_of_two_nodes_resumes_on_one_node(project, hybrid_run):
    # the hybrid (2 x 2) checkpoint of step 2, resumed on 1 node x 2 ranks with full sharding: DCP reshards it
    source = hybrid_run
    run = project / "runs" / "resumed"
    run.mkdir()
    subprocess.run(["cp", "-r", str(source / "checkpoints"), str(run / "checkpoints")], check=True)
    subprocess.run(["rm", "-rf", str(run / "checkpoints" / "checkpoint-4")], check=True)
    before = metrics(source)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before[:2]))
    from vlmctl.distributed.env import free_port

    # 2 ranks x 2 accumulated rows: the global batch of the 4 ranks
    out, = _finish([_start(project, "--launcher", "torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()),
                           "--resume", "train.run_name=resumed", "train.gradient_accumulation_steps=2")])
    assert "written by 4 ranks, resuming with 2" in out
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert _state(run, 4)["world_size"] == 2
    # The curve goes on from the restored weights and optimizer, on the same global micro-batches: the per-rank
    # position is rescaled from 4 ranks to 2 (`TrainState.from_checkpoint`), so steps 3 and 4 see the samples the
    # 4-rank run saw and their losses match it.
    after = metrics(source)
    assert [r["step"] for r in after[2:4]] == [3, 4]  # rows to compare with: an empty zip would pass
    for resumed, original in zip(rows[2:], after[2:4], strict=True):
        assert resumed["loss"] == pytest.approx(original["loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_the_sbatch_script_runs_on_a_two_node_allocation(project, full_run, tmp_path):
    from vlmctl.distributed.env import free_port

    bin_dir = install(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out, = _finish([_start(project, "--launcher", "slurm", "--nnodes", "2", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "train.run_name=slurm", env=env)])
    run = project / "runs" / "slurm"
    assert f"Submitted batch job {JOB_ID}" in out
    job_log = (run / f"slurm-{JOB_ID}.out").read_text()
    assert "step 4/4" in job_log
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert _state(run, 4)["world_size"] == 4 and (run / "final" / "model.safetensors").is_file()
    # the same 4 ranks and global batches as the two torchrun launchers
    for a, b in zip(metrics(full_run), rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert "resume: auto" in (run / "config.yaml").read_text()  # a requeued job continues from its checkpoint
