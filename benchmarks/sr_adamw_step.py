"""Time the bf16 AdamW step with stochastic rounding (`vlmctl.train.optimizer.stochastic_adamw`: compiled calls over
lists of same-size parameters in place, flat copies of the small ones) on a preset's parameters.

Usage (on a GPU machine with torchao):

    python benchmarks/sr_adamw_step.py [PRESET] [STEPS] [--kernels]   # default qwen2.5-vl-3b, 10 measured steps

Builds the preset's model on the meta device for its parameter shapes, allocates those parameters in bf16 on the
GPU with random gradients (the step reads and writes 2 bytes per parameter for the weight, gradient and both
moments), runs 3 warm-up steps (compiling) and STEPS timed steps, and prints milliseconds per step
(wall, CUDA-synchronized), the host (CPU) milliseconds spent issuing the step, and the parameter count. With
`--kernels`, two more steps run under torch.profiler and the GPU kernels are listed by name: milliseconds and
launches per step, the 8 longest.
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> None:
    import torch

    from vlmctl.config.model import ModelSection
    from vlmctl.models.build import instantiate, plan_build
    from vlmctl.train import optimizer

    kernels = "--kernels" in argv
    argv = [a for a in argv if a != "--kernels"]
    preset = argv[0] if argv else "qwen2.5-vl-3b"
    steps = int(argv[1]) if len(argv) > 1 else 10
    meta = instantiate(plan_build(ModelSection(preset=preset, init="random")), device="meta")
    shapes = [p.shape for p in meta.parameters()]
    del meta
    device = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.bfloat16) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    print(f"{preset}: {len(params)} parameters, {n / 1e9:.2f}B elements")
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = optimizer.stochastic_adamw([{"params": decay, "lr": 1e-5, "weight_decay": 0.1},
                                      {"params": rest, "lr": 1e-5, "weight_decay": 0.0}],
                                     lr=1e-5, betas=(0.9, 0.999), eps=1e-8)
    t0 = time.perf_counter()
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    host, wall = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
    wall.sort()
    host.sort()
    print(f"{1e3 * wall[len(wall) // 2]:.1f} ms per step (median of {steps}), host {1e3 * host[len(host) // 2]:.1f} ms, "
          f"warm-up {warm:.1f} s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if kernels:
        print_kernels(opt)


def print_kernels(opt, steps: int = 2) -> None:
    """`steps` optimizer steps under torch.profiler: the GPU kernels' milliseconds and launches per step, by name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms_count = by_name.setdefault(e.name[:90], [0.0, 0])
            ms_count[0] += e.time_range.elapsed_us() / 1e3 / steps
            ms_count[1] += 1
    total = sum(ms for ms, _ in by_name.values())
    print(f"kernels {total:.1f} ms per step, {sum(n for _, n in by_name.values()) // steps} launches")
    for name, (ms, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"  {ms:7.2f} ms {n // steps:5d}  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
