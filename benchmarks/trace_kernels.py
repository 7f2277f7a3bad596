"""GPU kernel time of a profiled step, by kind, from torch.profiler Chrome traces (`vlmctl bench --profile DIR`
writes DIR/rank<N>/trace.json.gz; `vlmctl serve --profile-dir` writes one per profile).

    python benchmarks/trace_kernels.py TRACE.json.gz [TRACE.json.gz ...] [--top 25]

Prints, per trace, the milliseconds and launch counts of the GPU events (`kernel`, `gpu_memcpy`, `gpu_memset`) by
kind: flash attention (names with flash), cuBLAS/CUTLASS GEMMs (nvjet, gemm, cutlass or sm90_xmma), inductor's Triton kernels
(names starting with triton; float8's amax reductions and casts, and the fused optimizer step, are among them), the
foreach kernels (multi_tensor_apply: gradient norms and clipping, optimizer parts), copies and sets, other ATen
kernels; then the `--top` kernels by time. Kernels are summed, not unioned: overlapping streams count twice.
Used for the float8 step's kernel table in docs/benchmarks.md."""

from __future__ import annotations

import argparse
from collections import Counter

from vlmctl.profiling import GPU_CATEGORIES, trace_events


def kind(name: str) -> str:
    """The kind of a GPU event named `name` (module docstring)."""
    lower = name.lower()
    if "flash" in lower:  # first: flash attention's template names hold cutlass types
        return "attention"
    if any(k in lower for k in ("nvjet", "gemm", "cutlass", "sm90_xmma")):
        return "gemm"
    if name.startswith("triton"):
        return "triton"
    if "multi_tensor" in lower or "foreach" in lower:
        return "foreach"
    if name.startswith(("Memcpy", "Memset")):
        return "copies and sets"
    return "other aten"


def summarize(path: str, top: int) -> str:
    events = [e for e in trace_events(path) if e.get("cat") in GPU_CATEGORIES]
    us, count, by_name = Counter(), Counter(), Counter()
    for e in events:
        us[kind(e["name"])] += e["dur"]
        count[kind(e["name"])] += 1
        by_name[e["name"]] += e["dur"]
    lines = [f"{path}: {sum(us.values()) / 1e3:.1f} ms of GPU events, {len(events)} launches"]
    lines += [f"  {k:16} {v / 1e3:8.1f} ms {count[k]:7}" for k, v in us.most_common()]
    lines += [f"    {v / 1e3:8.1f} ms  {name[:110]}" for name, v in by_name.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=25, help="kernels listed by time after the kinds")
    args = ap.parse_args()
    for path in args.traces:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
