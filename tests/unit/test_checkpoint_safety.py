"""Checkpoint files load without running code (`vlmctl.checkpoints`), run folders and names are safe, launches
claim free ports, and rank failures map to one exit code. No training run here (those are in
tests/integration/test_train_hardening.py)."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli as run_cli_inprocess


class Payload:
    """A pickle that creates `marker` when unpickled with arbitrary objects allowed."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class ViaDcpHelper:
    """A pickle that calls a function of torch.distributed.checkpoint (which loads another file with
    weights_only=False): allowing whole DCP modules would let it through."""

    def __reduce__(self):
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

        return (torch_save_to_dcp, ("/nonexistent/a.pt", "/nonexistent/b"))


def _small_dcp(folder: Path) -> None:
    """A DCP checkpoint like the trainer's: model, AdamW state and the LR schedule's plain values."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    dcp.save({"model": model_sd, "optim": optim_sd, "scheduler": sched}, checkpoint_id=str(folder), no_dist=True)


@pytest.fixture
def dcp_dir(tmp_path) -> Path:
    import warnings

    folder = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        _small_dcp(folder)
    return folder


def _byte_item(folder: Path):
    """(data file, offset, length) of one plain value DCP stored as pickled bytes."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from vlmctl.checkpoints import read_dcp_metadata

    md = read_dcp_metadata(folder)
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata):
            return folder / info.relative_path, info.offset, info.length
    raise AssertionError("no plain value in the checkpoint")


def _overwrite(path: Path, offset: int, length: int, payload: bytes) -> None:
    assert len(payload) <= length
    data = bytearray(path.read_bytes())
    data[offset:offset + length] = payload.ljust(length, b"\0")
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------ what is loaded, how


def test_real_dcp_metadata_and_values_load(dcp_dir):
    import torch

    from vlmctl.checkpoints import check_dcp, dcp_load

    metadata = check_dcp(dcp_dir)
    assert "model.weight" in metadata.state_dict_metadata
    state = {"model": {"weight": torch.zeros(4, 4), "bias": torch.zeros(4)}, "scheduler": {"last_epoch": 0, "base_lrs": [0.0]}}
    dcp_load(state, dcp_dir, allow_partial_load=True, no_dist=True)
    assert state["scheduler"]["last_epoch"] == 1 and state["scheduler"]["base_lrs"] == [1e-3]
    assert state["model"]["weight"].abs().sum() > 0


@pytest.mark.parametrize("payload", ["system", "dcp-helper"])
def test_metadata_asking_for_any_other_object_is_refused(dcp_dir, tmp_path, payload):
    from vlmctl.checkpoints import CheckpointError, check_dcp

    marker = tmp_path / "ran"
    obj = Payload(marker) if payload == "system" else ViaDcpHelper()
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(obj))
    with pytest.raises(CheckpointError) as exc:
        check_dcp(dcp_dir)
    assert "refusing to load" in exc.value.message and str(dcp_dir / ".metadata") in exc.value.message
    assert not marker.exists()


def test_random_or_truncated_metadata_and_data_files_are_named(dcp_dir):
    from vlmctl.checkpoints import CheckpointError, check_dcp

    shard = next(dcp_dir.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"truncated: {shard.name}"):
        check_dcp(dcp_dir)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing {shard.name}"):
        check_dcp(dcp_dir)
    (dcp_dir / ".metadata").write_bytes(os.urandom(3000))
    with pytest.raises(CheckpointError, match=r"cannot read .*\.metadata"):
        check_dcp(dcp_dir)


def test_metadata_naming_a_file_outside_the_folder_is_refused(dcp_dir):
    from vlmctl.checkpoints import CheckpointError, read_dcp_metadata

    metadata = read_dcp_metadata(dcp_dir)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    metadata.storage_meta = None
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a file name inside"):
        read_dcp_metadata(dcp_dir)


def test_a_payload_among_the_plain_values_is_refused_by_the_check_and_by_the_planner(dcp_dir, tmp_path):
    from vlmctl.checkpoints import CheckpointError, check_dcp, dcp_load

    marker = tmp_path / "ran"
    path, offset, length = _byte_item(dcp_dir)
    _overwrite(path, offset, length, pickle.dumps(Payload(marker), protocol=2))
    with pytest.raises(CheckpointError, match=f"refusing to load {path}: it asks for the Python object posix.system"):
        check_dcp(dcp_dir)
    # the planner refuses it too when the check is skipped (torch's DefaultLoadPlanner would run it)
    state = {"optim": {"param_groups": [{"lr": 0.0}]}, "scheduler": {"last_epoch": 0}}
    with pytest.raises(CheckpointError, match=f"refusing to load {path}"):
        dcp_load(state, dcp_dir, allow_partial_load=True, no_dist=True)
    assert not marker.exists()


