"""Process lifetime helpers shared by every layer (the data pipeline's worker pools, the launch's agents and ranks):
nothing here imports another vlmctl module."""

from __future__ import annotations

import os
import signal
import sys

# ctypes (standard library, not loaded at the CLI's start-up) is imported inside the functions that use it.

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send `sig` to this process when its parent exits (`prctl(PR_SET_PDEATHSIG)` through ctypes).
    Returns False where that is not available. When the parent is already gone, `sig` is raised at once."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the parent died before the request: nobody will send the signal
        os.kill(os.getpid(), sig)
    return True
