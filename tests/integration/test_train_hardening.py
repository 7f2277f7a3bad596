"""`vlmctl train` and `vlmctl convert` against hostile or broken input and careless use, on the tiny model on CPU:
planted pickles in every file of a real checkpoint never run, corrupt checkpoints and a full disk give one message,
two runs started together both finish, `kill -9` of the launcher leaves no rank behind, SIGTERM/SIGINT stop with
one line. Every multi-process test has a timeout and kills its process group on failure."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_runner import run_cli as run_cli_inprocess
from shapes_shards import write_shapes_shards

RUN_TIMEOUT = 150


class Payload:
    """A pickle that creates `marker` when unpickled with arbitrary objects allowed."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_models) -> Path:
    """A built tiny model, prepared shards and a vlmctl.yaml for short 2-rank FSDP runs (no --master-port: the
    launches pick their rendezvous ports themselves)."""

    root = tmp_path_factory.mktemp("hardening")
    write_shapes_shards(root / "data", 48)
    shutil.copytree(tiny_models("tiny", shapes=True, dtype="bf16"), root / "model")
    (root / "vlmctl.yaml").write_text("""
project: {name: h}
data: {prepared_dir: data/prepared, max_length: 512}
model: {preset: tiny, init: random, output_dir: model}
train: {stage: full, strategy: fsdp, nproc_per_node: 2, precision: fp32, learning_rate: 2.0e-3, warmup_ratio: 0.0,
        tokens_per_batch: 192, max_steps: 2, save_steps: 2, logging_steps: 1, num_workers: 0, output_dir: runs}
""")
    return root


def _start(project: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vlmctl", "-c", str(project / "vlmctl.yaml"), *args]
    return subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: int = RUN_TIMEOUT) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"did not finish within {timeout}s:\n{out[-4000:]}")
    return out


def _vlmctl(project: Path, *args: str, timeout: int = RUN_TIMEOUT) -> tuple[int, str]:
    proc = _start(project, *args)
    out = _finish(proc, timeout)
    return proc.returncode, out


def _one_message(out: str, title: str = "Checkpoint error") -> str:
    """The output holds exactly one error panel titled `title` and no traceback; returns it on one line."""
    assert out.count(title) == 1, out[-5000:]
    for noise in ("Traceback", "ChildFailedError", "SignalException", "Root Cause"):
        assert noise not in out, out[-5000:]
    return " ".join(out.replace("│", " ").split())


@pytest.fixture(scope="module")
def saved_run(project) -> Path:
    """A 2-rank FSDP run with checkpoints at steps 2 (the one the tests copy and damage)."""
    code, out = _vlmctl(project, "train", "train.run_name=source")
    assert code == 0, out[-5000:]
    return project / "runs" / "source"


def _copy_run(project: Path, saved_run: Path, name: str) -> Path:
    run = project / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(saved_run, run, ignore=shutil.ignore_patterns("final"))
    return run