def test_rng_files_load_weights_only_old_and_new_format(tmp_path):
    import numpy as np
    import torch

    from vlmctl.checkpoints import CheckpointError, load_tensors
    from vlmctl.train.checkpoint import rng_state, set_rng_state

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(rng_state(), tmp_path / "rng-0.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    # written before RNG files held tensors only: numpy's state tuple with its array
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, tmp_path / "old.pt")
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_tensors(tmp_path / "rng-0.pt"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    set_rng_state(load_tensors(tmp_path / "old.pt"))

    marker = tmp_path / "ran"
    torch.save({"python": Payload(marker)}, tmp_path / "rng-1.pt")
    with pytest.raises(CheckpointError, match=f"refusing to load {tmp_path / 'rng-1.pt'}: it asks for the Python object posix.system"):
        load_tensors(tmp_path / "rng-1.pt")
    (tmp_path / "rng-2.pt").write_bytes(os.urandom(500))
    with pytest.raises(CheckpointError, match=f"cannot read {tmp_path / 'rng-2.pt'}"):
        load_tensors(tmp_path / "rng-2.pt")
    assert not marker.exists()


def test_trainer_state_must_be_a_json_object(tmp_path):
    from vlmctl.checkpoints import CheckpointError, read_json

    path = tmp_path / "trainer_state.json"
    path.write_text('{"step": 4,')
    with pytest.raises(CheckpointError, match=f"cannot read {path}: not valid JSON"):
        read_json(path)
    path.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        read_json(path)


def test_deepspeed_loads_are_weights_only_inside_the_context(tmp_path):
    import torch

    from vlmctl.checkpoints import CheckpointError, deepspeed_weights_only

    marker = tmp_path / "ran"
    torch.save({"x": Payload(marker)}, tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"x": torch.ones(2)}, tmp_path / "ok.pt")
    with deepspeed_weights_only():
        assert torch.load(tmp_path / "ok.pt")["x"].sum() == 2
        with pytest.raises(CheckpointError, match="refusing to load"):
            torch.load(tmp_path / "mp_rank_00_model_states.pt", weights_only=False)
    assert not marker.exists() and torch.load.__name__ == "load"


# ------------------------------------------------------------------------------------------ names, folders, ports


@pytest.mark.parametrize("name", ["../../escape", "a/b", "a\nrm -rf ~", "-x", ".hidden", "a b", "x..y"])
def test_unsafe_run_names_are_refused_naming_the_key(write_config, capsys, name, tmp_path):
    cfg = write_config("project: {name: p}\n")
    code, _, err = run_cli_inprocess(["-c", str(cfg), "train", "--dry-run", f"train.run_name={name}"], capsys)
    assert code == 2 and "train.run_name" in " ".join(err.split()), err
    assert not (tmp_path.parent / "escape").exists()


def test_sbatch_script_quotes_every_value_and_refuses_control_characters(tmp_path):
    from vlmctl.config import TrainSection
    from vlmctl.errors import ConfigError
    from vlmctl.train.launch import sbatch_script

    train = TrainSection(launcher="slurm", nnodes=2, master_addr="head")
    script = sbatch_script(train, tmp_path / "my runs" / "r1", 4)
    assert f"-m vlmctl.train.worker '{tmp_path}/my runs/r1'" in script
    assert f"#SBATCH --output='{tmp_path}/my runs/r1/slurm-%j.out'" in script
    with pytest.raises(ConfigError, match="control character"):
        sbatch_script(train, tmp_path / "x\ntouch pwned" / "r1", 4)


