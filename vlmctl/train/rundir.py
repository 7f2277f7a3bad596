"""Run folders: unique names, a lock while a run uses one, and the sweep of temporary files a killed run left.

    run_dir = claim_run_dir(root, name, explicit=False, resume=False)   # created exclusively, locked
    ...
    release_run(run_dir)                                                # also at exit of the process

Two `vlmctl train` started in the same second get two folders (`<name>`, `<name>-2`, ...): the folder is created
with an exclusive `mkdir`. A folder in use holds `.lock` (JSON: pid, host, process start time); a lock whose
process is gone (on this host) is taken over, a live one is refused with the pid that holds it.

A multi-node run shares one folder on a filesystem every node sees. Node 0's launcher claims, locks and sweeps it
and writes config.yaml, as for one node; the launchers of the other nodes join it (`join_run_dir`): they take no
lock (node 0's is live, so theirs would be refused as "in use"), write no config and sweep nothing (node 0's
ranks may be writing), and keep their output in their own `train-node<N>.log`.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterator

from vlmctl.checkpoints import CheckpointError
from vlmctl.distributed.process import pid_alive, start_time
from vlmctl.errors import ConfigError, UsageError
from vlmctl.train.checkpoint import write_error

LOCK_FILE = ".lock"
# left behind by a process killed while writing: checkpoint folders, the final export, loss.png, config.yaml
TEMPORARIES = ("checkpoints/.tmp-checkpoint-*", ".tmp-final", "*.tmp.png", ".config.yaml.tmp", ".plan.json.tmp", "metrics.jsonl.tmp",
               ".command.json.tmp", ".lock.stale-*")
_held: set[Path] = set()


def safe_part(text: str) -> str:
    """`text` with every run of unsafe characters replaced by `-` (for names built from project.name)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip(".-") or "run"


def claim_run_dir(root: Path, name: str, *, explicit: bool, resume: bool) -> Path:
    """Create and lock the run folder `root/name`.

    A generated name (`explicit` False, no resume) takes the first free `name`, `name-2`, `name-3`, ...
    (exclusive mkdir). An explicit `train.run_name` or a resumed run uses `name` itself; a fresh run refuses a
    folder that already holds a run (ConfigError). A folder another live process holds is refused (UsageError)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if explicit or resume:
        run_dir = root / name
        run_dir.mkdir(exist_ok=True)
        lock_run(run_dir)
        if not resume and holds_a_run(run_dir):
            release_run(run_dir)
            raise ConfigError(f"train.run_name = {name}: the run folder {run_dir} already holds a run",
                              hint=f"continue it with `vlmctl train --resume train.run_name={name}`, or choose "
                                   "another train.run_name (or delete the folder)")
        return run_dir
    for i in range(1, 1000):
        run_dir = root / (name if i == 1 else f"{name}-{i}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        lock_run(run_dir)
        return run_dir
    raise UsageError(f"no free run folder name {name}-N under {root}", hint="set train.run_name")


def join_run_dir(root: Path, name: str) -> Path:
    """The run folder `root/name` of a multi-node run, for a node other than node 0: created when this node comes
    first (node 0 claims it all the same: the folder holds no run yet), never locked or swept here."""
    run_dir = Path(root) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def holds_a_run(run_dir: Path) -> bool:
    """True when `run_dir` has metrics, checkpoints or a final export of an earlier run."""
    ckpts = run_dir / "checkpoints"
    return ((run_dir / "metrics.jsonl").exists() or (run_dir / "final").exists()
            or (ckpts.is_dir() and any(ckpts.iterdir())))


def _identity() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": start_time(os.getpid())}


def _read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or being written: treated as held by a process that is gone
    return data if isinstance(data, dict) else {}


def _holder_alive(holder: dict) -> bool:
    """Whether the lock's process still runs: the same pid with the same start time on this host. A lock from
    another host is taken as alive (its pid cannot be checked from here)."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    if holder.get("host") not in (None, socket.gethostname()):
        return True
    if not pid_alive(pid):
        return False
    started = start_time(pid)
    return holder.get("start") is None or started is None or started == holder.get("start")


def lock_run(run_dir: Path) -> None:
    """Mark `run_dir` in use by this process (`.lock`, created exclusively). A stale lock (its process is gone) is
    taken over; re-locking a folder this process holds is a no-op. Raises UsageError while another process holds
    it."""
    path = Path(run_dir) / LOCK_FILE
    me = _identity()
    for _ in range(5):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None:
                continue  # released meanwhile
            if holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
                _held.add(Path(run_dir))
                return
            if _holder_alive(holder):
                raise UsageError(
                    f"the run folder {run_dir} is in use by process {holder.get('pid')} on {holder.get('host')}",
                    hint="wait for that run to finish, or choose another train.run_name; if no such run is alive, "
                         f"delete {path}") from None
            try:  # stale: move it aside atomically, so one of several starters wins the retry
                os.replace(path, path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}"))
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        _held.add(Path(run_dir))
        return
    raise UsageError(f"could not lock the run folder {run_dir}", hint=f"delete {path} if no run uses the folder")


def release_run(run_dir: Path) -> None:
    """Remove this process's lock of `run_dir` (nothing when another process holds it)."""
    path = Path(run_dir) / LOCK_FILE
    holder = _read_lock(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)
    _held.discard(Path(run_dir))


@atexit.register
def _release_all() -> None:
    for run_dir in list(_held):
        release_run(run_dir)


def sweep_temporaries(run_dir: Path) -> list[Path]:
    """Remove what a killed run left while writing (`TEMPORARIES`) and put back a checkpoint it was replacing
    (`checkpoint.restore_moved`); call only while no process writes the run. Returns what was removed."""
    from vlmctl.train.checkpoint import restore_moved  # train.checkpoint imports this module: a cycle at the top level

    removed = restore_moved(run_dir)
    for pattern in TEMPORARIES:
        for path in Path(run_dir).glob(pattern):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def guard_run(run_dir: Path, *, main: bool) -> Iterator[None]:
    """Around a rank's run: the main rank sweeps `TEMPORARIES` before and after a failure; an OSError for a full
    disk becomes a CheckpointError naming the file and the free space (`checkpoint.write_error`)."""
    if main:
        sweep_temporaries(run_dir)
    try:
        try:
            yield
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise CheckpointError(*write_error(exc, Path(run_dir))) from None
    except BaseException:
        if main:
            sweep_temporaries(run_dir)
        raise
