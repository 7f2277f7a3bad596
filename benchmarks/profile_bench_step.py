"""Profile one measured step of `vlmctl bench` with torch.profiler (one process; CPU operators only where no GPU is visible).

Usage, in a project folder:

    python benchmarks/profile_bench_step.py OUT_DIR [vlmctl bench arguments and key=value overrides...]

Runs `vlmctl bench` in this process and wraps its first measured step (the one after the warm-up) in
`torch.profiler.profile` (CPU and CUDA activities). Prints the step's wall seconds, the seconds the GPU ran kernels
(the union of kernel intervals: what is left is the GPU waiting on the host) and the top operators by self CPU time
and by self CUDA time; writes the same tables to OUT_DIR/ops.txt and the trace to OUT_DIR/trace.json.gz (open it in
https://ui.perfetto.dev).
"""

from __future__ import annotations

import gzip
import shutil
import sys
import time
from pathlib import Path


def kernel_seconds(prof) -> float:
    """Seconds covered by at least one CUDA kernel (intervals merged), from the profiler's device events."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy / 1e6  # microseconds


def main(argv: list[str]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from vlmctl import bench
    from vlmctl.cli.app import main as cli

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    measure = bench._measure

    def profiled_measure(trainer, labels, train, ctx, *, steps, warmup, log):
        step, count = trainer.train_step, [0]

        def one_step():
            count[0] += 1
            if count[0] != warmup + 1:
                return step()
            sync()
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                result = step()
                sync()
                wall = time.perf_counter() - t0
            busy = kernel_seconds(prof)
            avg = prof.key_averages()
            tables = (f"step {wall:.3f} s wall, GPU kernels {busy:.3f} s ({100 * busy / wall:.0f}%), "
                      f"{result.text_tokens + result.visual_tokens} tokens\n\n"
                      + avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60) + "\n"
                      + avg.table(sort_by="self_cuda_time_total" if cuda else "cpu_time_total", row_limit=30, max_name_column_width=60))
            print(tables, flush=True)
            (out / "ops.txt").write_text(tables)
            trace = out / "trace.json"
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
            return result

        trainer.train_step = one_step
        return measure(trainer, labels, train, ctx, steps=steps, warmup=warmup, log=log)

    bench._measure = profiled_measure
    sys.argv = ["vlmctl", "bench", *argv[1:]]
    cli()


if __name__ == "__main__":
    main(sys.argv[1:])
