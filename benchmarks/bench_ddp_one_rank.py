"""What DistributedDataParallel costs over one rank: forward + backward of a stack of linear layers, unwrapped
against wrapped in DDP (gloo, `find_unused_parameters=True` as `vlmctl.distributed.ddp` sets it), on CPU.
Prints the median step time (ms) of 8 steps and the process's peak RSS (MiB); run each variant in its own process:

    python benchmarks/bench_ddp_one_rank.py bare
    python benchmarks/bench_ddp_one_rank.py ddp
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from vlmctl.distributed.env import free_port


def main(variant: str, layers: int = 24, width: int = 2048, batch: int = 64, steps: int = 8) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    if variant == "ddp":
        model = DistributedDataParallel(model, find_unused_parameters=True)
    x = torch.randn(batch, width)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(x).sum().backward()
        times.append(time.perf_counter() - start)
        for p in model.parameters():
            p.grad = None
    dist.destroy_process_group()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{variant}: median step {sorted(times)[steps // 2] * 1000:.0f} ms, peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("bare", "ddp"):
        sys.exit("usage: python benchmarks/bench_ddp_one_rank.py bare|ddp")
    main(sys.argv[1])
