"""`vlmctl train` in a process of its own, for the tests that run training end to end (one process or torchrun):
its own process group, so a hung run is killed with all its ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def start_train(config: Path, *args: str) -> subprocess.Popen:
    """Start `vlmctl -c CONFIG train --master-port <free> ARGS` in CONFIG's folder (one thread per rank, unbuffered
    output, stdout and stderr together)."""
    from vlmctl.distributed.env import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vlmctl", "-c", str(config), "train", "--master-port", str(free_port()), *args]
    return subprocess.Popen(cmd, cwd=Path(config).parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def run_train(config: Path, *args: str, timeout: float) -> str:
    """`start_train` and wait: fails the test when the run takes over `timeout` seconds (killed with its ranks) or
    exits with an error; returns its output."""
    proc = start_train(config, *args)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"training did not finish within {timeout}s (hang?):\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out
