"""Packed-training throughput variants through the trainer's own step (`vlmctl.bench.run_bench`), one GPU,
random-init Qwen2.5-VL preset, the baseline's workload (pure bf16 parameters and AdamW state, like the baseline).

Usage (CUDA machine): python benchmarks/bench_throughput_gpu.py [3b|7b|tiny] VARIANT
Variants: the keys of VARIANTS. Environment: STEPS (8 measured), WARMUP (3), TOKENS (tokens_per_batch). Prints one RESULT line (JSON). liger-kernel and the compiled vision rotary patch
transformers' modules globally, so run one variant per process. The hooks of the first kernel measurements
(aligned MLP, GEMM patch embedding, compiled rotary/MLP, each alone) became `kernels.apply_vision_kernels`. PROFILE=1 also prints the top CUDA kernels.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from vlmctl.bench import run_bench
from vlmctl.config import ModelSection, TrainSection


BASE = dict(stage="full", strategy="ddp", precision="bf16", master_weights="bf16", tokens_per_batch=16384, max_grad_norm=1.0,
            learning_rate=1e-5, warmup_ratio=0.0, lr_scheduler="constant")
VARIANTS = {
    # name: train overrides (the vision kernels of `kernels.apply_vision_kernels` are on by default on CUDA)
    "default": {},
    "vision_eager": {"compile_vision": "off"},
    "default_18k": {"tokens_per_batch": 18432},
    "default_20k": {"tokens_per_batch": 20480},
    "default_gc8k": {"tokens_per_batch": 8192, "gradient_checkpointing": True},
    "oib_gc8k": {"tokens_per_batch": 8192, "gradient_checkpointing": True, "optimizer_in_backward": True, "max_grad_norm": 0.0},
    "oib": {"optimizer_in_backward": True, "max_grad_norm": 0.0},
    "oib_24k": {"tokens_per_batch": 24576, "optimizer_in_backward": True, "max_grad_norm": 0.0},
}


def main() -> None:
    size, name = sys.argv[1], sys.argv[2]
    steps = int(os.environ.get("STEPS", 8))
    warmup = int(os.environ.get("WARMUP", 3))
    overrides = VARIANTS[name]
    settings = {**BASE, **overrides}
    if os.environ.get("TOKENS"):  # e.g. a CPU smoke run of the tiny preset
        settings["tokens_per_batch"] = int(os.environ["TOKENS"])
    train = TrainSection(**settings)
    model = ModelSection(preset="tiny-qwen2.5-vl" if size == "tiny" else f"qwen2.5-vl-{size}", init="random")

    prof = None
    if os.environ.get("PROFILE"):
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    try:
        r = run_bench(model, train, steps=steps, warmup=warmup, log=lambda m: print(f"[{size}-{name}] {m}", flush=True))
        out = {**r.as_dict(), "name": f"{size}-{name}"}
    except torch.OutOfMemoryError:
        out = {"name": f"{size}-{name}", "error": "out of memory"}
    if prof is not None:
        prof.__exit__(None, None, None)
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.self_device_time_total for e in events)
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:40]:
            print(f"PROF {100 * e.self_device_time_total / total:5.1f}% {e.self_device_time_total / 1e3:9.1f} ms {e.count:6d}  {e.key[:150]}")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
