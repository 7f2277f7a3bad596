"""liger-kernel's fused linear cross-entropy at a 7B's shapes (8,192 tokens, hidden 3,584, vocabulary 152,064, bf16):
the milliseconds of each call for label counts of each class Triton compiles its kernel for (any count, a multiple
of 16, 1), in a fresh process, with or without `vlmctl.train.kernels.warm_fused_loss` first. A first call of a new
class holds the kernel's compile; run it with an empty TRITON_CACHE_DIR to see the compile, not a load from disk.

    TRITON_CACHE_DIR=/tmp/tc_cold python benchmarks/liger_loss_classes.py cold
    TRITON_CACHE_DIR=/tmp/tc_warm python benchmarks/liger_loss_classes.py warm

Needs CUDA and liger-kernel. Prints one line per call.
"""

from __future__ import annotations

import sys
import time

import torch

VOCAB, HIDDEN, TOKENS = 152064, 3584, 8192


def main(mode: str) -> None:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from vlmctl.train.kernels import warm_fused_loss

    weight = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02

    def call(count: int) -> float:
        hidden = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
        target[count:] = -100
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        liger_fused_linear_cross_entropy(hidden, weight, target, reduction="sum", ignore_index=-100)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    if mode == "warm":
        t0 = time.perf_counter()
        warm_fused_loss(VOCAB, torch.bfloat16, "cuda")
        torch.cuda.synchronize()
        print(f"{mode}: warm_fused_loss {time.perf_counter() - t0:.3f} s")
    for count in (8185, 8185, 8176, 8176, 8001, 1, 8192):
        kind = "multiple of 16" if count % 16 == 0 else "one" if count == 1 else "other"
        print(f"{mode}: {count} labelled tokens ({kind}): {call(count) * 1e3:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cold")
