"""Process hygiene of a launch: rank processes never outlive the `vlmctl train` that started them, and the process
agents (torchrun, accelerate) report failures without their own tracebacks.

The process tree of a single-node launch is `vlmctl train` -> agent (`python -m vlmctl.distributed.torchrun` or
`.accelerate`, in a session of its own so a terminal's Ctrl-C reaches only vlmctl) -> ranks
(`python -m vlmctl.train.worker`). Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`, set by the agent and by
every rank) kills the agent when vlmctl dies and the ranks when the agent dies; every rank also watches the pid in
`VLMCTL_LAUNCHER_PID` (a thread, so `kill -9` of vlmctl ends the ranks on other POSIX systems too). vlmctl passes
SIGTERM/SIGINT to the ranks themselves (`signal_ranks`): they finish the step, save and exit 0, and the agent never
sees a signal (torchrun would answer one with a SignalException traceback).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

from vlmctl.processes import die_with_parent

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

LAUNCHER_ENV = "VLMCTL_LAUNCHER_PID"
QUIET_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # deaths the sender already reports


def pid_alive(pid: int) -> bool:
    """True while a process `pid` exists (signal 0 reaches it, or it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_launcher(interval: float = 1.0) -> threading.Thread | None:
    """A daemon thread that SIGKILLs this process as soon as the pid in `VLMCTL_LAUNCHER_PID` is gone (or the
    process was re-parented away from it). None when the variable is unset (SLURM, a hand-started rank)."""
    value = os.environ.get(LAUNCHER_ENV, "")
    if not value.isdigit() or int(value) == os.getpid():
        return None
    launcher = int(value)

    def watch() -> None:
        while pid_alive(launcher):
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="vlmctl-launcher-watch", daemon=True)
    thread.start()
    return thread


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...; Linux), None elsewhere or when
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def start_time(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat); tells a pid reused by
    another process apart. None where /proc is missing."""
    fields = proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (from /proc; empty where there is none)."""
    children = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if name.isdigit():
            fields = proc_stat(int(name))
            if fields and len(fields) > 1 and fields[1] == str(pid):
                children.append(int(name))
    return children


def signal_ranks(agent_pid: int, signum: int) -> list[int]:
    """Send `signum` to the rank processes under the agent `agent_pid` (its children), or to the agent itself
    before it started any (or where /proc is missing). Returns the pids signalled."""
    targets = child_pids(agent_pid) or [agent_pid]
    sent = []
    for pid in targets:
        try:
            os.kill(pid, signum)
            sent.append(pid)
        except ProcessLookupError:
            pass
    return sent


def tie_to_launcher() -> None:
    """In a rank process: die with the agent that started it (parent-death signal) and with the launcher named in
    `VLMCTL_LAUNCHER_PID` (`watch_launcher`)."""
    die_with_parent(signal.SIGKILL)
    watch_launcher()


def exit_on_stop_signals() -> None:
    """SIGTERM/SIGINT end this process at once with 128 + the signal, without a traceback (a rank before its step
    loop runs has nothing to save)."""
    def leave(signum, frame):
        os._exit(128 + signum)

    for sig in QUIET_SIGNALS:
        signal.signal(sig, leave)


def report_error(exc, grace_s: float = 2.0) -> int:
    """Report a VlmctlError of a rank once: rank 0 prints its panel (every rank raises the same one for checkpoint,
    configuration and data errors) while ignoring SIGTERM, so the panel comes out whole even when the agent stops
    the ranks; the other ranks stay quiet and wait `grace_s` for it, since the agent stops every rank as soon as
    one exits. Returns the exit code."""
    from vlmctl.errors import render

    if int(os.environ.get("RANK", "0")) == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        render(exc)
    else:
        time.sleep(grace_s)
    return exc.exit_code


def run_agent(call: Callable[[], object]) -> None:
    """Run a process agent (`call`: torchrun's or accelerate's main) the way vlmctl launches it: dying with the
    launcher, and exiting with the ranks' code when they failed, without the agent's traceback (the ranks printed
    their own panel or traceback; a rank killed by a signal other than SIGTERM/SIGINT gets one line here)."""
    import subprocess

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    import logging

    import torch.distributed.elastic.multiprocessing.api as processes

    die_with_parent(signal.SIGKILL)
    # "Sending process N closing signal", "failed (exitcode: 1) local_rank: 0": the ranks' own output and the
    # exit code say it already
    logging.getLogger(processes.__name__).setLevel(logging.CRITICAL)
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit() and not pid_alive(int(launcher)):
        sys.exit(128 + signal.SIGKILL)  # vlmctl died while this agent started
    try:
        call()
    except ChildFailedError as exc:
        sys.exit(_failed_ranks_code(exc.failures))
    except SignalException as exc:  # the agent itself got SIGTERM/SIGINT: its ranks were stopped
        sys.exit(128 + int(exc.sigval))
    except subprocess.CalledProcessError as exc:  # accelerate's one-process launcher
        sys.exit(exc.returncode if exc.returncode > 0 else 128 - exc.returncode)


def _failed_ranks_code(failures: dict) -> int:
    """The exit code of the lowest rank that exited with an error code; every rank killed by a signal is named
    (also when the others then failed on their own: their errors do not say which peer died)."""
    codes = {rank: int(f.exitcode) for rank, f in failures.items()}
    for rank in sorted(codes):
        signum = -codes[rank]
        if signum > 0 and signum not in QUIET_SIGNALS:
            name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
            print(f"rank {rank} (pid {failures[rank].pid}) was killed by {name}"
                  + (" (out of memory?)" if signum == signal.SIGKILL else ""), file=sys.stderr)
    for rank in sorted(codes):
        if codes[rank] > 0:
            return codes[rank]
    return 128 - codes[min(codes)]
