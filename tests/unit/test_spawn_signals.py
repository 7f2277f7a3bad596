"""`launch.spawn`: a stop signal goes to the ranks; with `grace_s`, ranks that cannot act on it (blocked in a CUDA
call or a collective, here: ignoring SIGTERM) are killed once the grace period ends."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="the ranks under an agent are found through /proc")

# an "agent" that starts one "rank" and exits with its code, as torchrun does
AGENT = "import subprocess, sys; sys.exit(subprocess.Popen([sys.executable, '-c', sys.argv[1]]).wait())"


def _rank(marker: Path, ignore_sigterm: bool) -> str:
    handler = "signal.SIG_IGN" if ignore_sigterm else "lambda *a: sys.exit(0)"
    return (f"import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, {handler}); "
            f"pathlib.Path({str(marker)!r}).write_text('up'); time.sleep(120)")


def _sigterm_when_up(marker: Path) -> threading.Thread:
    def send():
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # spawn's handlers are in place well before the rank's interpreter is up
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    from vlmctl.train.launch import spawn

    marker = tmp_path / "up"
    _sigterm_when_up(marker)
    started = time.monotonic()
    code, signum = spawn([sys.executable, "-c", AGENT, _rank(marker, ignore_sigterm=True)], grace_s=1.0)
    assert signum == signal.SIGTERM
    assert code == -signal.SIGKILL  # the session was killed, the agent with it
    assert time.monotonic() - started < 60  # not the rank's 120 s sleep


def test_a_rank_that_stops_on_sigterm_ends_the_run_cleanly(tmp_path):
    from vlmctl.train.launch import spawn

    marker = tmp_path / "up"
    _sigterm_when_up(marker)
    code, signum = spawn([sys.executable, "-c", AGENT, _rank(marker, ignore_sigterm=False)], grace_s=30.0)
    assert (code, signum) == (0, signal.SIGTERM)  # the rank's own exit, well before the grace period ends
