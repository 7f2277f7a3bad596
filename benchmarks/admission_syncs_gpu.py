"""Where one admission of the decoding engine waits for the GPU: the synchronizing CUDA calls of a prefill and its
first tokens, with their Python stacks, while other rows decode (a decode step is then in flight, and each such call
waits for it and leaves the GPU idle while the host prepares the next launch). For docs/benchmarks.md.

    python3 benchmarks/admission_syncs_gpu.py [WORKDIR] [--waves 4]     # from the repository root, on a GPU

Builds the tiny Qwen2.5-VL (`tests/shapes_shards.build_tiny_models`, once under WORKDIR, default /tmp/syncdiag),
loads it in bf16, captures every decode graph, runs batches of 1-8 prompts three times so that every prefill bucket
and picture layout is met and captured, then starts 6 rows of 40 tokens and, for each of `--waves` waves, submits 6
prompts (one 64 px picture and a question each) and runs the engine step that admits them under torch's sync debug
mode ("warn"). Prints the synchronizing calls and milliseconds of each admitting step, then each distinct stack
(vlmctl's, transformers' and liger-kernel's frames, innermost first) with its count. On the CPU it runs the same
steps and finds none (the mode only watches CUDA)."""

from __future__ import annotations

import argparse
import io
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", nargs="?", type=Path, default=Path("/tmp/syncdiag"))
    parser.add_argument("--waves", type=int, default=4)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from PIL import Image

    from vlmctl.inference import GenerationRequest, load_for_generation
    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.sampling import SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (args.workdir / "tiny-qwen2.5-vl" / "config.json").exists():
        from shapes_shards import build_tiny_models

        build_tiny_models(args.workdir, 20)
    model, processor = load_for_generation(args.workdir / "tiny-qwen2.5-vl", device=device,
                                           dtype="bf16" if device == "cuda" else "fp32")

    def png(i: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (64, 64), ((37 * i) % 256, (91 * i) % 256, 50)).save(buf, format="PNG")
        return buf.getvalue()

    def prompts(n: int, at: int) -> list:
        return [GenerationRequest(messages=[{"role": "user", "content": [{"type": "image", "index": 0},
                                                                        {"type": "text", "text": "What color is the square?"}]}],
                                  images=[png(at + i)], id=str(at + i)) for i in range(n)]

    engine = DecodeEngine(model, processor, max_slots=32, max_length=512)
    engine.runner.capture_decode(engine.max_length)
    for k in range(3):  # every prefill bucket and picture layout met (and captured) before the measured steps
        for n in (1, 2, 4, 6, 8):
            engine.generate(prompts(n, 100 * k), SamplingParams(max_tokens=6, ignore_eos=True))
    stacks: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(name in f.filename for name in ("vlmctl", "transformers", "liger"))][-7:]
        stacks[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))] += 1

    for p in prompts(6, 1000):
        engine.submit(p, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    per_step = []
    for wave in range(args.waves):
        for p in prompts(6, 2000 + 10 * wave):
            engine.submit(p, SamplingParams(max_tokens=4, ignore_eos=True))
        before, started = sum(stacks.values()), time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()  # the admission (prefill, first tokens) and one decode step
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        per_step.append((sum(stacks.values()) - before, round(1000 * (time.perf_counter() - started), 2)))
        for _ in range(6):
            engine.step()
    engine.generate([], SamplingParams())
    print("synchronizing calls and ms per admitting step:", per_step)
    for stack, count in stacks.most_common(20):
        print(f"{count:4d}  {stack}")


if __name__ == "__main__":
    main()
