"""Throughput of `vlmctl serve`: requests/s and output tokens/s at several client concurrencies.

Usage:
    python benchmarks/bench_serve.py --workdir /tmp/servebench [--model DIR | --preset P] [--concurrency 1,4,8] [--requests 32]
                                     [--max-tokens 32] [--device cpu] [--max-batch-size 8] [--rounds 1] [--client-processes auto]
                                     [--warmup 1] [--warmup-steady 0]
    python benchmarks/bench_serve.py --url http://127.0.0.1:PORT [--concurrency 1,4,8] ...   # a server already running

Builds the --preset (default tiny) with random weights under --workdir (unless --model is given), starts `vlmctl serve` on a free local
port in its own process (or, with --url, uses the server there: benchmarks/bench_serve_gpu.sh starts one), waits for
its /health (--start-timeout seconds; a server that exits first ends the benchmark), sends 2 warm-up requests, then
for each concurrency C runs --warmup untimed passes of C requests (so the batch shapes' CUDA graphs are captured
before the clock starts, as a server under steady load has them; --warmup-steady N adds up to N more while the
last pass still captured a graph or met a new picture layout, whose first uses run eagerly; the row's
`warmup_passes` says how many ran) and then --requests image questions
(a 64 px PNG as a data: URL, greedy, --max-tokens each) from C client threads with the official `openai` client,
each thread sending its next request when the previous is answered (--client-processes P spreads a concurrency's
threads over P processes started once; the default, auto, starts one per 8 threads, so the clients' own Python,
parsing every token's chunk, does not share one interpreter lock: with one process, the threads' work on a round's last chunks and next requests is done one after
another, which the server sees as a gap between answers); requests are streamed, so the time to the first
token's chunk is measured (the first content delta after the role chunk: vlmctl sends one per token, empty while
the token's text is held back, which a random-weight model's byte tokens nearly always are). Output tokens are the servers' `usage` counts. Prints a `SERVER {json}` line (the served
model's name, dtype, attention implementation and decoding mode from /health), then one `RESULT {json}` line per
concurrency and round: requests, seconds, requests/s, output tokens/s, mean latency, median time to first token, and
from the server's /health counters over the round: decode steps, rows per step, milliseconds per step (the worker's
busy time over its steps), the share of the round the worker was busy, the CUDA graphs captured during the round,
the vision towers' picture layouts met for the first time (`new_layouts`: each ran eagerly, tens of ms on a GPU),
and the prefills with their mean milliseconds (the runner's prefill and the first tokens' draw; the processor's share before it, `inputs_ms`, apart), and the worker's milliseconds per step in decoding (`decode_ms_per_step`: launching steps and taking their tokens), and per request the milliseconds from its arrival to its job in the engine's queue (`read_ms`: body, media, chat template, token count, processor workers; `body_ms`: of that, the wait for the whole body after its head: the client's pace, or the event loop's backlog) and from there to the start of its prefill (`queue_ms`), and the server's garbage collector over the round (`gc_ms`: its pauses' milliseconds; `gc_full`: its collections of the oldest generation, each a pause of every stream). With --rounds N the concurrencies are interleaved N times (1, 4, 8, 1, 4, 8, ...), so load from other
processes on a shared machine falls on all of them, and a `MEDIAN {json}` and a `BEST {json}` line (the fastest
round, the one least slowed by other processes) per concurrency follow. With --trace-at C (a server started with
`--profile-dir`), the timed rounds at concurrency C are recorded by the server's torch.profiler (POST /start_profile
before the round's clock starts, /stop_profile after it stops): the idle report follows each such round, then a
`TRACE {json}` line (the folder written, the GPU's busy and idle seconds, and of the idle ones those with no request
to run). The profiler slows the host, so a traced round's figures are not comparable with untraced ones.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

QUESTIONS = ["What color is the square?", "What shape is in the picture?", "How many shapes are there?", "Describe the picture."]


def picture(i: int) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (64, 64), (255, 255, 255))
    ImageDraw.Draw(img).rectangle([8 + i % 8, 8, 48, 48 - i % 8], fill=((37 * i) % 256, (91 * i) % 256, (53 * i) % 256))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _new_shapes(before: dict, after: dict, keep_zero: bool = False) -> dict[str, int]:
    """From two /health answers: the CUDA graphs captured between them (`graphs_captured`) and the vision towers'
    picture layouts met for the first time (`new_layouts`); without `keep_zero`, only those above 0."""
    shapes = {"graphs_captured": after.get("cuda_graphs", 0) - before.get("cuda_graphs", 0),
              "new_layouts": sum(v - before.get(k, 0) for k, v in after.items() if k.endswith("_encoder_new_layouts"))}
    return shapes if keep_zero else {k: v for k, v in shapes.items() if v > 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=None, help="where --preset is built (needed unless --model or --url)")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--preset", default="tiny", help="the preset built with random weights when --model is not given")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed passes of `concurrency` requests before each concurrency is timed (0: none), so the "
                         "CUDA graphs of its batch shapes are captured before the clock starts")
    ap.add_argument("--warmup-steady", type=int, default=0,
                    help="after --warmup, up to this many more untimed passes while the last one still captured a CUDA "
                         "graph or met a new picture layout (the round then measures the steady state; 0: none)")
    ap.add_argument("--url", default=None, help="benchmark a running server (http://HOST:PORT) instead of starting one")
    ap.add_argument("--client-processes", type=_processes, default="auto",
                    help="spread each concurrency's client threads over this many processes (1: all in this one; "
                         f"auto: one per {THREADS_PER_CLIENT_PROCESS} threads, so 32 clients run in 4 processes)")
    ap.add_argument("--trace-at", type=int, default=None,
                    help="record the timed round(s) at this concurrency with torch.profiler (a server started with --profile-dir)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the server's /health")
    args = ap.parse_args()

    from vlmctl.serve import free_port

    server = pool = None
    if args.url:  # a server started by the caller (benchmarks/bench_serve_gpu.sh)
        url = args.url.rstrip("/")
        wait_for_health(url, None, args.start_timeout)
    else:
        model = args.model if args.model is not None else preset_model(args.workdir, args.preset)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "vlmctl", "serve", str(model), "--device", args.device, "--port",
                                   str(port), "--max-batch-size", str(args.max_batch_size), "--model-name", "bench"],
                                  env=os.environ.copy())
        url = f"http://127.0.0.1:{port}"
    try:
        if server is not None:
            wait_for_health(url, server, args.start_timeout)
        served = health(url)
        print("SERVER " + json.dumps({k: served.get(k) for k in ("model", "dtype", "attn_implementation", "decode", "kernels", "slots")}),
              flush=True)
        one = Client(url, served["model"], args.max_tokens).one
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        procs_at = {c: client_processes(args.client_processes, c) for c in concurrencies}
        most = max(procs_at.values())
        if most > 1:  # each process its own interpreter lock: the clients' work does not queue on one
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            pool = ProcessPoolExecutor(most, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_start_client, initargs=(url, served["model"], args.max_tokens))
            list(pool.map(_warm, range(most)))

        def run(concurrency: int, indices: list[int]) -> list[tuple[int, float, float]]:
            """(output tokens, latency s, time to first token s) of each request of `indices`, sent by `concurrency`
            client threads (spread over the client processes when there are several)."""
            procs = procs_at[concurrency]
            if procs == 1:
                with ThreadPoolExecutor(concurrency) as threads:
                    return list(threads.map(one, indices))
            shares = [pool.submit(_run_share, indices[k::procs], len(range(k, concurrency, procs))) for k in range(procs)]
            return [r for share in shares for r in share.result()]

        for i in range(2):
            one(i)
        rows: dict[int, list[dict]] = {}
        for _ in range(args.rounds):
            for concurrency in concurrencies:
                for _ in range(args.warmup):
                    run(concurrency, list(range(concurrency)))
                passes = args.warmup
                for _ in range(args.warmup_steady):
                    before = health(url)
                    run(concurrency, list(range(concurrency)))
                    passes += 1
                    if not _new_shapes(before, health(url)):
                        break
                traced = concurrency == args.trace_at
                if traced:
                    post(url, "/start_profile")
                before = health(url)
                t0 = time.perf_counter()
                results = run(concurrency, list(range(args.requests)))
                seconds = time.perf_counter() - t0
                if traced:  # after the round's clock: writing the trace is not counted
                    profile = post(url, "/stop_profile")
                    print(profile.pop("summary", ""), flush=True)
                    print("TRACE " + json.dumps({"concurrency": concurrency, **profile}), flush=True)
                tokens = sum(r[0] for r in results)
                row = {"concurrency": concurrency, "requests": args.requests, "seconds": round(seconds, 2),
                       "requests_per_s": round(args.requests / seconds, 2), "output_tokens": tokens,
                       "output_tokens_per_s": round(tokens / seconds, 1),
                       "mean_latency_s": round(sum(r[1] for r in results) / len(results), 3),
                       "ttft_ms_median": round(1000 * statistics.median(r[2] for r in results), 1), "device": args.device,
                       "max_batch_size": args.max_batch_size, "client_processes": procs_at[concurrency],
                       "warmup_passes": passes}
                after = health(url)
                # the engine's decode steps over the round: rows per step is the batching achieved, and the busy share
                # how much of the round the worker spent stepping the engine (prefill, decoding, sending tokens)
                steps = max(after["batches"] - before["batches"], 1)
                row.update(decode_steps=after["batches"] - before["batches"],
                           rows_per_step=round((after.get("rows", 0) - before.get("rows", 0)) / steps, 2),
                           ms_per_step=round(1000 * (after.get("busy_seconds", 0) - before.get("busy_seconds", 0)) / steps, 3),
                           busy_share=round((after.get("busy_seconds", 0) - before.get("busy_seconds", 0)) / seconds, 3),
                           **_new_shapes(before, after, keep_zero=True),
                           prefills=after.get("prefills", 0) - before.get("prefills", 0),
                           prefill_ms=round(1000 * (after.get("prefill_seconds", 0) - before.get("prefill_seconds", 0))
                                            / max(after.get("prefills", 0) - before.get("prefills", 0), 1), 2),
                           inputs_ms=round(1000 * (after.get("inputs_seconds", 0) - before.get("inputs_seconds", 0))
                                           / max(after.get("prefills", 0) - before.get("prefills", 0), 1), 2),
                           decode_ms_per_step=round(1000 * (after.get("decode_seconds", 0) - before.get("decode_seconds", 0))
                                                    / steps, 3),
                           read_ms=per_request(before, after, "read_seconds", "requests_read"),
                           body_ms=per_request(before, after, "body_seconds", "requests_read"),
                           queue_ms=per_request(before, after, "queue_seconds", "admitted_requests"),
                           **gc_pauses(before, after), decode=after.get("decode"))
                rows.setdefault(concurrency, []).append(row)
                print("RESULT " + json.dumps(row), flush=True)
        if args.rounds > 1:
            for concurrency, runs in rows.items():
                median = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
                print("MEDIAN " + json.dumps({"concurrency": concurrency, "rounds": len(runs),
                                              "requests_per_s": median("requests_per_s"),
                                              "output_tokens_per_s": median("output_tokens_per_s"),
                                              "mean_latency_s": median("mean_latency_s"),
                                              "ttft_ms_median": median("ttft_ms_median")}), flush=True)
                best = max(runs, key=lambda r: r["requests_per_s"])  # the round least slowed by other processes
                print("BEST " + json.dumps({"concurrency": concurrency, "rounds": len(runs), **{k: best[k] for k in (
                    "requests_per_s", "output_tokens_per_s", "mean_latency_s")}}), flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()


class Client:
    """One openai client of the server at `url`; `one(i)` sends request i (picture i, question i)."""

    def __init__(self, url: str, model: str, max_tokens: int):
        import openai

        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600)
        self.model, self.max_tokens = model, max_tokens

    def one(self, i: int) -> tuple[int, float, float]:
        """(output tokens, latency s, time to first token s) of one streamed request."""
        t0 = time.perf_counter()
        first, tokens = None, 0
        stream = self.client.chat.completions.create(
            model=self.model, max_tokens=self.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture(i)}},
                                             {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]}])
        for chunk in stream:
            # the first token's chunk: a content delta after the role chunk (empty while its text is held back)
            delta = chunk.choices[0].delta if chunk.choices else None
            if first is None and delta is not None and delta.role is None and delta.content is not None:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        latency = time.perf_counter() - t0
        return tokens, latency, first if first is not None else latency


_CLIENT: Client | None = None  # a client process's own (`--client-processes`)


THREADS_PER_CLIENT_PROCESS = 8  # openai client threads one process runs before its interpreter lock holds them up


def _processes(text: str) -> int | str:
    """`--client-processes`: a positive count or `auto`."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of processes or auto, got {text!r}")
    return int(text)


