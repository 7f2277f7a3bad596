"""Several nodes without a training run: every node's launch command (`--dry-run`), the settings a multi-node
launch refuses, how node 1 shares node 0's run folder, the hybrid-sharding mesh (`ParallelDims`), and HSDP on 4 gloo
processes (2 "nodes" of 2) against full sharding. The runs themselves are in tests/integration/test_multinode.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from cli_runner import run_cli as run_cli_inprocess
from vlmctl.distributed.mesh import SHARDING_ENV, ParallelDims
from vlmctl.errors import ConfigError, UsageError

PROJECT = "project: {name: p}\ntrain: {strategy: fsdp, nproc_per_node: 2}\n"
TWO_NODES = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "6000", "train.run_name=r1"]


def test_dry_run_prints_the_command_of_every_node(ready_config, capsys):
    cfg = ready_config(PROJECT)
    run_dir = cfg.parent / "outputs" / "runs" / "r1"
    code, out, err = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", *TWO_NODES, "train.fsdp_sharding=hybrid"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert [line for line in lines if line.startswith("#")] == ["# node 0 of 2 (vlmctl train --node-rank 0 there)",
                                                               "# node 1 of 2 (vlmctl train --node-rank 1 there)"]
    commands = [line for line in lines if not line.startswith("#")]
    assert len(commands) == 2
    for rank, command in enumerate(commands):
        assert command.startswith(f"{SHARDING_ENV}=hybrid ")
        assert (f"torchrun --nproc-per-node 2 --nnodes 2 --node-rank {rank} --rdzv-backend c10d --rdzv-endpoint "
                f"10.0.0.1:6000 --rdzv-id r1 -m vlmctl.train.worker {run_dir}") in command
    assert not run_dir.exists()  # a dry run writes nothing
    code, out, _ = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", "--launcher", "accelerate", *TWO_NODES], capsys)
    assert code == 0 and SHARDING_ENV not in out  # full sharding is the ranks' default
    for rank in (0, 1):
        assert (f"launch --num_processes 4 --num_machines 2 --machine_rank {rank} --main_process_ip 10.0.0.1 "
                "--main_process_port 6000") in out


def test_dry_run_of_slurm_prints_the_script_and_writes_nothing(ready_config, capsys):
    cfg = ready_config(PROJECT)
    code, out, err = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", "--launcher", "slurm", "--nnodes", "2",
                                        "train.run_name=s1", "train.fsdp_sharding=hybrid"], capsys)
    assert code == 0, err
    run_dir = cfg.parent / "outputs" / "runs" / "s1"
    assert out.startswith(f"sbatch {run_dir / 'sbatch.sh'}\n#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 f"export {SHARDING_ENV}=hybrid", '--nproc-per-node 2 --nnodes "$SLURM_NNODES"'):
        assert line in out
    assert not run_dir.exists()


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1", "train.run_name=r"], "train.node_rank=2 is not below train.nnodes=2"),
    (["--nnodes", "2", "--master-addr", "10.0.0.1"], "train.nnodes=2 needs train.run_name"),
    (["--nnodes", "2", "train.run_name=r"], "needs the rendezvous host of node 0"),
    (["--nnodes", "2", "--launcher", "none", "train.run_name=r"], "train.launcher=none runs one process here"),
    (["--strategy", "ddp", "train.fsdp_sharding=hybrid"], "train.fsdp_sharding=hybrid needs train.strategy=fsdp, not ddp"),
    (["--launcher", "slurm", "--nproc-per-node", "auto"], "train.launcher=slurm needs train.nproc_per_node"),
])
def test_multi_node_settings_that_cannot_run_are_refused_naming_the_key(write_config, capsys, args, message):
    cfg = write_config(PROJECT)
    code, _, err = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", *args], capsys)
    assert code == 2 and message in " ".join(err.replace("│", " ").split()), err


def test_node_1_shares_the_folder_node_0_holds(write_config, monkeypatch):
    from vlmctl.config import load_config
    from vlmctl.distributed.process import start_time
    from vlmctl.train import launch
    from vlmctl.train.rundir import LOCK_FILE

    monkeypatch.setattr(launch, "preflight", lambda cfg, run_dir=None: None)  # no data or model in this project
    cfg_path = write_config(PROJECT)
    overrides = ["train.nnodes=2", "train.master_addr=10.0.0.1", "train.run_name=r1"]
    run_dir = cfg_path.parent / "outputs" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # node 0's launcher
    try:
        lock = {"pid": holder.pid, "host": socket.gethostname(), "start": start_time(holder.pid)}
        (run_dir / LOCK_FILE).write_text(json.dumps(lock))
        (run_dir / "config.yaml").write_text("written by node 0\n")
        (run_dir / ".config.yaml.tmp").write_text("node 0 is writing")
        node1 = load_config(cfg_path, [*overrides, "train.node_rank=1"])
        assert launch.prepare_run(node1) == run_dir  # not refused as in use
        assert json.loads((run_dir / LOCK_FILE).read_text()) == lock  # node 0's lock stays
        assert (run_dir / "config.yaml").read_text() == "written by node 0\n"
        assert (run_dir / ".config.yaml.tmp").exists()  # nothing swept under node 0's ranks
        assert launch.log_name(node1.train) == "train-node1.log"
        node0 = load_config(cfg_path, [*overrides, "train.node_rank=0"])
        assert launch.log_name(node0.train) == "train.log"
        with pytest.raises(UsageError, match="in use by process"):  # a second node 0 is refused
            launch.prepare_run(node0)
    finally:
        holder.kill()
        holder.wait()


def test_node_1_creates_the_folder_when_it_comes_first_and_node_0_claims_it(write_config, monkeypatch):
    from vlmctl.config import load_config
    from vlmctl.train import launch
    from vlmctl.train.rundir import LOCK_FILE, release_run

    monkeypatch.setattr(launch, "preflight", lambda cfg, run_dir=None: None)
    cfg_path = write_config(PROJECT)
    overrides = ["train.nnodes=2", "train.master_addr=10.0.0.1", "train.run_name=r1"]
    run_dir = launch.prepare_run(load_config(cfg_path, [*overrides, "train.node_rank=1"]))
    assert run_dir.is_dir() and not list(run_dir.iterdir())
    (run_dir / "train-node1.log").write_text("node 1's output\n")
    assert launch.prepare_run(load_config(cfg_path, [*overrides, "train.node_rank=0"])) == run_dir  # a fresh run
    try:
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert "node_rank: 0" in (run_dir / "config.yaml").read_text()
    finally:
        release_run(run_dir)


# ------------------------------------------------------------------------------------------ the hybrid mesh


def test_hybrid_sharding_puts_nodes_on_dp_replicate_and_a_node_on_dp_shard(monkeypatch):
    for key in ("LOCAL_WORLD_SIZE", SHARDING_ENV):
        monkeypatch.delenv(key, raising=False)
    dims = ParallelDims.for_strategy("fsdp", 16, sharding="hybrid", ranks_per_node=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_size) == (2, 8, 16)
    assert dims.mesh_dims() == (("dp_replicate", "dp_shard"), (2, 8))
    # torchrun's LOCAL_WORLD_SIZE and the launcher's variable, as the ranks see them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv(SHARDING_ENV, "hybrid")
    assert ParallelDims.for_strategy("fsdp", 8).mesh_dims() == (("dp_replicate", "dp_shard"), (2, 4))
    assert ParallelDims.for_strategy("fsdp", 8, sharding="full").mesh_dims() == (("dp_shard",), (8,))
    # one node: the same mesh as full sharding; one process per node: replicated, dp_shard kept for FSDP2
    assert ParallelDims.for_strategy("fsdp", 4, ranks_per_node=4).mesh_dims() == (("dp_shard",), (4,))
    assert ParallelDims.for_strategy("fsdp", 2, ranks_per_node=1).mesh_dims() == (("dp_replicate", "dp_shard"), (2, 1))


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "ddp", "world_size": 4, "sharding": "hybrid", "ranks_per_node": 2}, "needs train.strategy=fsdp, not ddp"),
    ({"strategy": "fsdp", "world_size": 4, "sharding": "half"}, "train.fsdp_sharding = 'half' is not one of full, hybrid"),
    ({"strategy": "fsdp", "world_size": 6, "sharding": "hybrid", "ranks_per_node": 4}, "the same number of processes on every node"),
])
def test_hybrid_sharding_refuses_what_it_cannot_build(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelDims.for_strategy(**kwargs)


def _hsdp_rank(rank: int, port: int, out: str) -> None:
    """One of 4 gloo ranks in 2 "nodes" of 2: the hybrid mesh's groups, HSDP's placements, one SGD step of HSDP
    and of full sharding from the same weights on the same per-rank data, and nodes that disagree refused."""
    import torch
    import torch.distributed as dist

    from vlmctl.distributed.env import init_distributed
    from vlmctl.distributed.fsdp import apply_fsdp
    from vlmctl.distributed.mesh import check_nodes_agree

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                       "GROUP_RANK": str(rank // 2), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    env = init_distributed()
    result = {}
    params = {}
    for sharding in ("hybrid", "full"):
        dims = ParallelDims.for_strategy("fsdp", 4, sharding=sharding)
        mesh = dims.build_mesh("cpu")
        torch.manual_seed(0)
        layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        model = apply_fsdp(torch.nn.Sequential(*layers), SimpleNamespace(vision_layers=[], decoder_layers=list(layers)), mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 + env.rank))  # this rank's share of the batch
        model(x).pow(2).mean().backward()
        opt.step()
        params[sharding] = [p.full_tensor() for p in model.parameters()]
        result[sharding] = {"mesh": list(mesh.mesh_dim_names), "placements": [[type(p).__name__, getattr(p, "dim", None)] for p in next(model.parameters()).placements],
                            "dp": [dims.dp_size, dims.dp_rank]}
        if sharding == "hybrid":
            result["shard_group"] = dist.get_process_group_ranks(mesh["dp_shard"].get_group())
            result["replicate_group"] = dist.get_process_group_ranks(mesh["dp_replicate"].get_group())
    result["same_update"] = all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(params["hybrid"], params["full"]))
    for key, args in (("unequal", ("hybrid", 1 if env.rank == 0 else 2)),  # rank 0 claims a node of its own
                      ("mixed", ("hybrid" if env.rank < 2 else "full", 2))):  # node 1 launched with full sharding
        try:
            check_nodes_agree(4, *args)
        except ConfigError as exc:
            result[key] = str(exc)
    with open(f"{out}/{rank}.json", "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_hsdp_on_two_nodes_of_two_gloo_ranks_shards_within_a_node_and_updates_as_full_sharding(tmp_path):
    import torch.multiprocessing as mp

    from vlmctl.distributed.env import free_port

    mp.spawn(_hsdp_rank, args=(free_port(), str(tmp_path)), nprocs=4, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for rank, r in enumerate(ranks):
        assert r["hybrid"]["mesh"] == ["dp_replicate", "dp_shard"] and r["full"]["mesh"] == ["dp_shard"]
        assert r["hybrid"]["placements"] == [["Replicate", None], ["Shard", 0]] and r["full"]["placements"] == [["Shard", 0]]
        assert r["hybrid"]["dp"] == r["full"]["dp"] == [4, rank]  # every rank reads its own part of the batch
        assert r["shard_group"] == [2 * (rank // 2), 2 * (rank // 2) + 1]  # the ranks of its node
        assert r["replicate_group"] == [rank % 2, rank % 2 + 2]  # the same shard on the other node
        assert r["same_update"]
        assert "the same number of processes on every node" in r["unequal"] and "1 and 2 per node" in r["unequal"]
        assert "train.fsdp_sharding differs between the nodes of this run: full and hybrid" in r["mixed"]
