"""The process group of a rank: started from torchrun's environment variables (or as a one-process group)."""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# deepspeed (an optional dependency) is imported only where used, so the rest works without it.


@dataclass
class DistEnv:
    """This rank's place in the world and its device (`torch.device`)."""

    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(deepspeed: bool = False) -> DistEnv:
    """Initialize the default process group from torchrun's environment (or a 1-process group without it).

    NCCL when CUDA is available, gloo otherwise. DeepSpeed runs use `deepspeed.init_distributed`, which needs
    `DS_ACCELERATOR=cpu` set before deepspeed is imported on machines without GPUs.
    """
    import torch
    import torch.distributed as dist

    configure_cuda_allocator()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        if deepspeed:
            import deepspeed as ds

            ds.init_distributed(dist_backend=backend)
        else:
            dist.init_process_group(backend=backend, device_id=device if cuda else None)
    return DistEnv(rank=rank, world_size=world, local_rank=local, device=device)


CUDA_ALLOC_CONF = "expandable_segments:True"


def configure_cuda_allocator() -> None:
    """Expandable segments for PyTorch's CUDA caching allocator (`PYTORCH_CUDA_ALLOC_CONF`, unless the user set it):
    packed rows change shape every step, and without them the cached blocks fragment until an allocation near the
    card's limit fails with gigabytes reserved but unallocated (torchtitan sets it too). The variable is read when
    CUDA starts, so where something already started it (a GPU query before the process group exists) the setting
    is applied to the running allocator as well (`torch._C._accelerator_setAllocatorSettings` where this torch has it,
    else `torch.cuda.memory._set_allocator_settings`, which torch 2.11 flags as deprecated on every rank)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        apply = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        apply(os.environ["PYTORCH_CUDA_ALLOC_CONF"])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "") -> bool:
    """Whether a TCP socket can bind `port` now (on every interface by default, as torchrun's store does)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def claim_port(preferred: int) -> tuple[int, object | None]:
    """A rendezvous port for a launch on this machine: `preferred` when it is free and no other vlmctl launch on
    this machine has claimed it, else a free port the kernel picks (ephemeral, so two launches do not get the same
    one). Returns (port, claim): the claim of `preferred` is an open file holding an exclusive `flock` on
    `<tmp>/vlmctl-ports/<port>.lock`; keep it until the agent has bound the port (closing it, or the end of this
    process, releases it). The claim is None for a free port or where `flock` is missing."""
    claim = _flock_port(preferred)
    if claim is not False and port_is_free(preferred):
        return preferred, claim
    if claim:
        claim.close()
    return free_port(), None


def _flock_port(port: int):
    """An open file with an exclusive lock on this port's claim file; False when another process holds it;
    None when locks are not available here."""
    try:
        import fcntl  # POSIX only
    except ImportError:  # pragma: no cover - not POSIX
        return None
    folder = Path(tempfile.gettempdir()) / "vlmctl-ports"
    try:
        folder.mkdir(mode=0o1777, exist_ok=True)
        f = open(folder / f"{port}.lock", "a")
    except OSError:
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return False
    return f