def client_processes(asked: int | str, concurrency: int) -> int:
    """The client processes that run `concurrency` client threads: `asked` (at most one per thread), or with `auto`
    one per `THREADS_PER_CLIENT_PROCESS` threads. On one H200 (docs/benchmarks.md), 32 openai client threads in one
    process left 15-98 ms of a 350-413 ms request cycle between a thread's answer and its next request, and the
    server's batch at 15-20 of 32 rows; in 4 processes the gap was 5-7 ms and the batch 24-26 rows. 8 threads in one
    process lost 2 ms a cycle."""
    if asked == "auto":
        return max(1, -(-concurrency // THREADS_PER_CLIENT_PROCESS))
    return max(1, min(int(asked), concurrency))


def _start_client(url: str, model: str, max_tokens: int) -> None:
    global _CLIENT
    _CLIENT = Client(url, model, max_tokens)


def _warm(_: int) -> None:
    _CLIENT.one(0)


def _run_share(indices: list[int], threads: int) -> list[tuple[int, float, float]]:
    """In a client process: requests `indices` from `threads` threads, each sending its next when answered."""
    with ThreadPoolExecutor(max(threads, 1)) as pool:
        return list(pool.map(_CLIENT.one, indices))


def preset_model(workdir: Path, preset: str) -> Path:
    """The `preset` built with random weights under `workdir/preset` (once: an existing build is reused); tiny in fp32
    for the CPU, larger presets in bf16. Its tokenizer is trained on the benchmark's questions."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    model = workdir / preset
    if not (model / "config.json").is_file():
        build_model(ModelSection(preset=preset, init="random", output_dir=model, dtype="fp32" if preset == "tiny" else "bf16"),
                    tokenizer_texts=QUESTIONS * 5 + ["red green blue square circle one two three"] * 5)
    return model


def wait_for_health(url: str, server: subprocess.Popen | None, timeout: float) -> None:
    """Return once `GET url/health` answers; raise SystemExit when `server` (the process serving it, if started
    here) exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode} before answering {url}/health")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server at {url} did not answer /health within {timeout:.0f} s")


