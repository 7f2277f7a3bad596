"""Benchmark `vlmctl data prepare` at scale: ~200,000 small samples (short text, one tiny image each, the images
drawn from a handful of files), timed as a user runs it (the CLI in a fresh process), with its peak memory.

    python benchmarks/bench_prepare_200k.py                          # 200,000 samples, 8 images of 64x64 px
    python benchmarks/bench_prepare_200k.py --samples 50000 --num-proc 2 --workdir /tmp/bench_prepare_200k

The generated project is `vlmctl init --template tiny`'s model section (random-init preset: the tokenizer is
trained on the kept samples and every sample's tokens are counted) with one JSONL source in LLaVA format
(docs/formats.md). Each sample has its own question and answer (so deduplication keeps it) and names one of
`--images` PNG files, so the data is mostly records, not pixels: this measures the per-record cost of reading,
checking, counting, hashing and writing, and whether memory stays flat in the number of samples.

Figures: wall time of `vlmctl data prepare` (process start to exit), samples/s, CPU time per sample (user + system
of the CLI and its workers: wait4's rusage), peak RSS of the largest single process (wait4 `ru_maxrss`, KiB on
Linux) and peak RSS of the whole process tree (the sum of `/proc/<pid>/status` VmRSS over the CLI and its
descendants, sampled every 0.2 s: a lower bound). The 1-minute load average before and after is printed: on a
shared machine the wall time depends on it, CPU time much less. Results are printed as a Markdown table and
written to `<workdir>/results.json`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

PROJECT = """\
project:
  name: bench-prepare
data:
  sources:
    - path: raw/train.jsonl
      format: llava
  prepared_dir: prepared
  val_ratio: 0.01
  max_length: 512
model:
  preset: tiny
  vision_feature_layer: 1
  projector: linear
  init: random
  image_size: 32
  output_dir: outputs/model
"""
WORDS = ("red", "green", "blue", "square", "circle", "triangle", "left", "right", "top", "bottom", "small", "large")


def png(i: int, side: int) -> bytes:
    """A `side` x `side` PNG of a colour and a lighter square, different for each `i`."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (side, side), ((37 * i) % 256, (91 * i) % 256, (53 * i + 90) % 256))
    ImageDraw.Draw(im).rectangle((side // 4, side // 4, side // 2 + i % (side // 4), side // 2), fill=(240, 240, 240))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def generate(root: Path, samples: int, images: int, side: int) -> Path:
    """Write the project under `root`: vlmctl.yaml, raw/img_*.png and raw/train.jsonl; return the JSONL path.
    Kept when it already holds `samples` lines (generation is not part of the figures)."""
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (root / "vlmctl.yaml").write_text(PROJECT)
    for k in range(images):
        (raw / f"img_{k}.png").write_bytes(png(k, side))
    path = raw / "train.jsonl"
    stamp = raw / f".generated-{samples}-{images}"
    if path.is_file() and stamp.is_file():
        return path
    with open(path, "w") as f:
        for i in range(samples):
            a, b, c = WORDS[i % 12], WORDS[(i // 12) % 12], WORDS[(i // 144) % 12]
            f.write(json.dumps({
                "id": f"s{i:07d}", "image": f"img_{i % images}.png",
                "conversations": [{"from": "human", "value": f"<image>\nWhat is {a} {b} in picture {i}?"},
                                  {"from": "gpt", "value": f"The {c} one, number {i % 97}."}],
            }) + "\n")
    stamp.touch()
    return path


def tree_rss_kib(pid: int) -> int:
    """Sum of VmRSS (KiB) of `pid` and its descendants (from /proc; processes that end meanwhile count 0)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total


def run_prepare(root: Path, num_proc: int | None) -> dict:
    """Run `vlmctl data prepare` in `root` (a fresh process) and return its figures."""
    cmd = [sys.executable, "-m", "vlmctl", "data", "prepare"]
    if num_proc:
        cmd += ["--num-proc", str(num_proc)]
    load0 = os.getloadavg()[0]
    peak = [0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_rss_kib(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{output}")
    manifest = json.loads((root / "prepared" / "manifest.json").read_text())
    read = manifest["totals"]["read"]
    return {
        "samples": read,
        "kept": manifest["totals"]["kept"],
        "seconds": round(seconds, 1),
        "samples_per_s": round(read / seconds, 1),
        "cpu_ms_per_sample": round(1000 * (usage.ru_utime + usage.ru_stime) / read, 3),
        "peak_rss_largest_process_mib": round(usage.ru_maxrss / 1024, 1),
        "peak_rss_tree_mib": round(peak[0] / 1024, 1),
        "shards_mib": round(sum(s["bytes"] for s in manifest["splits"].values()) / 2**20, 1),
        "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


def git_commit() -> str:
    """The short commit of the checkout whose `vlmctl` the run imports (PYTHONPATH decides), or "unknown" with
    its folder when that is not a git checkout."""
    import importlib.util

    spec = importlib.util.find_spec("vlmctl")
    where = Path(spec.origin).parent if spec and spec.origin else Path(__file__).parent
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"unknown ({where})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--images", type=int, default=8, help="distinct image files the samples share")
    parser.add_argument("--image-side", type=int, default=64, help="pixels")
    parser.add_argument("--num-proc", type=int, default=None, help="workers (default: prepare's own)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/vlmctl_bench_prepare_200k"))
    args = parser.parse_args()

    commit = git_commit()  # before the run: the checkout may move while it runs
    t0 = time.perf_counter()
    generate(args.workdir, args.samples, args.images, args.image_side)
    print(f"generated {args.samples:,} samples ({args.images} images of {args.image_side}x{args.image_side} px) in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    fig = run_prepare(args.workdir, args.num_proc)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(f"\nMachine: {machine}; commit {commit}; num_proc={args.num_proc or 'default'}\n")
    print("| samples | kept | wall s | samples/s | CPU ms/sample | peak RSS largest process (MiB) | peak RSS all processes (MiB) | shards (MiB) | load avg before / after |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {fig['samples']:,} | {fig['kept']:,} | {fig['seconds']} | {fig['samples_per_s']:,} | {fig['cpu_ms_per_sample']} "
          f"| {fig['peak_rss_largest_process_mib']} | {fig['peak_rss_tree_mib']} | {fig['shards_mib']} "
          f"| {fig['load_average_1min'][0]} / {fig['load_average_1min'][1]} |")
    (args.workdir / "results.json").write_text(json.dumps({"machine": machine, "commit": commit, "num_proc": args.num_proc, **fig}, indent=2))


if __name__ == "__main__":
    main()
