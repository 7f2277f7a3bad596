"""Where the wall time of a `vlmctl eval` goes, phase by phase, in one process.

Usage (after benchmarks/bench_eval.py --prepare-only has written the data set):
    python benchmarks/bench_eval_phases.py --workdir /tmp/evalbench --model MODEL [--samples 500] [--batch-size 32]
        [--max-new-tokens 16] [--variants default,no-prefill-graphs,eager]

Times, in seconds and in this order: importing torch, the CUDA context, the model class's import (transformers'
modeling module and what it brings in), the config, the weights (`from_pretrained` to the CPU), their copy to the
device, the processor, reading the samples and rendering their prompts. Then each variant of the decoding engine
generates the answers twice with a new engine: `cold` (its graphs captured as it meets each shape, as one `vlmctl
eval` does) and `warm` (the same engine again). Variants: `default` (the engine's defaults), `no-prefill-graphs`
(decode graphs only), `no-encoder-graphs`, `eager` (no graph at all); `inputs_s`: the seconds of each pass in the
processor and the inputs' copy to the device. One `PHASES {json}` line at the end.

`--direct-load` also times the weights loaded straight onto the device (`from_pretrained(device_map=DEVICE)`, a
second copy, freed after), against the two phases above. `--imports N` first runs the same start (torch, the
config, the model class) in a child process under `python -X importtime` and prints the N modules whose imports took
longest, counting what they import (`IMPORTS {json}`: seconds, cumulative and own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "default": {},
    "no-prefill-graphs": {"prefill_graphs": False},
    "no-encoder-graphs": {"encoder_graphs": False},
    "no-prefill-or-encoder-graphs": {"prefill_graphs": False, "encoder_graphs": False},
    "eager": {"graphs": False, "prefill_graphs": False, "encoder_graphs": False},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--variants", default="default,no-prefill-graphs,eager")
    ap.add_argument("--direct-load", action="store_true", help="also time from_pretrained(device_map=DEVICE)")
    ap.add_argument("--imports", type=int, default=0, help="print the N slowest imports of the start (python -X importtime)")
    args = ap.parse_args()
    if args.imports:
        print("IMPORTS " + json.dumps(slowest_imports(args.model, args.imports)), flush=True)
    phases: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = round(now - mark, 3)
        mark = now

    import torch

    lap("import_torch")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
    lap("cuda_context")
    from vlmctl.models.load import _model_plan, load_processor, quiet_transformers, transformers_class

    ref, _cfg, fam, dtype = _model_plan(args.model, "bf16" if device == "cuda" else "fp32", False, None)
    lap("config")
    cls = transformers_class(fam.model_class)
    lap("import_model_class")
    with quiet_transformers():
        model = cls.from_pretrained(ref, dtype=dtype)
    lap("weights_to_cpu")
    model = model.to(device).eval()
    if device == "cuda":
        torch.cuda.synchronize()
    lap("weights_to_device")
    if args.direct_load:
        with quiet_transformers():
            direct = cls.from_pretrained(ref, dtype=dtype, device_map=device)
        if device == "cuda":
            torch.cuda.synchronize()
        lap("weights_direct_to_device")
        del direct
        if device == "cuda":
            torch.cuda.empty_cache()
        mark = time.perf_counter()
    processor = load_processor(ref)
    lap("processor")
    from vlmctl.evaluation import load_samples
    from vlmctl.inference import request_from_sample
    from vlmctl.inference.prompt import render_request

    samples = load_samples(str(args.workdir / "shapes" / "shapes_vqa.json"), args.workdir, limit=args.samples)
    rendered = [render_request(request_from_sample(s), processor, fam) for s in samples]
    lap("samples_and_render")
    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.generation import context_limit
    from vlmctl.inference.sampling import SamplingParams

    runs = {}
    for name in args.variants.split(","):
        options = VARIANTS[name]
        t0 = time.perf_counter()
        engine = DecodeEngine(model, processor, family=fam, max_slots=args.batch_size, max_length=2048,
                              strict_context=False, max_context=context_limit(model), **options)
        made = time.perf_counter() - t0
        times, inputs = [], []
        for _ in range(2):
            fresh = [render_request(request_from_sample(s), processor, fam) for s in samples]
            t0 = time.perf_counter()
            engine.generate(fresh, SamplingParams(max_tokens=args.max_new_tokens))
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(round(time.perf_counter() - t0, 3))
            inputs.append(round(engine.inputs_seconds - sum(inputs), 3))
        runs[name] = {"engine_made": round(made, 3), "cold": times[0], "warm": times[1],
                      "inputs_s": inputs}
        print(name, runs[name], flush=True)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    print("PHASES " + json.dumps({"samples": len(samples), "batch_size": args.batch_size, "device": device,
                                  "start": phases, "start_total": round(sum(phases.values()), 3), "generate": runs}),
          flush=True)


START = """
import sys
import torch
from vlmctl.models.load import _model_plan, transformers_class
_ref, _cfg, fam, _dtype = _model_plan(sys.argv[1], "bf16" if torch.cuda.is_available() else "fp32", False, None)
transformers_class(fam.model_class)
"""


def slowest_imports(model: Path, n: int) -> list[dict]:
    """The `n` slowest imports of `START` in a child process under `python -X importtime` (its stderr lines:
    `import time: self [us] | cumulative | name`, nested names indented), slowest cumulative first."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", START, str(model)], capture_output=True, text=True,
                         check=True).stderr
    rows = []
    for line in out.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            rows.append({"module": parts[2].strip(), "cumulative_s": int(parts[1]) / 1e6, "own_s": int(parts[0]) / 1e6})
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:n]


if __name__ == "__main__":
    main()