def gc_pauses(before: dict, after: dict) -> dict:
    """The garbage collector's pauses in the server over a round, from /health's `gc` (`vlmctl.serve.heap`):
    `gc_ms` (every collection's milliseconds) and `gc_full` (collections of the oldest generation); {} from a server
    without them."""
    a, b = after.get("gc"), before.get("gc")
    if not a or not b:
        return {}
    return {"gc_ms": round(1000 * (sum(a["seconds"]) - sum(b["seconds"])), 1), "gc_full": a["collections"][2] - b["collections"][2]}


def per_request(before: dict, after: dict, seconds: str, count: str) -> float | None:
    """Milliseconds of /health's counter `seconds` per `count` over a round (None from a server without them)."""
    if seconds not in after or count not in after:
        return None
    return round(1000 * (after[seconds] - before.get(seconds, 0)) / max(after[count] - before.get(count, 0), 1), 2)


def post(url: str, path: str) -> dict:
    """The JSON answer of `POST url/path` (the server's profile routes); SystemExit with the server's message for an
    error status."""
    request = urllib.request.Request(f"{url}{path}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"POST {path}: {exc.code} {exc.read().decode(errors='replace')}") from None


def health(url: str) -> dict:
    """The server's `GET /health` ({status, model, dtype, attn_implementation, queued, running, batches: decode steps so
    far, rows: rows decoded over them, busy_seconds: the worker's time stepping the engine, decode: its mode, ...})."""
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
        return json.loads(response.read())


if __name__ == "__main__":
    main()
