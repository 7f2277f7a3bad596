"""Benchmark `data prepare`: throughput (samples/s) and peak memory (RSS) on generated one-image samples.

    python benchmarks/bench_prepare.py                       # 10,000 and 1,000 samples, 640x480 JPEGs
    python benchmarks/bench_prepare.py --sizes 10000 --num-proc 2 --workdir /tmp/bench_prepare

Each size runs in a fresh Python process so its peak RSS is its own. Peak RSS is reported for the main process
and for the largest worker (`getrusage` RUSAGE_SELF / RUSAGE_CHILDREN `ru_maxrss`, KiB on Linux). Samples/s is
samples read / wall time of `prepare_data` (reading, full decoding, hashing, writing shards and manifest).
The flat-memory claim holds when peak RSS at 10x the samples is about the same. Results are printed as a
Markdown table and written to `<workdir>/results.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

WIDTH, HEIGHT = 640, 480


def _make_image(i: int, path: Path) -> None:
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(i)
    # Gradient + shapes + mild noise: JPEG sizes like photos (~60 KB at quality 90), unique per sample.
    x = np.linspace(0, 1, WIDTH, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 1, HEIGHT, dtype=np.float32)[:, None, None]
    c0, c1 = rng.uniform(0, 230, 3).astype(np.float32), rng.uniform(0, 230, 3).astype(np.float32)
    arr = (c0 * (1 - x) + c1 * y).astype(np.uint8) + rng.integers(0, 16, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    im = Image.fromarray(arr, "RGB")
    draw = ImageDraw.Draw(im)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, WIDTH - 60)), int(rng.integers(0, HEIGHT - 60))
        s = int(rng.integers(20, 120))
        draw.ellipse((x0, y0, x0 + s, y0 + s), fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    im.save(path, "JPEG", quality=90)


def _make_chunk(args: tuple[int, int, str]) -> None:
    start, stop, folder = args
    for i in range(start, stop):
        p = Path(folder) / f"{i:06d}.jpg"
        if not p.exists():
            _make_image(i, p)


def generate(root: Path, n: int) -> Path:
    """Write n one-image LLaVA samples under root (images reused between runs); return the JSON path."""
    from concurrent.futures import ProcessPoolExecutor

    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    step = 250
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(_make_chunk, [(s, min(n, s + step), str(images)) for s in range(0, n, step)]))
    records = [
        {"id": f"s{i:06d}", "image": f"images/{i:06d}.jpg",
         "conversations": [{"from": "human", "value": f"<image>\nDescribe picture {i}."}, {"from": "gpt", "value": f"Picture {i} shows a gradient with circles."}]}
        for i in range(n)
    ]
    path = root / f"train_{n}.json"
    path.write_text(json.dumps(records))
    return path


def run_one(json_path: Path, out: Path, num_proc: int | None) -> dict:
    """Prepare one generated set in this process and return its figures."""
    from vlmctl.config.data import DataSection, DataSource
    from vlmctl.data.prepare import prepare_data

    data = DataSection(sources=[DataSource(path=str(json_path), format="llava")], prepared_dir=out, val_ratio=0.01)
    t0 = time.perf_counter()
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    result = prepare_data(data, num_proc=num_proc, progress=False)
    seconds = time.perf_counter() - t0
    self1, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    read = result.manifest["totals"]["read"]
    main_cpu = (self1.ru_utime - self0.ru_utime) + (self1.ru_stime - self0.ru_stime)
    worker_cpu = kids.ru_utime + kids.ru_stime
    return {
        # CPU time per sample does not depend on other load on the machine (wall time does).
        "cpu_ms_per_sample_main": round(1000 * main_cpu / read, 3),
        "cpu_ms_per_sample_workers": round(1000 * worker_cpu / read, 3),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "samples": read,
        "kept": result.kept,
        "seconds": round(seconds, 2),
        "samples_per_s": round(read / seconds, 1),
        "peak_rss_main_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_rss_worker_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "shard_mib": round(sum(s["bytes"] for s in result.manifest["splits"].values()) / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000])
    parser.add_argument("--num-proc", type=int, default=None, help="workers (default: all cores)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/vlmctl_bench_prepare"))
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: run one size
    args = parser.parse_args()

    if args.one is not None:
        fig = run_one(args.workdir / f"train_{args.one}.json", args.workdir / f"prepared_{args.one}", args.num_proc)
        print(json.dumps(fig))
        return

    t0 = time.perf_counter()
    json_paths = {n: generate(args.workdir, n) for n in sorted(args.sizes)}
    print(f"generated {max(args.sizes):,} images {WIDTH}x{HEIGHT} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    for n in args.sizes:
        cmd = [sys.executable, __file__, "--one", str(n), "--workdir", str(args.workdir)]
        if args.num_proc:
            cmd += ["--num-proc", str(args.num_proc)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(f"\nMachine: {machine}; num_proc={args.num_proc or os.cpu_count()}\n")
    print("| samples | wall s | samples/s | peak RSS main (MiB) | peak RSS worker (MiB) | CPU ms/sample main + workers | shards (MiB) | load avg |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['samples']:,} | {r['seconds']} | {r['samples_per_s']:,} | {r['peak_rss_main_mib']} | {r['peak_rss_worker_mib']} "
            f"| {r['cpu_ms_per_sample_main']} + {r['cpu_ms_per_sample_workers']} | {r['shard_mib']} | {r['load_average_1min']} |"
        )
    (args.workdir / "results.json").write_text(json.dumps({"machine": machine, "num_proc": args.num_proc or os.cpu_count(), "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
