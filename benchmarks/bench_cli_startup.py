"""Start-up time of the CLI: whole-process wall and CPU seconds of `vlmctl --help` (and other quick command lines).

Usage:
    python benchmarks/bench_cli_startup.py [--runs 10] [--args "--help" --args "train --help"] [--python PYTHON]

Each command line runs `--runs` times after one warm-up run (the page cache holds the modules then), as a fresh
`python -m vlmctl ...` process run in this checkout (its `vlmctl` is the one imported). Prints the 1-minute load average before and
after (the machine may be shared: wall time then carries the wait for a core, CPU seconds do not), then one line per
command line (median, min and max wall seconds, median CPU seconds: user + system of the child), and a
`RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _time_once(python: str, args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one `python -m vlmctl ARGS` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # cwd: `python -m` puts the current folder first on sys.path, so this checkout is the one imported
    subprocess.run([python, "-m", "vlmctl", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--args", action="append", default=None, help='a command line after `vlmctl`, e.g. "train --help"')
    ap.add_argument("--python", default=sys.executable)
    opts = ap.parse_args()
    lines = opts.args or ["--help", "train --help", "data validate --help"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    load_before = os.getloadavg()[0]
    results = []
    for line in lines:
        args = line.split()
        _time_once(opts.python, args, env)  # warm-up
        samples = [_time_once(opts.python, args, env) for _ in range(opts.runs)]
        walls, cpus = [w for w, _ in samples], [c for _, c in samples]
        row = {"command": f"vlmctl {line}", "runs": opts.runs, "wall_median_s": round(statistics.median(walls), 3),
               "wall_min_s": round(min(walls), 3), "wall_max_s": round(max(walls), 3),
               "cpu_median_s": round(statistics.median(cpus), 3)}
        results.append(row)
        print(f"{row['command']:<32} wall median {row['wall_median_s']:.3f} s (min {row['wall_min_s']:.3f}, "
              f"max {row['wall_max_s']:.3f}), CPU {row['cpu_median_s']:.3f} s")
    load_after = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after; {os.cpu_count()} cores")
    print("RESULT " + json.dumps({"results": results, "load_before": load_before, "load_after": load_after,
                                  "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
