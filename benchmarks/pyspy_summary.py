"""Each thread's busiest functions in a py-spy raw profile (`py-spy record -t -f raw`): inclusive samples (a function
counted once per stack it is on) and their share of the thread's samples.

Usage:
    python benchmarks/pyspy_summary.py PROFILE [--top 40] [--threads 4]
"""

from __future__ import annotations

import argparse
import collections


def summarize(path: str) -> tuple[collections.Counter, dict[str, collections.Counter]]:
    """(samples per thread, inclusive samples per function per thread) of a py-spy raw file: one stack a line,
    frames joined by ';' (the thread's name first, with -t), then a space and the sample count."""
    threads: collections.Counter = collections.Counter()
    functions: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            thread, n = frames[0], int(count)
            threads[thread] += n
            for name in {f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0] + ")" for f in frames[1:]}:
                functions[thread][name] += n
    return threads, functions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    threads, functions = summarize(args.profile)
    for thread, total in threads.most_common(args.threads):
        print(f"{thread}: {total} samples")
        for name, n in functions[thread].most_common(args.top):
            print(f"  {n:7d} {100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
