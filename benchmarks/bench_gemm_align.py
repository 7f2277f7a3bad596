"""bf16 GEMM time of Qwen2.5-VL's vision MLP at its width (3420) and padded to a multiple of 64 (3456), forward
+ backward, on the local GPU: shows what `vlmctl.train.kernels.align_vision_mlp` buys.

Usage (CUDA machine): python benchmarks/bench_gemm_align.py [PATCHES]   (default 14000 patches per step)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def time_mlp(m: int, width: int, hidden: int = 1280, reps: int = 20) -> float:
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wg, wu = (torch.randn(width, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    wd = torch.randn(hidden, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        y = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        y.sum().backward()

    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


if __name__ == "__main__":
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 14000
    for width in (3420, 3456):
        ms = time_mlp(m, width)
        tflops = 3 * 3 * 2 * m * 1280 * width / ms / 1e9
        print(f"GEMM width {width}: {ms:.3f} ms per MLP forward+backward, {tflops:.0f} TFLOP/s", flush=True)
