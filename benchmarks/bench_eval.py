"""Generation throughput of `vlmctl eval` (HF backend, greedy, left padding) on the shapes VQA set.

Usage:
    python benchmarks/bench_eval.py --workdir /tmp/evalbench [--samples 512] [--batch-size 64] [--max-new-tokens 8]
    torchrun --nproc_per_node 2 benchmarks/bench_eval.py --workdir /tmp/evalbench ...   (samples sharded by rank)

The first run writes the data set and builds the tiny random preset under --workdir (run it once in one process
before a torchrun run: `--prepare-only`); --model evaluates another model folder instead. Rank 0 prints one
`RESULT {json}` line: samples, wall seconds of `run_eval` (model load included), samples/s, world size, device, and
the seconds of that wall spent loading the model (`load_s`) and generating (`generate_s`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--prepare-only", action="store_true")
    args = ap.parse_args()

    from vlmctl.config import ModelSection
    from vlmctl.data.synthetic import generate_shapes_vqa
    from vlmctl.evaluation import load_samples, run_eval
    from vlmctl.models.build import build_model

    data = args.workdir / "shapes" / "shapes_vqa.json"
    if not data.is_file():
        generate_shapes_vqa(data.parent, num_samples=args.samples, seed=1, image_size=64)
    samples = load_samples(str(data), args.workdir, limit=args.samples)
    model = args.model or args.workdir / "model"
    if not model.exists():
        texts = [t for s in samples for t in s.text_parts()]
        build_model(ModelSection(preset="tiny", init="random", output_dir=model), tokenizer_texts=texts)
    if args.prepare_only:
        return
    import vlmctl.evaluation.runner as runner

    parts: dict[str, float] = {}  # wall seconds inside the model load and the generation (the rest: imports, scoring)

    def timed(name, fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - start
        return call

    for name in ("load_for_generation", "generate"):  # an older tree may name them otherwise: then not split
        if callable(getattr(runner, name, None)):
            setattr(runner, name, timed(name, getattr(runner, name)))
    t0 = time.perf_counter()
    result = run_eval(model, samples, task="vqa", data_name=str(data), out_dir=args.out, batch_size=args.batch_size,
                      max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - t0
    if result is None:
        return
    import torch

    print("RESULT " + json.dumps({
        "samples": len(samples), "seconds": round(seconds, 2), "samples_per_s": round(len(samples) / seconds, 1),
        "world": int(os.environ.get("WORLD_SIZE", 1)), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "metrics": result.metrics,
        **{key: round(parts[name], 2) if name in parts else None
           for key, name in (("load_s", "load_for_generation"), ("generate_s", "generate"))},
    }), flush=True)


if __name__ == "__main__":
    main()
