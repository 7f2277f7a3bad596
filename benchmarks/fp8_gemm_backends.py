"""Time the GEMMs of a float8 training step, shaped as the 7B preset's language model at 8,192-token rows, on each
backend inductor can lower them to: cuBLAS (`torch._scaled_mm` eager, what inductor picks without autotuning) and
inductor's autotuned choice among its Triton templates and cuBLAS (`mode="max-autotune-no-cudagraphs"`), beside
bf16's `torch.mm`.

Usage (on a GPU machine):

    python benchmarks/fp8_gemm_backends.py [TOKENS] [--bf16-tune]

The problems are those of torchao's tensorwise `Float8Linear` (torchao/float8/float8_linear.py): per linear of
in-features K and out-features N, at M tokens, the forward (M, K) x (K, N) with fast accumulation, the input gradient
(M, N) x (N, K) and the weight gradient (N, M) x (M, K) without it; the first operand row-major, the second
column-major, as `torch._scaled_mm` takes them, one float32 scale each, bf16 output. Linears: the attention's query
and output projections (3,584 -> 3,584), the MLP's gate and up (3,584 -> 18,944) and down (18,944 -> 3,584)
projections, the ones torchao's size rule converts in the 7B. Each problem is timed with CUDA events, median of 20
after 5 warm-up calls; TFLOP/s = 2 M N K / time. `--bf16-tune` autotunes bf16's GEMMs as well.

Prints a row per problem, then the sum over one decoder layer's GEMMs (2 x q/o, 2 x gate/up, 1 x down) times 28
layers: the milliseconds of a step's converted GEMMs on each backend."""

from __future__ import annotations

import statistics
import sys


def timed(fn, args, reps: int = 20, warmup: int = 5) -> float:
    import torch

    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str]) -> None:
    import torch

    tokens = int(next((a for a in argv if a.isdigit()), 8192))
    bf16_tune = "--bf16-tune" in argv
    torch._inductor.config.max_autotune_gemm_backends = "ATEN,TRITON"
    torch._dynamo.config.recompile_limit = 64  # one compile per problem, all of one function's code
    layers = {"q/o": (3584, 3584, 2), "gate/up": (3584, 18944, 2), "down": (18944, 3584, 1)}
    fp8 = torch.float8_e4m3fn

    def scaled(fast: bool):
        def mm(a, b, sa, sb):
            return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
        return mm

    compiled: dict = {}
    totals = {"bf16": 0.0, "bf16 tuned": 0.0, "fp8 cuBLAS": 0.0, "fp8 tuned": 0.0}
    print(f"{'linear':8} {'gemm':12} {'m x k x n':>22} {'bf16 ms':>8} {'bf16 tuned':>10} {'fp8 cuBLAS':>10} "
          f"{'fp8 tuned':>10} {'x cuBLAS':>8}  TFLOP/s bf16 / fp8 cuBLAS / fp8 tuned")
    for name, (k_in, n_out, count) in layers.items():
        for gemm, (m, k, n), fast in (("forward", (tokens, k_in, n_out), True),
                                      ("grad input", (tokens, n_out, k_in), False),
                                      ("grad weight", (n_out, tokens, k_in), False)):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # column-major (k, n)
            sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
            a8, b8 = a.to(fp8), b.to(fp8)
            key = (m, k, n, fast)
            if key not in compiled:
                compiled[key] = torch.compile(scaled(fast), mode="max-autotune-no-cudagraphs", dynamic=False)
            ms = {"bf16": timed(torch.mm, (a, b)),
                  "fp8 cuBLAS": timed(scaled(fast), (a8, b8, sa, sb)),
                  "fp8 tuned": timed(compiled[key], (a8, b8, sa, sb))}
            ms["bf16 tuned"] = (timed(torch.compile(torch.mm, mode="max-autotune-no-cudagraphs", dynamic=False), (a, b))
                                if bf16_tune else float("nan"))
            diff = (compiled[key](a8, b8, sa, sb).float() - scaled(fast)(a8, b8, sa, sb).float()).abs().max().item()
            flop = 2 * m * n * k
            for kind in totals:
                totals[kind] += count * ms[kind]
            print(f"{name:8} {gemm:12} {f'{m} x {k} x {n}':>22} {ms['bf16']:8.3f} {ms['bf16 tuned']:10.3f} "
                  f"{ms['fp8 cuBLAS']:10.3f} {ms['fp8 tuned']:10.3f} {ms['fp8 cuBLAS'] / ms['fp8 tuned']:8.3f}  "
                  f"{flop / ms['bf16'] / 1e9:.0f} / {flop / ms['fp8 cuBLAS'] / 1e9:.0f} / "
                  f"{flop / ms['fp8 tuned'] / 1e9:.0f}   max |tuned - cuBLAS| {diff:.3g}", flush=True)
    print("28 layers' converted GEMMs, ms: " + ", ".join(f"{k} {28 * v:.1f}" for k, v in totals.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
