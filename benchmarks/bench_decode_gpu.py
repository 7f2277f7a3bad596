"""Decoding speed of vlmctl's engine (`vlmctl.inference.engine.DecodeEngine`) beside transformers' own `generate`, in
one process, on the same prompts: output tokens per second at 1, 8 and 32 rows.

Usage (from the repository root; on the GPU machine with PYTHONPATH=.:/tmp/site):
    python benchmarks/bench_decode_gpu.py --preset qwen2.5-vl-3b --rows 1,8,32 --max-tokens 128 \
        --variants graphs,eager --hf static --parity 20

The preset is built with random weights in bf16 directly on the device (`vlmctl.bench.random_model`, as `vlmctl bench`
does; the real vocabulary size, a small trained tokenizer). Every prompt is one 64 px picture and a question
(`bench_serve.py`'s), rendered by the chat template; answers are `--max-tokens` long (end-of-sequence tokens ignored),
greedy. For each rows count R:
- engine variants (`--variants`): `graphs` (decode steps replayed from CUDA graphs), `eager` (no graphs), `compile`
  (each decoder layer through torch.compile, then graphs), `none` (graphs, no fused kernels; `graphs` takes liger's where
  installed), each optionally with `:nofuse` (separate q/k/v and gate/up projections: `fused.fuse_projections` off)
  `:sync` (each step's tokens taken before the next step is launched: `DecodeEngine(overlap=False)`) and
  `:noprefill` (every prefill eager: `DecodeEngine(prefill_graphs=False)`); fusing
  changes the model in place, so `:nofuse` variants must come first: R requests submitted at once and stepped to the end, after one warm-up
  round of the same shapes (graph capture and compilation stay out of the timing). Prints tokens/s, ms per decode
  step and the median time to first token (admission to first token, prefill included);
- `--hf static`: `model.generate(cache_implementation="static")` (transformers compiles its decode step) on the same R
  prompts left-padded, after one warm-up call; `--hf dynamic`: the default dynamic cache, eager.
`--profile N`: N decode steps of one row without graphs under torch.profiler: kernels per step, the GPU time they
add up to, and the kernels that take most of it (what a graph replay cannot hide); then where one request's time to
first token goes (`profile_prefill`).
`--parity N`: N different prompts answered greedily by `generate` (dynamic cache, the model's own projections), then
by the engine (fused projections) with graphs and without: how many answers are identical token for token (bf16 ties can split them).
Each result is one `RESULT {json}` line; a table comes last.
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


def prompts(n: int):
    import base64

    from vlmctl.inference import GenerationRequest

    out = []
    for i in range(n):
        image = base64.b64decode(picture(i).split(",", 1)[1])  # a data URL
        out.append(GenerationRequest(messages=[{"role": "user", "content": [{"type": "image", "index": 0},
                                                                            {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]}],
                                     images=[image], id=str(i)))
    return out


def load(preset: str, device: str, dtype_name: str = "bf16"):
    import torch

    from vlmctl.bench import _random_choice, random_model
    from vlmctl.config import ModelSection

    choice = _random_choice(ModelSection(preset=preset, init="random"))
    dtype = torch.float32 if device == "cpu" or dtype_name == "fp32" else torch.bfloat16
    model = random_model(choice.plan, choice.processor, device=device, dtype=dtype).eval()
    model.generation_config.pad_token_id = choice.processor.tokenizer.pad_token_id or 0
    return model, choice.processor, choice.family


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(engine, requests, max_tokens: int, device: str) -> dict:
    from vlmctl.inference.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sync(device)
    steps0, decode0, prefill0 = engine.steps, engine.decode_seconds, engine.prefill_seconds
    start = time.perf_counter()
    handles = [engine.submit(r, params, stream=False) for r in requests]
    while any(not h.finished for h in handles):
        engine.step()
    sync(device)
    wall = time.perf_counter() - start
    tokens = sum(c.generated for h in handles for c in h.completions)
    steps = engine.steps - steps0
    errors = [h.error for h in handles if h.error]
    ttft = [h.first_token_at - h.submitted_at for h in handles if h.first_token_at]
    return {"tokens": tokens, "seconds": round(wall, 4), "tokens_per_s": round(tokens / wall, 1), "decode_steps": steps,
            "ms_per_step": round(1000 * (engine.decode_seconds - decode0) / max(steps, 1), 3),
            "prefill_s": round(engine.prefill_seconds - prefill0, 4),
            "ttft_ms_median": round(1000 * statistics.median(ttft), 1) if ttft else None, **({"errors": errors[:2]} if errors else {})}


def run_hf(model, processor, family, requests, max_tokens: int, cache: str, device: str) -> dict:
    import torch

    from vlmctl.inference.generation import _model_inputs
    from vlmctl.inference.prompt import render_request

    tok = processor.tokenizer
    side, tok.padding_side = tok.padding_side, "left"
    rendered = [render_request(r, processor, family) for r in requests]
    inputs = _model_inputs(model, processor, [r.text for r in rendered], [i for r in rendered for i in r.images])
    tok.padding_side = side
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        model.generate(**inputs, **kwargs)  # warm-up (compiles the static-cache step)
        sync(device)
        start = time.perf_counter()
        out = model.generate(**inputs, **kwargs)
        sync(device)
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    return {"tokens": int(tokens), "seconds": round(wall, 4), "tokens_per_s": round(tokens / wall, 1)}


def parity(model, processor, family, n: int, max_tokens: int, device: str) -> dict:
    import torch

    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.generation import _model_inputs
    from vlmctl.inference.prompt import render_request
    from vlmctl.inference.sampling import SamplingParams

    reqs = prompts(n)
    hf = []  # first, while the model's projections are still apart (the engine fuses them in place)
    for r in reqs:
        rr = render_request(r, processor, family)
        inputs = _model_inputs(model, processor, [rr.text], rr.images)
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
        hf.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    answers = {}
    for name, graphs in (("graphs", None), ("eager", False)):
        engine = DecodeEngine(model, processor, family=family, max_slots=8, max_length=1024, graphs=graphs, kernels="none")
        done = engine.generate(reqs, SamplingParams(max_tokens=max_tokens))
        answers[name] = [r.completions[0].token_ids for r in done]
        eos = engine.eos
    hf = [next((ids[:k] for k, t in enumerate(ids) if t in eos), ids) for ids in hf]
    same = lambda a, b: sum(x == y for x, y in zip(a, b))  # noqa: E731
    return {"probes": n, "graphs_vs_eager": same(answers["graphs"], answers["eager"]),
            "graphs_vs_generate": same(answers["graphs"], hf), "eager_vs_generate": same(answers["eager"], hf)}


def profile(model, processor, family, steps: int, device: str) -> dict:
    """Kernels of `steps` eager decode steps of one row (the engine's liger kernels and fused projections as the
    graphs variant has them): count per step, summed GPU time per step, the 12 largest by total time."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.sampling import SamplingParams

    engine = DecodeEngine(model, processor, family=family, max_slots=1, max_length=1024, graphs=False)
    handle = engine.submit(prompts(1)[0], SamplingParams(max_tokens=steps + 8, ignore_eos=True), stream=False)
    for _ in range(4):  # prefill and a few steps before the trace
        engine.step()
    sync(device)
    with torch_profile(activities=[ProfilerActivity.CUDA if device.startswith("cuda") else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    while not handle.finished:
        engine.step()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events)
    count = sum(e.count for e in events)
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    return {"steps": steps, "kernels_per_step": round(count / steps, 1), "kernel_ms_per_step": round(total_us / steps / 1000, 3),
            "top": [(e.key[:70], e.count // steps, round(e.self_device_time_total / steps, 1)) for e in top]}


def profile_prefill(model, processor, family, device: str, runs: int = 5) -> dict:
    """Where one request's time to first token goes (engine with graphs, kernels as the graphs variant has them,
    `max_tokens=1` so the step ends at the prefill's token): the median wall ms of `runs` steps that admit a fresh
    request (render, processor, encoders, language model, first token), with every prefill eager and with the
    language model's prefill replayed from its bucket's graph, then one such step (graphs) under torch.profiler
    (CUDA kernels: count and summed ms) and one under cProfile (the 15 Python functions of largest cumulative time,
    the profiler's own cost included: read them as shares)."""
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    reqs = prompts(runs + 3)
    eager = DecodeEngine(model, processor, family=family, max_slots=1, max_length=1024, prefill_graphs=False)
    engine = eager

    def one(request):
        sync(device)
        start = time.perf_counter()
        handle = engine.submit(request, params, stream=False)
        while not handle.finished:
            engine.step()
        sync(device)
        return time.perf_counter() - start

    one(reqs[0])  # warm-up: first shapes, the processor's caches
    eager_walls = [one(r) for r in reqs[1:runs + 1]]
    del eager
    engine = DecodeEngine(model, processor, family=family, max_slots=1, max_length=1024)
    one(reqs[0])  # captures the prefill's bucket
    walls = [one(r) for r in reqs[1:runs + 1]]
    with torch_profile(activities=[ProfilerActivity.CUDA if device.startswith("cuda") else ProfilerActivity.CPU]) as prof:
        one(reqs[runs + 1])
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    profiler = cProfile.Profile()
    profiler.enable()
    one(reqs[runs + 2])
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)
    top = [(f"{Path(f).name}:{line}:{fn}"[:80], round(1000 * ct, 1)) for (f, line, fn), (_, _, _, ct, _) in rows[:40]]
    return {"wall_ms_median": round(1000 * statistics.median(walls), 1),
            "eager_prefill_wall_ms_median": round(1000 * statistics.median(eager_walls), 1),
            "prefill_graph_replays": engine.runner.prefill_graphs, "prefill_reason": engine.runner.prefill_reason,
            "kernels": sum(e.count for e in events),
            "kernel_ms": round(sum(e.self_device_time_total for e in events) / 1000, 2), "cumulative_ms": top}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--variants", default="graphs,eager")
    ap.add_argument("--hf", default="", help="comma list of: static, dynamic")
    ap.add_argument("--parity", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", help="bf16 or fp32 (parity in fp32 leaves bf16 ties out)")
    args = ap.parse_args()

    import torch

    from vlmctl.inference.engine import DecodeEngine

    rows = [int(r) for r in args.rows.split(",")]
    t0 = time.perf_counter()
    model, processor, family = load(args.preset, args.device, args.dtype)
    print(f"loaded {args.preset} in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}", flush=True)
    results = []

    def emit(result):
        results.append(result)
        print("RESULT " + json.dumps(result), flush=True)

    if args.parity:
        emit({"what": "parity", "preset": args.preset, **parity(model, processor, family, args.parity, 32, args.device)})
    for spec in [v for v in args.variants.split(",") if v]:
        t0 = time.perf_counter()
        variant, *flags = spec.split(":")
        kernels = {"compile": "compile", "none": "none", "eager": "none", "liger": "liger"}.get(variant)
        engine = DecodeEngine(model, processor, family=family, max_slots=max(rows), max_length=args.max_length,
                              graphs=variant != "eager", kernels=kernels, fuse="nofuse" not in flags, overlap="sync" not in flags,
                              prefill_graphs=False if "noprefill" in flags else None)
        for r in rows:
            reqs = prompts(r)
            run_engine(engine, reqs, args.max_tokens, args.device)  # warm-up: captures (and compiles) this shape
            emit({"what": f"engine-{spec}", "preset": args.preset, "rows": r, **run_engine(engine, reqs, args.max_tokens, args.device),
                  "mode": engine.mode, "reason": engine.reason, "kernels": engine.runner.kernels, "graphs": engine.runner.graph_count,
                  "fused_groups": engine.runner.fused, "overlapped_steps": engine.overlapped,
                  "prefill_graph_replays": engine.runner.prefill_graphs, "prefill_reason": engine.runner.prefill_reason,
                  "setup_s": round(time.perf_counter() - t0, 1)})
        del engine
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    for cache in [c for c in args.hf.split(",") if c]:
        for r in rows:
            try:
                emit({"what": f"generate-{cache}", "preset": args.preset, "rows": r,
                      **run_hf(model, processor, family, prompts(r), args.max_tokens, cache, args.device)})
            except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported, the others stand
                emit({"what": f"generate-{cache}", "preset": args.preset, "rows": r, "error": f"{type(exc).__name__}: {exc}"[:300]})
    if args.profile:
        emit({"what": "profile", "preset": args.preset, **profile(model, processor, family, args.profile, args.device)})
        emit({"what": "profile-prefill", "preset": args.preset, **profile_prefill(model, processor, family, args.device)})
    print(f"\n{'what':<18} {'rows':>5} {'tok/s':>10} {'ms/step':>9} {'ttft ms':>8} {'prefill s':>9}")
    for r in results:
        if r["what"] in ("parity", "profile", "profile-prefill"):
            print(f"parity: {r}")
            continue
        print(f"{r['what']:<18} {r.get('rows', ''):>5} {r.get('tokens_per_s', r.get('error', '')):>10} "
              f"{r.get('ms_per_step', ''):>9} {r.get('ttft_ms_median', '') or '':>8} {r.get('prefill_s', ''):>9}")


if __name__ == "__main__":
    main()
