"""Line up `sitecustomize.py`'s trace with `vlmctl bench`'s measured steps: the measured steps' seconds, then what
compiled or autotuned inside it (Triton JIT compiles anywhere in the run, inductor's events from the first measured
step on), in seconds from the first step's start.

    python benchmarks/compile_trace/report.py TRACE.tsv BENCH.jsonl [WARMUP]

BENCH.jsonl: `bench_fp8_gpu.sh`'s results (its first line's run) or `vlmctl bench --json`'s output. WARMUP: the bench's
warm-up steps (3, as `bench_fp8_gpu.sh` runs them).
"""

from __future__ import annotations

import json
import sys


def main(trace: str, results: str, warmup: int = 3) -> None:
    rows = [line.rstrip("\n").split("\t") for line in open(trace)]
    text = open(results).readline()
    result = json.loads(text[text.index("{"):])
    result = result.get("result", result)
    print("measured steps, s:", [round(s, 3) for s in result.get("step_times_s", [])])
    marks = [float(t) for t, _, event, *_ in rows if event == "bench.mark"]
    if len(marks) <= warmup:
        print(f"{len(marks)} step marks: the bench did not reach its measured steps")
        return
    start, measured = marks[0], marks[warmup:]
    # warm-up steps mark once (their start), measured steps twice (start, end): step k starts at measured[2k]
    starts = measured[0::2]
    for t, pid, event, name, seconds in rows:
        t = float(t)
        if event == "bench.mark" or (event.startswith("inductor") and t < measured[0]):
            continue
        step = sum(t >= s for s in starts) - 1
        where = f"measured step {step + 1} of {len(starts)}" if step >= 0 else "before the measured steps"
        print(f"{t - start:9.2f} s  {where:26} {event:30} {name[:56]:56} {float(seconds):.3f} s  (pid {pid})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