def test_default_run_folders_are_unique_and_explicit_names_in_use_are_refused(tmp_path):
    from vlmctl.errors import ConfigError, UsageError
    from vlmctl.train.rundir import LOCK_FILE, claim_run_dir, release_run

    first = claim_run_dir(tmp_path, "p-full-20250101-000000", explicit=False, resume=False)
    second = claim_run_dir(tmp_path, "p-full-20250101-000000", explicit=False, resume=False)
    assert (first.name, second.name) == ("p-full-20250101-000000", "p-full-20250101-000000-2")
    assert json.loads((first / LOCK_FILE).read_text())["pid"] == os.getpid()
    (first / "metrics.jsonl").write_text("{}\n")
    release_run(first)
    with pytest.raises(ConfigError, match="already holds a run"):
        claim_run_dir(tmp_path, first.name, explicit=True, resume=False)
    assert claim_run_dir(tmp_path, first.name, explicit=True, resume=True) == first  # --resume continues it
    release_run(first)
    assert not (first / LOCK_FILE).exists()

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from vlmctl.distributed.process import start_time

        lock = {"pid": holder.pid, "host": socket.gethostname(), "start": start_time(holder.pid)}
        (second / LOCK_FILE).write_text(json.dumps(lock))
        with pytest.raises(UsageError, match=f"in use by process {holder.pid}"):
            claim_run_dir(tmp_path, second.name, explicit=True, resume=True)
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is stale and taken over
    assert claim_run_dir(tmp_path, second.name, explicit=True, resume=True) == second
    assert json.loads((second / LOCK_FILE).read_text())["pid"] == os.getpid()
    release_run(second)


def test_stale_temporaries_are_swept(tmp_path):
    from vlmctl.train.rundir import sweep_temporaries

    for rel in ("checkpoints/.tmp-checkpoint-9/x", ".tmp-final/model.safetensors", "loss.tmp.png", ".config.yaml.tmp"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    (tmp_path / "checkpoints" / "checkpoint-4").mkdir()
    removed = {p.name for p in sweep_temporaries(tmp_path)}
    assert removed == {".tmp-checkpoint-9", ".tmp-final", "loss.tmp.png", ".config.yaml.tmp"}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-4"]


def test_single_node_launches_take_a_free_port_when_the_configured_one_is_busy(tmp_path):
    from vlmctl.config import TrainSection
    from vlmctl.distributed.env import claim_port, free_port
    from vlmctl.train.launch import launch_command

    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        got, claim = claim_port(port)
        assert got != port and claim is None
        launch = launch_command(TrainSection(master_port=port, nproc_per_node=2), tmp_path)
        assert f"127.0.0.1:{port}" not in launch.render() and "--rdzv-endpoint 127.0.0.1:" in launch.render()
    finally:
        busy.close()
    free = free_port()
    first, claim = claim_port(free)
    second, _ = claim_port(free)  # claimed by the first launch until its agent binds it
    assert first == free and second != free
    claim.close()
    assert claim_port(free)[0] == free
    # multi-node: the port is used as given
    launch = launch_command(TrainSection(master_port=port, nnodes=2, master_addr="10.0.0.1"), tmp_path)
    assert f"10.0.0.1:{port}" in launch.render()


def test_failed_ranks_give_the_lowest_rank_error_code(capsys):
    from types import SimpleNamespace

    from vlmctl.distributed.process import _failed_ranks_code

    assert _failed_ranks_code({0: SimpleNamespace(exitcode=1, pid=10), 1: SimpleNamespace(exitcode=-15, pid=11)}) == 1
    assert _failed_ranks_code({1: SimpleNamespace(exitcode=2, pid=11), 0: SimpleNamespace(exitcode=-15, pid=10)}) == 2
    assert _failed_ranks_code({0: SimpleNamespace(exitcode=-15, pid=10)}) == 143 and capsys.readouterr().err == ""
    assert _failed_ranks_code({0: SimpleNamespace(exitcode=-9, pid=10)}) == 137
    assert "rank 0 (pid 10) was killed by SIGKILL" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_rank_dies_with_its_parent():
    # parent (sleeps) -> child (asks for the parent-death signal, then sleeps); killing the parent ends the child
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'from vlmctl.distributed.process import die_with_parent; "
            "import time; die_with_parent(); print(flush=True); time.sleep(60)'], stdout=subprocess.PIPE)\n"
            "child.stdout.readline(); print(child.pid, flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    import time

    from vlmctl.distributed.process import pid_alive, proc_stat

    deadline = time.monotonic() + 10
    while pid_alive(child) and (proc_stat(child) or ["Z"])[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child) or (proc_stat(child) or ["Z"])[0] == "Z"
