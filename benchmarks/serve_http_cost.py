"""What `vlmctl serve`'s HTTP side costs per streamed token, apart from any model: the real app (`serve.app`, its
request path, relay and server-sent events) in front of a stand-in engine that answers every job with `--tokens`
deltas, one per step of `--step-ms` for all running jobs at once (as the decoding engine's steps do), under
`--clients` streaming clients (threads of one other process: plain `http.client` ones, lighter than the openai
client, or with `--client openai` the official client, as `bench_serve.py` drives a server).

    python benchmarks/serve_http_cost.py --model MODEL_DIR [--loop asyncio|uvloop] [--http h11|httptools] \
        [--image-px 64] [--processor-workers N]

MODEL_DIR: a model folder with a processor (the app renders and counts each prompt with it, in the model family's
chat template). `--image-px`: each request carries one PNG picture of that size; `--processor-workers`: the server's
processor workers (`serve.prepare`) process each prompt, as on a GPU. Prints one
`RESULT {json}` line: tokens/s, requests, the server process's CPU seconds per 1,000 streamed tokens (user + system,
`os.times`), and the mean time from a request's arrival to the engine's queue (`read_ms`) and, of that, to its whole
body (`body_ms`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLIENT = r"""
import http.client, json, sys, threading, time
port, clients, seconds, px, kind = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
content = [{"type": "text", "text": "Say something."}]
if px:
    import base64, io
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (px, px), (200, 30, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content.insert(0, {"type": "image_url", "image_url": {"url": url}})
body = json.dumps({"model": "bench", "stream": True, "max_tokens": 64, "messages": [{"role": "user", "content": content}]})
done, stop = [0, 0], time.monotonic() + seconds
lock = threading.Lock()
def client():
    if kind == "openai":  # the official client, as bench_serve.py drives the server: each chunk parsed into a model
        import openai
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        request = json.loads(body)
        while time.monotonic() < stop:
            chunks = sum(1 for _ in c.chat.completions.create(**request))
            with lock:
                done[0] += 1; done[1] += chunks
        return
    conn = http.client.HTTPConnection("127.0.0.1", port)
    while time.monotonic() < stop:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        chunks = 0
        for line in resp:
            if line.startswith(b"data: "):
                chunks += 1
        with lock:
            done[0] += 1; done[1] += chunks
threads = [threading.Thread(target=client) for _ in range(clients)]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps({"requests": done[0], "chunks": done[1]}))
"""


class StandInEngine:
    """`serve.engine.Engine`'s interface without a model: every job gets `tokens` deltas of one word, one per step."""

    where = "stand-in"
    profiling = False

    def __init__(self, processor, family, tokens: int, step_ms: float, slots: int = 32):
        self.processor, self.tokens, self.step = processor, tokens, step_ms / 1000
        self.family, self.video, self.max_length, self.max_batch_size = family, None, 4096, slots
        self.arriving, self.queue, self.running, self.generated = 0, [], {}, 0
        self.lock = threading.Lock()
        threading.Thread(target=self._loop, daemon=True).start()

    def render(self, request):
        from vlmctl.inference.prompt import render_request

        return render_request(request, self.processor, self.family)

    def announce(self):
        self.arriving += 1

    def withdraw(self):
        self.arriving -= 1

    def submit(self, job, announced=False):
        with self.lock:
            self.queue.append(job)
        return True

    def health(self):
        return {"engine": self.where, "tokens_generated": self.generated}

    def summary(self):
        return "stand-in"

    def close(self, timeout=None):
        pass

    def _loop(self):
        while True:
            time.sleep(self.step)
            with self.lock:
                while self.queue and len(self.running) < self.max_batch_size:
                    job = self.queue.pop(0)
                    self.running[id(job)] = [job, 0]
            for key, entry in list(self.running.items()):
                job, n = entry
                if job.cancelled.is_set():
                    del self.running[key]
                    job.sink(("error", 499, "left", "client_closed"))
                    continue
                job.sink(("delta", 0, " word"))
                entry[1] = n = n + 1
                self.generated += 1
                if n >= min(self.tokens, job.max_tokens):
                    del self.running[key]
                    job.sink(("done", 0, "length", n))
                    job.sink(("end", 12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"])
    ap.add_argument("--http", default="h11", choices=["h11", "httptools"])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=6.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--image-px", type=int, default=0)
    ap.add_argument("--processor-workers", type=int, default=0)
    ap.add_argument("--client", default="http.client", choices=["http.client", "openai"])
    args = ap.parse_args()

    import uvicorn

    from vlmctl.models import load_processor
    from vlmctl.serve.app import ServerState, create_app
    from vlmctl.serve.server import bind_socket, head_timeout_protocol

    processor = load_processor(str(args.model))
    preparer = None
    if args.processor_workers:
        from vlmctl.serve.prepare import PromptPreparer

        preparer = PromptPreparer(args.model, args.processor_workers)
    from vlmctl.inference import folder_family

    engine = StandInEngine(processor, folder_family(args.model), args.tokens, args.step_ms)
    state = ServerState(engine=engine, model_name="bench", preparer=preparer)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    if args.http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    http = head_timeout_protocol(30.0, base)  # the server's own protocol class, on the parser asked for
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off", loop=args.loop, http=http)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    before, generated = os.times(), state.engine.generated
    read0, body0, n0 = state.read_seconds, state.body_seconds, state.requests_read
    out = subprocess.run([sys.executable, "-c", CLIENT, str(port), str(args.clients), str(args.seconds), str(args.image_px), args.client],
                         capture_output=True, text=True, check=True)
    after = os.times()
    client = json.loads(out.stdout)
    tokens = state.engine.generated - generated
    cpu = (after.user - before.user) + (after.system - before.system)
    wall = after.elapsed - before.elapsed
    server.should_exit = True
    thread.join(10)
    if preparer is not None:
        preparer.close()
    print("RESULT " + json.dumps({
        "loop": args.loop, "http": args.http, "clients": args.clients, "image_px": args.image_px,
        "processor_workers": args.processor_workers, "tokens_per_s": round(tokens / wall, 1),
        "requests": client["requests"], "server_cpu_s_per_1000_tokens": round(1000 * cpu / max(tokens, 1), 4),
        "server_cpu_share": round(cpu / wall, 3),
        "read_ms": round(1000 * (state.read_seconds - read0) / max(state.requests_read - n0, 1), 2),
        "body_ms": round(1000 * (state.body_seconds - body0) / max(state.requests_read - n0, 1), 2), "client": args.client}))


if __name__ == "__main__":
    main()
