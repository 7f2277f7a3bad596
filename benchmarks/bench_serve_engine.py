"""One `generate` call of `vlmctl serve`'s engine at 1, 4 and 8 rows, without HTTP: does a call's cost grow with its rows?

Usage:
    python benchmarks/bench_serve_engine.py MODEL_DIR [--device cuda] [--rows 1,4,8] [--max-tokens 32] [--reps 3]
                                            [--profile] [--dtype auto]

Loads MODEL_DIR as `vlmctl serve` does (`vlmctl.serve.server.load_for_serving`: the plan's dtype and attention), makes
one engine (its worker stopped: the calls run in this thread), and for each row count R runs `Engine._run` on R image
questions (the 64 px pictures and questions of `bench_serve.py`, greedy, --max-tokens each) --reps times after one
warm-up call, the device synchronized around each call. Prints one `ENGINE {json}` line per R: the best and median
seconds per call, output tokens, milliseconds per decode step (call seconds / tokens per row), and the time per
phase of the best call: the processor (`_model_inputs`), the model's forwards (prefill and decode steps, timed by
forward hooks: on a GPU they return once the kernels are queued, so the streamer's per-step sync lands in `other`),
the engine's per-row token handling (`_Row.step`, called from the streamer) and the rest of `generate` (`other`).
A call of R rows that costs about R times one row's is per-row work; the phases say where.

--profile: after the timings, one call of 1 row and one of max(--rows) rows under torch's profiler; prints the 20 ops
with the most self time on the device (CUDA) or the host (CPU), and their call counts, so an op whose count or time
grows with the rows stands out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import QUESTIONS, picture  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    import torch

    import vlmctl.inference.generation as generation
    import vlmctl.serve.engine as engine_module
    from vlmctl.data.images import MediaRoots
    from vlmctl.serve.engine import Engine, Job
    from vlmctl.serve.protocol import parse_request, to_generation_request
    from vlmctl.serve.server import load_for_serving

    model, processor, choice = load_for_serving(args.model, device=args.device, dtype=args.dtype)
    cuda = next(model.parameters()).device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine = Engine(model, processor, max_batch_size=max(int(r) for r in args.rows.split(",")))
    engine.close()  # no worker: the calls below run in this thread

    phases: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    generation._model_inputs = timed("processor", generation._model_inputs)
    engine_module._Row.step = timed("row_step", engine_module._Row.step)
    forwards: list[float] = []
    started = [0.0]
    model.register_forward_pre_hook(lambda m, a: started.__setitem__(0, time.perf_counter()))
    model.register_forward_hook(lambda m, a, o: forwards.append(time.perf_counter() - started[0]))

    def jobs(rows: int) -> list[tuple[Job, list]]:
        out = []
        for i in range(rows):
            req = parse_request({"model": "m", "max_tokens": args.max_tokens, "temperature": 0, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture(i)}},
                                             {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]}]})
            events: list = []
            request = to_generation_request(req, MediaRoots.of(Path.cwd(), ()), 10**9)
            out.append((Job(engine.render(request), max_tokens=args.max_tokens, sink=events.append), events))
        return out

    def call(rows: int) -> tuple[float, int, dict]:
        batch = jobs(rows)
        phases.clear()
        forwards.clear()
        sync()
        t0 = time.perf_counter()
        engine._run([job for job, _ in batch])
        sync()
        seconds = time.perf_counter() - t0
        failed = [e for _, events in batch for e in events if e[0] == "error"]
        if failed:
            raise SystemExit(f"the call of {rows} rows failed: {failed[0]}")
        tokens = sum(e[3] for _, events in batch for e in events if e[0] == "done")
        split = {"processor_s": phases.get("processor", 0.0), "prefill_s": forwards[0] if forwards else 0.0,
                 "decode_forwards_s": sum(forwards[1:]), "decode_steps": max(len(forwards) - 1, 0),
                 "row_step_s": phases.get("row_step", 0.0)}
        split["other_s"] = seconds - split["processor_s"] - split["prefill_s"] - split["decode_forwards_s"] - split["row_step_s"]
        return seconds, tokens, {k: round(v, 4) if isinstance(v, float) else v for k, v in split.items()}

    print("SERVING " + json.dumps({"device": str(next(model.parameters()).device), **choice}), flush=True)
    row_counts = [int(r) for r in args.rows.split(",")]
    call(row_counts[0])  # warm-up: kernels, allocator
    for rows in row_counts:
        runs = [call(rows) for _ in range(args.reps)]
        best = min(runs, key=lambda r: r[0])
        seconds = [r[0] for r in runs]
        print("ENGINE " + json.dumps({
            "rows": rows, "best_s": round(best[0], 4), "median_s": round(statistics.median(seconds), 4),
            "output_tokens": best[1], "ms_per_step": round(1000 * best[0] / max(best[1] / rows, 1), 2),
            "output_tokens_per_s": round(best[1] / best[0], 1), **best[2]}), flush=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for rows in (row_counts[0], max(row_counts)):
            call(rows)
            with profile(activities=activities) as prof:
                call(rows)
            print(f"PROFILE rows={rows}", flush=True)
            print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=20),
                  flush=True)


if __name__ == "__main__":
    main()
