"""The process group of a rank: started from torchrun's environment variables (or as a one-process group)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


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

    # fewer out-of-memory errors from fragmentation: packed rows change shape every step (torchtitan sets it too)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