def _slot(checkpoint: Path, kind: str):
    """(data file, offset, length) of a plain value (`bytes`) or a tensor (`tensor`) of rank 1's data file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from vlmctl.checkpoints import read_dcp_metadata

    md = read_dcp_metadata(checkpoint)
    for index, info in md.storage_data.items():
        plain = isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata)
        if plain == (kind == "bytes") and info.relative_path == "__1_0.distcp" and info.length >= 200:
            return checkpoint / info.relative_path, info.offset, info.length
    raise AssertionError(f"no {kind} slot")


def _plant(checkpoint: Path, where: str, marker: Path) -> Path:
    """Put a pickle that would create `marker` into one file of `checkpoint`; returns the file."""
    import torch

    payload = pickle.dumps(Payload(marker), protocol=2)
    if where == "rng":
        torch.save({"python": Payload(marker)}, checkpoint / "rng-1.pt")
        return checkpoint / "rng-1.pt"
    if where in ("trainer_state.json", ".metadata"):
        (checkpoint / where).write_bytes(payload)
        return checkpoint / where
    path, offset, length = _slot(checkpoint, where.split("-")[1])  # distcp-bytes / distcp-tensor
    data = bytearray(path.read_bytes())
    data[offset:offset + length] = payload.ljust(length, b"\0")
    path.write_bytes(bytes(data))
    return path


# ------------------------------------------------------------------------------------------------ nothing unpickles


@pytest.mark.slow
@pytest.mark.timeout(6 * RUN_TIMEOUT)
@pytest.mark.parametrize("where", ["rng", "trainer_state.json", ".metadata", "distcp-bytes", "distcp-tensor"])
def test_a_planted_pickle_never_runs_on_resume_or_convert(project, saved_run, where, tmp_path, capsys):
    run = _copy_run(project, saved_run, f"planted-{where}")
    checkpoint = run / "checkpoints" / "checkpoint-2"
    marker = tmp_path / "code-ran"
    planted = _plant(checkpoint, where, marker)
    verb = "cannot read" if where == "trainer_state.json" else "refusing to load"
    # resume under torchrun: the launcher's check refuses before any rank starts (a tensor slot: the ranks do)
    code, out = _vlmctl(project, "train", "--resume", f"train.run_name={run.name}", "train.max_steps=4")
    assert code == 1 and f"{verb} {planted}" in _one_message(out), out[-5000:]
    # in one process (what a rank does)
    code, out, err = run_cli_inprocess(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "--resume",
                                        f"train.run_name={run.name}", "train.max_steps=4", "train.strategy=ddp",
                                        "train.nproc_per_node=1"], capsys)
    assert code == 1 and f"{verb} {planted}" in _one_message(out + err)
    code, out, err = run_cli_inprocess(["convert", str(checkpoint), "-o", str(tmp_path / "out")], capsys)
    assert code == 1 and f"{verb} {planted}" in _one_message(out + err)
    assert not marker.exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ one message


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_TIMEOUT)
@pytest.mark.parametrize("damage", ["truncated-distcp", "random-metadata", "broken-state", "missing-shard", "random-tensor"])
def test_a_damaged_checkpoint_gives_one_message_naming_the_file(project, saved_run, damage):
    run = _copy_run(project, saved_run, f"damaged-{damage}")
    checkpoint = run / "checkpoints" / "checkpoint-2"
    shard = checkpoint / "__1_0.distcp"
    if damage == "truncated-distcp":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        expected = f"truncated: {shard.name}"
    elif damage == "random-metadata":
        (checkpoint / ".metadata").write_bytes(os.urandom(2000))
        expected = f"cannot read {checkpoint / '.metadata'}"
    elif damage == "broken-state":
        (checkpoint / "trainer_state.json").write_text('{"step": 2, "consumed')
        expected = f"cannot read {checkpoint / 'trainer_state.json'}: not valid JSON"
    elif damage == "missing-shard":
        shard.unlink()
        expected = f"missing {shard.name}"
    else:  # passes the launcher's size checks: the ranks find it while loading
        path, offset, length = _slot(checkpoint, "tensor")
        data = bytearray(path.read_bytes())
        data[offset:offset + length] = os.urandom(length)
        path.write_bytes(bytes(data))
        expected = f"cannot read {path}"
    code, out = _vlmctl(project, "train", "--resume", f"train.run_name={run.name}", "train.max_steps=4")
    assert code == 1 and expected in _one_message(out), out[-5000:]
    assert not list((run / "checkpoints").glob(".tmp-checkpoint-*"))


@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize("writer", ["checkpoint", "metrics"])
def test_disk_full_is_one_message_naming_the_file_and_free_space(project, writer, capsys, monkeypatch):
    from vlmctl.train import checkpoint, metrics

    run = project / "runs" / f"full-{writer}"
    (run / "checkpoints" / ".tmp-checkpoint-7").mkdir(parents=True)  # left by a killed run: swept at the start
    (run / "loss.tmp.png").write_bytes(b"x")
    target = {}

    def full_disk_checkpoint(tmp, *args, **kwargs):
        (tmp / "__0_0.distcp").write_bytes(b"partial")
        target["path"] = tmp / "__0_0.distcp"
        raise OSError(errno.ENOSPC, "No space left on device", str(target["path"]))

    def full_disk_metrics(self, row):
        target["path"] = self.path
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    if writer == "checkpoint":
        monkeypatch.setattr(checkpoint, "_write_state", full_disk_checkpoint)
    else:
        monkeypatch.setattr(metrics.MetricsLogger, "log", full_disk_metrics)
    code, out, err = run_cli_inprocess(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "--resume",
                                        f"train.run_name={run.name}", "train.strategy=ddp", "train.nproc_per_node=1"], capsys)
    text = _one_message(out + err)
    assert code == 1 and f"disk full while writing {target['path']}" in text and "free on that filesystem" in text
    assert not list((run / "checkpoints").glob(".tmp-checkpoint-*")) and not list(run.glob("*.tmp.png"))
    assert not (run / ".lock").exists()


# ------------------------------------------------------------------------------------------------ concurrency, names


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_two_trains_started_together_get_two_folders_and_both_finish(project, tmp_path):
    # the same project, no run_name, the default rendezvous port: folders and ports must not collide
    (tmp_path / "vlmctl.yaml").write_text((project / "vlmctl.yaml").read_text().replace("output_dir: runs", f"output_dir: {tmp_path / 'runs'}")
                                          .replace("prepared_dir: data/prepared", f"prepared_dir: {project / 'data/prepared'}")
                                          .replace("output_dir: model", f"output_dir: {project / 'model'}"))
    procs = [_start(tmp_path, "train", "--nproc-per-node", "1") for _ in range(2)]
    outs = [_finish(p, 2 * RUN_TIMEOUT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        assert (run / "final" / "model.safetensors").is_file() and not (run / ".lock").exists()


def test_run_name_cannot_leave_output_dir_or_inject_into_the_sbatch_script(project, capsys):
    for name in ("../../escape", "x\ntouch pwned"):
        code, _, err = run_cli_inprocess(["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "slurm", f"train.run_name={name}"], capsys)
        assert code == 2 and "train.run_name" in err
    assert not (project.parent / "escape").exists() and not list(project.glob("**/sbatch.sh"))


@pytest.mark.timeout(RUN_TIMEOUT)
def test_a_run_folder_in_use_is_refused(project, saved_run, capsys):
    from vlmctl.distributed.process import start_time

    run = _copy_run(project, saved_run, "busy")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / ".lock").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "start": start_time(holder.pid)}))
        code, out, err = run_cli_inprocess(["-c", str(project / "vlmctl.yaml"), "train", "--resume", "train.run_name=busy"], capsys)
        assert code == 2 and f"in use by process {holder.pid}" in " ".join(err.split())
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------------------------------------ signals, orphans


def _descendants(pid: int) -> list[int]:
    from vlmctl.distributed.process import child_pids

    found, todo = [], [pid]
    while todo:
        for child in child_pids(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _wait_for_steps(proc: subprocess.Popen, run: Path, steps: int) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (run / "metrics.jsonl").is_file() or len((run / "metrics.jsonl").read_text().splitlines()) < steps:
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {steps} steps logged:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_kill_9_of_the_launcher_leaves_no_rank_alive(project):
    from vlmctl.distributed.process import pid_alive, proc_stat

    run = project / "runs" / "orphans"
    proc = _start(project, "train", "train.run_name=orphans", "train.max_steps=500", "train.save_steps=1000")
    _wait_for_steps(proc, run, 1)
    tree = _descendants(proc.pid)
    assert len(tree) >= 3, tree  # the agent and two ranks
    os.kill(proc.pid, signal.SIGKILL)  # the launcher only, not its process group
    proc.wait()
    deadline = time.monotonic() + 20
    alive = tree
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p) and (proc_stat(p) or ["Z"])[0] != "Z"]
        time.sleep(0.2)
    if alive:
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
    assert not alive, f"left running after the launcher died: {alive}"


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_and_stops_with_one_line(project, signum):
    run = project / "runs" / f"signal-{signum}"
    proc = _start(project, "train", f"train.run_name={run.name}", "train.max_steps=500", "train.save_steps=1000")
    _wait_for_steps(proc, run, 2)
    proc.send_signal(signum)
    out = _finish(proc)
    assert proc.returncode == 128 + signum, out[-4000:]
    for noise in ("Traceback", "SignalException", "ChildFailedError", "saved "):
        assert noise not in out, out[-4000:]
    stops = [line for line in out.splitlines() if "stopped by" in line]
    assert len(stops) == 1 and f"stopped by signal {signum}" in stops[0] and "last checkpoint" in stops[0]
    (ckpt,) = (run / "checkpoints").iterdir()
    assert json.loads((ckpt / "trainer_state.json").read_text())["reason"] == "signal"
