"""`vlmctl train` in a process of its own, for the tests that run training end to end (one process or torchrun):
its own process group, so a hung run is killed with all its ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest


def start_train(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `vlmctl -c CONFIG train --master-port <free> ARGS` in CONFIG's folder (one thread per rank, unbuffered
    output, stdout and stderr together; `env`: more environment variables)."""
    from vlmctl.distributed.env import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "vlmctl", "-c", str(config), "train", "--master-port", str(free_port()), *args]
    return subprocess.Popen(cmd, cwd=Path(config).parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def run_train(config: Path, *args: str, timeout: float) -> str:
    """`start_train` and wait: fails the test when the run takes over `timeout` seconds (killed with its ranks) or
    exits with an error; returns its output."""
    return finish_train(start_train(config, *args), timeout=timeout)


def finish_train(proc: subprocess.Popen, *, timeout: float) -> str:
    """Wait for a run started by `start_train` (runs started together are waited for one after the other): fails the
    test when it takes over `timeout` seconds from now (killed with its ranks) or exits with an error; returns its
    output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"training did not finish within {timeout}s (hang?):\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def wait_until(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `ready()` every 0.1 s while the run started by `start_train` goes on (e.g. until a checkpoint folder
    exists, before a signal is sent). Fails the test, killing the run with its ranks, when the run exits first (with
    its output) or `ready()` is still false after `timeout` seconds (with `what`, the awaited event)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"training exited ({proc.returncode}) before {what}:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"no {what} within {timeout}s:\n{out[-4000:]}")
        time.sleep(0.1)


class RunsAhead:
    """Independent runs read by consecutive tests, each started one ahead: waiting for run k first starts run k+1, so
    that run's start-up (imports, rendezvous, model load, much of it on one core) overlaps run k's steps and the
    checks of run k's test. At most 2 runs are in flight. Only for runs whose ranks block while they wait (gloo):
    DeepSpeed's CPU collectives spin, and a second run would take the cores they spin on.

    `starts`: for each key, in the order the tests ask for them, a function that prepares what the run needs and
    returns `start_train(...)`. An error raised by it is raised again to the test that asks for that key. `close()`
    (the fixture's teardown) kills the runs still going, with their ranks."""

    def __init__(self, starts: dict[str, Callable[[], subprocess.Popen]], *, timeout: float):
        self._starts, self._order, self._timeout = starts, list(starts), timeout
        self._procs: dict[str, subprocess.Popen] = {}
        self._errors: dict[str, BaseException] = {}
        self._outs: dict[str, str] = {}

    def _start(self, key: str) -> None:
        if key not in self._procs and key not in self._errors:
            try:
                self._procs[key] = self._starts[key]()
            except Exception as exc:  # raised to the test of `key`, not to the one that started it ahead
                self._errors[key] = exc

    def output(self, key: str) -> str:
        """Run `key`'s output once it has finished; fails the test as `finish_train` does."""
        if key not in self._outs:
            self._start(key)
            following = self._order[self._order.index(key) + 1:]
            if following:
                self._start(following[0])
            if key in self._errors:
                raise self._errors[key]
            self._outs[key] = finish_train(self._procs[key], timeout=self._timeout)
        return self._outs[key]

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
