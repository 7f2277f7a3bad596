"""Time forward + backward of a stack of decoder blocks shaped like a preset's language model, in bf16 and with
torchao's tensorwise float8 under a few `Float8LinearConfig` settings, each block compiled as the trainer compiles
its decoder layers.

Usage (on a GPU machine with torchao):

    python benchmarks/fp8_layer_variants.py [TOKENS] [LAYERS] [VARIANT ...]

TOKENS (default 8,192) rows of one packed micro-batch; LAYERS (default 4) blocks of the 7B preset's language model
(Qwen2.5-7B: hidden 3,584, MLP 18,944, 28 query and 4 key/value heads of 128): RMSNorm, the q/k/v projections
(biased) and the output projection around scaled-dot-product attention, RMSNorm, the SwiGLU MLP. Float8 converts
what `train.fp8_layers=sized` converts (torchao's size rule: not the key/value projections). VARIANT (default all):

- `bf16`: no float8;
- `pad`: tensorwise with `pad_inner_dim=True` (what `vlmctl.distributed.float8.convert` sets: rows of any length);
- `nopad`: tensorwise with `pad_inner_dim=False` (the inner dimensions are already multiples of 16 here);
- `nopad-pow2`: as `nopad` with `round_scales_to_power_of_2=True`;
- `pad-fast`: as `pad` with `use_fast_accum=True` in the two backward GEMMs too (torchao's default keeps it for the
  forward's output GEMM only: cuBLAS's fast accumulation in float8 promotes its partial sums to fp32 less often).

Inductor settings for the blocks' compile (`torch.compile(options=...)`), appended to any variant (`pad-nd`,
`bf16-coop`, ...): the float8 scaling kernels (each tensor's amax, then its cast with a transposed copy for the
weight-gradient matmul) ran at 2.2-3.0 TB/s in a profiled 7B step, well under the H200's 4.8 TB/s:

- `nd`: `triton.prefer_nd_tiling` and `triton.tile_reductions` (2D tiles: a kernel that writes a tensor and its
  transpose can coalesce both stores);
- `coop`: `triton.cooperative_reductions` (a whole-tensor amax as one kernel with cross-block synchronization,
  instead of a split reduction's two);
- `pdl`: `triton.enable_pdl` (programmatic dependent launch on Hopper: a kernel's prologue overlaps the last one's
  tail).

A setting the installed torch lacks is reported and left out.

Prints, per variant, the median milliseconds of one forward + backward over 10 measured iterations (3 warm-up,
compile included), per block, and the ratio to bf16. Peak memory in GiB.
"""

from __future__ import annotations

import sys
import time


def build(layers: int, variant: str):
    import torch
    import torch.nn.functional as F
    from torch import nn

    hidden, mlp, heads, kv_heads, head_dim = 3584, 18944, 28, 4, 128

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.RMSNorm(hidden)
            self.q_proj = nn.Linear(hidden, heads * head_dim)
            self.k_proj = nn.Linear(hidden, kv_heads * head_dim)
            self.v_proj = nn.Linear(hidden, kv_heads * head_dim)
            self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
            self.norm2 = nn.RMSNorm(hidden)
            self.gate_proj = nn.Linear(hidden, mlp, bias=False)
            self.up_proj = nn.Linear(hidden, mlp, bias=False)
            self.down_proj = nn.Linear(mlp, hidden, bias=False)

        def forward(self, x):  # x [1, T, hidden]
            t = x.shape[1]
            h = self.norm1(x)
            q = self.q_proj(h).view(1, t, heads, head_dim).transpose(1, 2)
            k = self.k_proj(h).view(1, t, kv_heads, head_dim).transpose(1, 2)
            v = self.v_proj(h).view(1, t, kv_heads, head_dim).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o_proj(a.transpose(1, 2).reshape(1, t, heads * head_dim))
            h = self.norm2(x)
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    model = nn.Sequential(*[Block() for _ in range(layers)]).to("cuda", torch.bfloat16)
    parts = variant.split("-")
    if parts[0] != "bf16":
        from dataclasses import replace

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from torchao.float8.config import Float8GemmConfig

        config = replace(Float8LinearConfig.from_recipe_name("tensorwise"), pad_inner_dim="pad" in parts,
                         round_scales_to_power_of_2="pow2" in parts)
        if "fast" in parts:
            config = replace(config, gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True),
                             gemm_config_grad_weight=Float8GemmConfig(use_fast_accum=True))
        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda m, name: not name.endswith(("k_proj", "v_proj")))
    options = inductor_options(parts)
    for block in model:
        block.compile(options=options) if options else block.compile()
    return model


INDUCTOR = {"nd": {"triton.prefer_nd_tiling": True, "triton.tile_reductions": True},
            "coop": {"triton.cooperative_reductions": True},
            "pdl": {"triton.enable_pdl": True}}
"""A variant's settings names -> inductor config keys (`torch._inductor.config`, dotted)."""


def inductor_options(parts: list[str]) -> dict:
    """The inductor options the variant's parts name, those this torch has; the others are printed and left out."""
    from torch._inductor import config

    options = {}
    for part in parts:
        for key, value in INDUCTOR.get(part, {}).items():
            group, _, name = key.rpartition(".")
            if hasattr(getattr(config, group) if group else config, name):
                options[key] = value
            else:
                print(f"inductor has no {key}: left out of {'-'.join(parts)}", flush=True)
    return options


def time_forward_backward(model, x, warmup: int = 3, iters: int = 10) -> tuple[float, float]:
    """(milliseconds of one forward + backward of `model` on `x` with the loss mean(y^2): the median of `iters` by
    CUDA events, the upper one of an even count; seconds of the `warmup` passes before, compile included)."""
    import torch

    t0 = time.perf_counter()
    for _ in range(warmup):
        model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(x).float().square().mean().backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], warm


def main(argv: list[str]) -> None:
    import torch

    tokens = int(argv[0]) if argv else 8192
    layers = int(argv[1]) if len(argv) > 1 else 4
    variants = argv[2:] or ["bf16", "pad", "nopad", "nopad-pow2"]
    base = None
    for variant in variants:
        torch.manual_seed(0)
        model = build(layers, variant)
        x = torch.randn(1, tokens, 3584, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.reset_peak_memory_stats()
        ms, warm = time_forward_backward(model, x)
        base = ms if variant == "bf16" else base
        ratio = f", {base / ms:.3f}x bf16" if base else ""
        print(f"{variant:>11}: {ms:8.2f} ms per forward + backward ({ms / layers:.2f} per block{ratio}), "
              f"warm-up {warm:.0f} s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        del model, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
