"""How long a served request's trip through threads and a processor worker takes while another thread runs Python.

Usage:
    python benchmarks/gil_round_trip.py [--trips 200] [--shares 0,0.5,0.9,1.0] [--slice-ms 10]

`vlmctl serve` reads a request on the event loop, builds its job in `asyncio.to_thread`, and has a worker process run
the processor (`serve.prepare.PromptPreparer`, through a `ProcessPoolExecutor`, whose manager and feeder threads
carry the call and its result). Every one of those threads needs the interpreter lock, which the decoding thread
holds while it runs Python (admission's prefill and first tokens, taking tokens) and releases while torch waits on the
device. This times the same trip with an empty task (`asyncio.to_thread` of a pool submit and its result) while a
thread runs Python for `share` of each `--slice-ms` slice and sleeps the rest. Prints one `RESULT {json}` line per
share: the trip's median and largest milliseconds. Python's thread switch interval (5 ms by default,
`sys.getswitchinterval`) bounds how long a waiting thread waits for a lock held without a pause.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor


def _echo(x: int) -> int:
    return x


def _python(stop: threading.Event, share: float, slice_s: float) -> None:
    """Run Python for `share` of each slice, sleep the rest (a wait on the device, which releases the lock)."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < slice_s * share:
            pass
        if share < 1:
            time.sleep(slice_s * (1 - share))


async def _trips(pool: ProcessPoolExecutor, n: int) -> list[float]:
    out = []
    for i in range(n):
        start = time.perf_counter()
        await asyncio.to_thread(lambda i=i: pool.submit(_echo, i).result())
        out.append(1e3 * (time.perf_counter() - start))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trips", type=int, default=200)
    ap.add_argument("--shares", default="0,0.5,0.9,1.0", help="the Python thread's busy shares, comma-separated")
    ap.add_argument("--slice-ms", type=float, default=10.0)
    args = ap.parse_args()
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(_echo, range(4)))  # the workers started before timing
    try:
        for share in (float(s) for s in args.shares.split(",")):
            stop = threading.Event()
            thread = threading.Thread(target=_python, args=(stop, share, args.slice_ms / 1e3), daemon=True)
            if share > 0:
                thread.start()
            try:
                trips = asyncio.run(_trips(pool, args.trips))
            finally:
                stop.set()
                if share > 0:
                    thread.join()
            print("RESULT " + json.dumps({"python_share": share, "slice_ms": args.slice_ms, "trips": len(trips),
                                          "median_ms": round(statistics.median(trips), 3), "max_ms": round(max(trips), 3),
                                          "switch_interval_ms": sys.getswitchinterval() * 1e3}), flush=True)
    finally:
        pool.shutdown()


if __name__ == "__main__":
    main()
