"""What one served request costs to read, part by part, without a server: the work `vlmctl serve` does between a
request's arrival and its job in the engine's queue, timed alone in one process (no other thread), for comparison
with `read_ms` under load (benchmarks/bench_serve.py) and `benchmarks/gil_round_trip.py`.

Usage:
    python benchmarks/serve_read_path.py [--workdir /tmp/readpath] [--preset tiny-qwen2.5-vl] [--model DIR] [--repeats 200]
                                         [--jpeg-side 1024]

The request is bench_serve.py's (a 64 px PNG as a data: URL and a question, streamed). Parts, in the order the server
runs them: `parse_request` (the body's JSON already decoded), `to_generation_request` (the picture decoded and
checked), the chat template (`render_request`), the token count, all in the request's thread; then the processor on
the prompt alone (`processor_inputs`, what a processor worker runs); last, the prompt's pictures pickled for a
worker as the server's feeder thread pickles them, decoded (a PIL picture) and as the encoded bytes it sends now
(`serve.prepare.portable_image`), for the request's picture and, with --jpeg-side, a JPEG of that size. Prints one
`RESULT {json}` line: milliseconds per part (the mean of --repeats after one untimed call; the pickling parts over
fresh renderings) and the pickled sizes in bytes.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
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
    ap.add_argument("--jpeg-side", type=int, default=0, help="also time a JPEG of this many pixels a side (0: only the request's picture)")
    args = ap.parse_args()

    from vlmctl.data.images import MediaRoots
    from vlmctl.inference import load_for_generation
    from vlmctl.inference.inputs import processor_inputs
    from vlmctl.inference.prompt import GenerationRequest, model_family, render_request
    from vlmctl.serve.prepare import portable_image
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
    # the pictures as the server's feeder thread pickles them for a processor worker: decoded pixels (a PIL picture)
    # against the encoded bytes it is sent as now (`serve.prepare.portable_image`); each call on a fresh rendering,
    # since pickling decodes the picture in place
    sizes = {}
    for name, jpeg_side in (("request", 0), ("jpeg", args.jpeg_side)):
        if name == "jpeg" and not jpeg_side:
            continue
        probe = request if name == "request" else GenerationRequest(messages=request.messages, images=[_jpeg(jpeg_side)])
        for how, send in (("decoded", lambda images: list(images)), ("encoded", lambda images: [portable_image(i) for i in images])):
            fresh = [render_request(probe, processor, family).images for _ in range(args.repeats + 1)]
            start = time.perf_counter()
            for images in fresh:
                sizes[f"{name}_{how}_bytes"] = len(pickle.dumps(send(images)))
            ms[f"pickle_{name}_{how}"] = round(1e3 * (time.perf_counter() - start) / len(fresh), 4)
    print("RESULT " + json.dumps({"model": str(model_dir), "image_processor": type(processor.image_processor).__name__,
                                  "repeats": args.repeats, "ms": ms, "pickled_bytes": sizes}), flush=True)


def _jpeg(side: int) -> bytes:
    """A side x side JPEG of noise (a photograph's entropy, roughly), as a client would send one."""
    from PIL import Image

    buf = io.BytesIO()
    Image.effect_noise((side, side), 40).convert("RGB").save(buf, format="JPEG", quality=90)
    return buf.getvalue()


if __name__ == "__main__":
    main()
