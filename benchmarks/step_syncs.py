"""Where a training step makes the host wait for the GPU: `vlmctl bench` run in this process (one GPU) with torch's
CUDA sync debug mode on during the measured steps (`torch.cuda.set_sync_debug_mode("warn")`: every operation that
synchronizes the host with the device warns). Each call site is printed once with how often it synchronized per
measured step and the innermost frames of its Python stack.

    python benchmarks/step_syncs.py [VLMCTL BENCH ARGS ...]
    python benchmarks/step_syncs.py -c benchmarks/ab/fp8.yaml --steps 2 --warmup 3 model.preset=qwen2.5-vl-3b \\
        model.init=random train.stage=full train.compile=on train.tokens_per_batch=8192

A step that the host runs ahead of (the host queues the next forward while the device still runs the last update)
needs no synchronization between its update being queued and its next forward's launches; each site printed here
is a place where the host drains the device's queue instead. Needs a GPU (the sync debug mode is CUDA's).
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings


def main(argv: list[str]) -> None:
    import torch

    from vlmctl.cli.app import main as vlmctl_main
    from vlmctl.train import loop

    warmup = int(argv[argv.index("--warmup") + 1]) if "--warmup" in argv else 3
    sites: collections.Counter = collections.Counter()
    stacks: dict[tuple, list[str]] = {}
    measured = {"steps": 0, "seen": 0}
    step = loop.Trainer.train_step

    def train_step(self):
        measured["seen"] += 1
        if measured["seen"] <= warmup:
            return step(self)
        measured["steps"] += 1
        warnings.simplefilter("always")  # every occurrence, past the run's own filters
        if not torch.cuda.is_available():
            return step(self)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return step(self)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001 - warnings' signature
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        key = tuple((f.filename, f.lineno) for f in frames[-4:])
        sites[key] += 1
        stacks.setdefault(key, [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-8:]])

    loop.Trainer.train_step = train_step
    warnings.simplefilter("always")
    warnings.showwarning = record
    try:
        vlmctl_main(["bench", *argv])
    except SystemExit:
        pass
    steps = max(measured["steps"], 1)
    print(f"\n{sum(sites.values()) / steps:.1f} synchronizations per measured step ({measured['steps']} steps), "
          f"{len(sites)} call sites:")
    for key, count in sites.most_common():
        print(f"\n{count / steps:.1f} per step")
        for frame in stacks[key]:
            print(f"    {frame}")


if __name__ == "__main__":
    main(sys.argv[1:])
