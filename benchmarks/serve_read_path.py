"""What one served request costs to read, part by part, without a server: the work `vlmctl serve` does between a
request's arrival and its job in the engine's queue, timed alone in one process (no other thread), for comparison
with `read_ms` under load (benchmarks/bench_serve.py) and `benchmarks/gil_round_trip.py`.

Usage:
    python benchmarks/serve_read_path.py [--workdir /tmp/readpath] [--preset tiny-qwen2.5-vl] [--model DIR] [--repeats 200]

The request is bench_serve.py's (a 64 px PNG as a data: URL and a question, streamed). Parts, in the order the server
runs them: `parse_request` (the body's JSON already decoded), `to_generation_request` (the picture decoded and
checked), the chat template (`render_request`), the token count, all in the request's thread; then the processor on
the prompt alone (`processor_inputs`, what a processor worker runs). Prints one `RESULT {json}` line: milliseconds per
part (the mean of --repeats after one untimed call).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import QUESTIONS, picture, preset_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/readpath"))
    ap.add_argument("--preset", default="tiny-qwen2.5-vl")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()

    from vlmctl.data.images import MediaRoots
    from vlmctl.inference import load_for_generation
    from vlmctl.inference.inputs import processor_inputs
    from vlmctl.inference.prompt import model_family, render_request
    from vlmctl.serve.protocol import parse_request, to_generation_request

    model_dir = args.model or preset_model(args.workdir, args.preset)
    model, processor = load_for_generation(model_dir, device="cpu", dtype="fp32")
    family = model_family(model)
    body = {"model": "bench", "max_tokens": 32, "stream": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": picture(0)}}, {"type": "text", "text": QUESTIONS[0]}]}]}
    roots = MediaRoots.of(Path.cwd(), [])

    def timed(fn):
        out = fn()
        start = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        return out, round(1e3 * (time.perf_counter() - start) / args.repeats, 4)

    ms = {}
    req, ms["parse_request"] = timed(lambda: parse_request(body))
    request, ms["to_generation_request"] = timed(lambda: to_generation_request(req, roots, 10**8))
    rendered, ms["chat_template"] = timed(lambda: render_request(request, processor, family))
    _, ms["token_count"] = timed(lambda: len(processor.tokenizer(rendered.text, add_special_tokens=False)["input_ids"]))
    _, ms["processor"] = timed(lambda: processor_inputs(processor, [rendered.text], list(rendered.images), [], [], None))
    print("RESULT " + json.dumps({"model": str(model_dir), "image_processor": type(processor.image_processor).__name__,
                                  "repeats": args.repeats, "ms": ms}), flush=True)


if __name__ == "__main__":
    main()
