"""The HTTP side of `vlmctl serve`: an ASGI app (Starlette) over an `Engine`.

Routes: `POST /v1/chat/completions` (JSON, or server-sent events with `"stream": true`), `GET /v1/models`,
`GET /health` (never behind the API key: load balancers probe it), `GET /` (the chat page). With an API key every
`/v1/` route needs `Authorization: Bearer KEY` (401 otherwise; the key's UTF-8 bytes compared in constant time).
Bodies over `max_body_bytes` get 413 before they are read whole, bodies that take longer than `body_seconds` to
arrive 408. Every error is OpenAI's error object (`OpenAIError`) with a 4xx status for the client's mistakes and 5xx
for the server's; no request's error stops the server.

Web pages (`guard`): a browser lets any page the user opens send requests to 127.0.0.1, and a page of a domain
whose DNS name later resolves to 127.0.0.1 (DNS rebinding) even read the answers. So a server without an API key
answers only requests whose `Host` is a loopback name (`localhost`, `*.localhost`, 127.0.0.0/8, `[::1]`), and every
server refuses (403) a request that a page of another origin sent (`Origin` not the server's own and not listed in
`allowed_origins`), before anything of it is read. A listed origin gets CORS headers and its preflights
(`OPTIONS`) are answered (Starlette's `CORSMiddleware`); any other preflight is a 403 without them.

Each request is logged through `ServerState.log` (one line: method, path, status, prompt + completion tokens,
seconds).

Events reach the event loop through one `Relay` per loop: the engine's worker thread only appends them, and the loop
is woken once per batch of events rather than once per token of every client (each wake-up is a write to the loop's
self-pipe and a handover of the interpreter's lock). A streamed choice sends one chunk per token while its client
keeps up; when several of its tokens are already waiting, they go out as one chunk (their text joined), as vLLM's
server does with its stream interval.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from vlmctl.serve.engine import Engine, Job
from vlmctl.serve.protocol import ChatCompletionRequest, OpenAIError, parse_request, text_chars, to_generation_request

# starlette is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules are imported next to their use as well.

PAGE = Path(__file__).with_name("page.html")


class Relay:
    """Events from the engine's worker thread to `asyncio.Queue`s of one event `loop`, in order: `sink(queue)` is a
    job's sink; it appends, and schedules a drain on the loop only when none is pending (module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque = deque()  # (queue, event); deque appends and pops are atomic
        self._lock = threading.Lock()
        self._scheduled = False
        self.wakeups = 0  # drains scheduled (each one wake-up of the loop)

    def sink(self, queue: asyncio.Queue) -> Callable[[tuple], None]:
        def put(event: tuple) -> None:
            self.items.append((queue, event))
            with self._lock:
                if self._scheduled:
                    return
                self._scheduled = True
                self.wakeups += 1
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: the server has stopped, nobody reads the events
                pass

        return put

    def _drain(self) -> None:
        with self._lock:  # cleared first: an event appended from here on schedules a drain of its own
            self._scheduled = False
        while self.items:
            queue, event = self.items.popleft()
            queue.put_nowait(event)


@dataclass
class Limits:
    """What one request may ask for. `max_body_bytes`: request body; `max_image_pixels`: width x height per image
    (`data.max_image_pixels`); `max_tokens`: the most tokens per choice (`data.max_length` by default) and
    `default_max_tokens` when the request gives none; `max_n`: choices per request; `media_roots`: folders local
    image paths may lie in (none: data: URLs only); `max_media`: images, audio clips and videos per request;
    `max_total_pixels`: the pixels of a request's images together; `body_seconds`: the longest a request body
    may take to arrive (a stalled or slow upload is answered 408 then). `n` is also bounded by the engine's rows
    per batch, and the prompt by the engine's context (`Engine.max_length`), both before it is tokenized."""

    max_body_bytes: int = 32 << 20
    max_image_pixels: int = 64_000_000
    max_tokens: int = 4096
    default_max_tokens: int = 256
    max_n: int = 8
    media_roots: tuple[Path, ...] = ()
    temperature: float = 0.0  # when a request gives none (0: greedy, as `vlmctl chat`)
    max_media: int = 16
    max_total_pixels: int = 128_000_000
    body_seconds: float = 60.0


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy decoding (as vLLM's `_SAMPLING_EPS`): dividing logits by a smaller one
overflows to inf, which sampling cannot draw from."""

CHARS_PER_TOKEN_MARGIN = 4
"""A text of more characters than the context x the longest token (in characters) x this margin (normalizers can
shorten a text) cannot fit, and is refused before it is tokenized."""


@dataclass
class ServerState:
    """What the app serves and how: the engine, the model's name, limits, the API key, whether only loopback `Host`
    names are answered (`loopback_only`: a server on loopback without a key), the web origins allowed to call it
    (`allowed_origins`, `"*"` any), where each request's log line goes (`log`; None: nowhere), and the processor
    workers that process each request's prompt while it is read (`preparer`; None: the engine does, at admission) and
    why there are that many (`processor`, e.g. "4 worker processes (a CUDA device and 16 CPU cores)"), and the
    garbage collector's pauses in this process (`gc`, `serve.heap.GCPauses`; None: not counted)."""

    engine: Engine
    model_name: str
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    choice: dict = field(default_factory=dict)  # the model's compute dtype and attention implementation (`model_choice`)
    loopback_only: bool = False
    allowed_origins: tuple[str, ...] = ()
    log: Callable[[str], None] | None = None
    preparer: Any = None  # the processor workers (`serve.prepare.PromptPreparer`), or None
    processor: str = ""  # where the processor runs and why (`/health`'s `processor`)
    requests_read: int = 0  # requests that became jobs in the engine's queue
    read_seconds: float = 0.0  # their times from arrival to the queue (body, media, chat template, token count, processor)
    body_seconds: float = 0.0  # of that, from arrival (the head read) to the whole body: the client's pace or the loop's backlog
    gc: Any = None  # the collector's pauses (`serve.heap.GCPauses`), /health's `gc`
    _longest_token: int | None = field(default=None, init=False, repr=False)

    def longest_token(self) -> int:
        """Characters of the tokenizer's longest vocabulary entry (byte-level BPE: bytes), computed once."""
        if self._longest_token is None:
            vocab = self.engine.processor.tokenizer.get_vocab()
            self._longest_token = max((len(t) for t in vocab), default=1) or 1
        return self._longest_token


PAGE_HEADERS = {
    # the page runs its own inline script and shows data: images; nothing else loads, no site may frame it
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def key_matches(headers: list[tuple[bytes, bytes]], key: str) -> bool:
    """Whether the raw request `headers` carry `Authorization: Bearer KEY` (the scheme in any case) with `key`'s
    UTF-8 bytes. Compared in constant time, as SHA-256 digests: neither the key's characters nor its length show in
    the time taken."""
    given = next((value for name, value in headers if name.lower() == b"authorization"), b"")
    scheme, _, token = given.partition(b" ")
    expected = hashlib.sha256(key.encode("utf-8")).digest()
    ok = hmac.compare_digest(hashlib.sha256(token.strip(b" ")).digest(), expected)
    return ok and scheme.lower() == b"bearer"


def is_loopback_name(host: str | None) -> bool:
    """Whether a `Host` header's name (the port left out) names this machine's loopback: `localhost`, a name under
    `.localhost` (RFC 6761: resolved to loopback by browsers), an address in 127.0.0.0/8 or ::1."""
    if not host:
        return False
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:  # a malformed port or bracket
        return False
    if not name:
        return False
    name = name.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def guard(app, state: ServerState):
    """The ASGI app `app` behind the web-page checks of the module docstring (`Host`, `Origin`, preflights)."""
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse

    if state.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(app, allow_origins=list(state.allowed_origins), allow_methods=["GET", "POST"],
                             allow_headers=["*"], max_age=600)
    allowed = set(state.allowed_origins)

    async def guarded(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        refusal = None
        if state.loopback_only and host is not None and not is_loopback_name(host):
            refusal = OpenAIError(403, f"Host {host!r} is not a loopback name: this server has no API key and answers only "
                                  "requests to localhost or 127.0.0.1 (a web page reaching it under another name is DNS "
                                  "rebinding); start it with --api-key to serve other names", type="permission_error",
                                  code="forbidden_host")
        elif origin is not None and origin not in allowed and "*" not in allowed and origin != f"{scope.get('scheme', 'http')}://{host}":
            refusal = OpenAIError(403, f"requests from web pages of {origin!r} are refused: start the server with --allow-origin "
                                  f"{origin} to let that page call it", type="permission_error", code="forbidden_origin")
        if refusal is not None:
            return await JSONResponse(refusal.body(), status_code=refusal.status)(scope, receive, send)
        return await app(scope, receive, send)

    return guarded


def logged(app, state: ServerState):
    """The ASGI app `app`, each HTTP request logged as one line through `state.log`: method, path, status, prompt +
    completion tokens (`scope["vlmctl.usage"]`, set by the completions route) and seconds, once its response ended
    (a stream: its last event, or the client leaving: status 499 when no response started)."""
    if state.log is None:
        return app

    async def with_log(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        start, status = time.perf_counter(), [499]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await app(scope, receive, sending)
        finally:
            usage = scope.get("vlmctl.usage")
            tokens = f"{usage[0]}+{usage[1]} tokens" if usage else "-"
            state.log(f"{scope['method']} {scope['path']} {status[0]} {tokens} {time.perf_counter() - start:.3f} s")

    return with_log


def create_app(state: ServerState):
    """The ASGI app serving `state.engine` under the name `state.model_name`: the Starlette routes behind `guard`,
    each request logged (`logged`)."""
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        if not key_matches(request.scope["headers"], state.api_key):
            raise OpenAIError(401, "missing or wrong API key: send Authorization: Bearer KEY", type="authentication_error",
                              code="invalid_api_key")

    async def health(request: Request) -> JSONResponse:
        # an engine process answers from its own process: asked from a thread, so the event loop goes on meanwhile
        figures = await asyncio.to_thread(state.engine.health)
        alive = figures.get("engine_alive", True)  # an engine process that died answers nothing more: 503
        return JSONResponse({"status": "ok" if alive else "engine_stopped", "model": state.model_name, **state.choice, **figures,
                             "processor_workers": state.preparer.workers if state.preparer is not None else 0,
                             "processor": state.processor, "requests_read": state.requests_read,
                             "read_seconds": round(state.read_seconds, 4), "body_seconds": round(state.body_seconds, 4),
                             "gc": state.gc.describe() if state.gc is not None else None}, status_code=200 if alive else 503)

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers=PAGE_HEADERS)

    async def models(request: Request) -> JSONResponse:
        try:
            authorize(request)
        except OpenAIError as exc:
            return error(exc)
        return JSONResponse({"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                                         "owned_by": "vlmctl"}]})

    async def completions(request: Request):
        state.engine.announce()  # counted while it is read and rendered (/health's `arriving`)
        try:
            return await answer(request)
        finally:
            if not getattr(request.state, "submitted", False):
                state.engine.withdraw()

    async def profile(request: Request) -> JSONResponse:
        """POST /start_profile, /stop_profile (the names vLLM's and SGLang's servers use): `Engine.profile`."""
        from vlmctl.errors import VlmctlError
        from vlmctl.profiling import ProfileStateError

        try:
            authorize(request)
            if not state.engine.profiling:
                raise OpenAIError(400, "profiling is off: start the server with --profile-dir DIR", code="profiling_off")
            try:
                future = state.engine.profile("start" if request.url.path == "/start_profile" else "stop")
            except VlmctlError as exc:  # shutting down
                raise OpenAIError(503, exc.message, type="server_error", code="unavailable") from None
            try:
                return JSONResponse(await asyncio.wrap_future(future))
            except ProfileStateError as exc:
                raise OpenAIError(409, str(exc), code="profile_state") from None
            except OSError as exc:
                raise OpenAIError(500, f"the profile could not be written: {exc}", type="server_error") from None
        except OpenAIError as exc:
            return error(exc)

    relay: list[Relay | None] = [None]  # the running loop's (a relay belongs to one loop; tests run several)

    async def answer(request: Request):
        arrived = time.perf_counter()
        try:
            authorize(request)
            body = await _read_body(request, state.limits.max_body_bytes, state.limits.body_seconds)
            body_read = time.perf_counter()
            try:
                req = parse_request(json.loads(body))
            except (ValueError, RecursionError) as exc:  # ValueError: not JSON, not UTF-8, a number too long
                raise OpenAIError(400, f"the body is not JSON: {exc}" if isinstance(exc, ValueError) else
                                  "the body is nested too deeply") from None
            if req.model != state.model_name:
                raise OpenAIError(404, f"the model {req.model!r} does not exist here; this server serves {state.model_name!r}",
                                  param="model", code="model_not_found")
            job = await asyncio.to_thread(_job, state, req)
        except OpenAIError as exc:
            return error(exc)
        except ClientDisconnect:  # the client left while sending its body: nobody reads an answer
            return Response(status_code=499)
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        if relay[0] is None or relay[0].loop is not loop:
            relay[0] = Relay(loop)
        job.sink = relay[0].sink(events)
        request.state.submitted = True  # the engine counts the announcement as ended, queued or refused
        if not state.engine.submit(job, announced=True):
            why = ("the server is shutting down" if getattr(state.engine, "alive", True) else
                   "the decoding engine's process has stopped; restart the server (its log says why)")
            return error(OpenAIError(503, why, type="server_error", code="unavailable"))
        state.requests_read += 1  # on the event loop's thread only: no lock
        state.read_seconds += time.perf_counter() - arrived
        state.body_seconds += body_read - arrived
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
        if req.stream:
            # the first event decides the status: a job refused by the engine (context too long, inputs the
            # processor cannot read) is a 4xx like any other, not an error inside a 200 stream
            first = await _watching(request, job, events.get())
            if first[0] == "error":
                return error(_event_error(first))
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(job, events, meta, include_usage, first, request.scope),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            answered = await _collect(job, events, meta, state.engine.processor.tokenizer, request)
            usage = answered["usage"]
            request.scope["vlmctl.usage"] = (usage["prompt_tokens"], usage["completion_tokens"])
            return JSONResponse(answered)
        except OpenAIError as exc:
            return error(exc)
        finally:
            job.cancelled.set()

    async def not_found(request: Request, exc) -> JSONResponse:
        status = getattr(exc, "status_code", 404)
        return error(OpenAIError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}",
                                 code="not_found" if status == 404 else None))

    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        return error(OpenAIError(500, f"{type(exc).__name__}: {exc}", type="server_error"))

    routes = [Route("/", page), Route("/health", health), Route("/v1/models", models),
              Route("/v1/chat/completions", completions, methods=["POST"]),
              Route("/start_profile", profile, methods=["POST"]), Route("/stop_profile", profile, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found, Exception: crashed})
    return logged(guard(app, state), state)


async def _read_body(request, limit: int, seconds: float) -> bytes:
    """The body, or OpenAIError(413) as soon as it is over `limit` bytes (the Content-Length is not trusted), or
    OpenAIError(408) when it has not arrived whole `seconds` after the request's head (a stalled or slow upload)."""
    declared = request.headers.get("content-length")
    too_big = OpenAIError(413, f"the request body is over the limit of {limit:,} bytes (--max-body-mb)", code="request_too_large")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), seconds)
    except asyncio.TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {seconds:g} s ({size:,} bytes came)",
                          code="request_timeout") from None
    return b"".join(chunks)


def _job(state: ServerState, req: ChatCompletionRequest) -> Job:
    """The engine's job for a validated request (media read, prompt rendered). Raises OpenAIError(400)."""
    from vlmctl.data.images import MediaRoots
    from vlmctl.errors import VlmctlError

    limits, engine = state.limits, state.engine
    max_tokens = req.max_completion_tokens or req.max_tokens or min(limits.default_max_tokens, limits.max_tokens)
    if max_tokens > limits.max_tokens:
        raise OpenAIError(400, f"max_tokens {max_tokens} is over this server's limit of {limits.max_tokens}", param="max_tokens")
    max_n = min(limits.max_n, engine.max_batch_size)  # a job's choices are rows of one batch
    if req.n > max_n:
        raise OpenAIError(400, f"n {req.n} is over this server's limit of {max_n}", param="n")
    if req.stream and req.logprobs:
        raise OpenAIError(400, "logprobs are given only without streaming", param="logprobs")
    stops = req.stops()
    # far over the context: refused before anything is read, rendered or tokenized
    most_chars = engine.max_length * state.longest_token() * CHARS_PER_TOKEN_MARGIN
    if text_chars(req) > most_chars:
        raise _too_long(f"the messages' text ({text_chars(req):,} characters) cannot fit", engine.max_length)
    roots = MediaRoots.of(Path.cwd(), limits.media_roots)
    from vlmctl.inference.chat import audio_window

    request = to_generation_request(req, roots, limits.max_image_pixels, audio_seconds=audio_window(engine.processor),
                                    video=engine.video, max_media=limits.max_media, max_total_pixels=limits.max_total_pixels)
    try:
        rendered = engine.render(request)
    except VlmctlError as exc:
        raise OpenAIError(400, exc.message, param="messages") from None
    except Exception as exc:  # noqa: BLE001 - the chat template's own refusals (jinja2 TemplateError and others)
        raise OpenAIError(400, f"the model's chat template refuses these messages: {exc}", param="messages") from None
    # the text's tokens (a lower bound: each image's placeholder becomes its visual tokens), counted in this request's
    # thread, so a prompt that cannot fit never reaches the engine's queue
    if len(rendered.text) > most_chars:
        raise _too_long(f"the rendered prompt ({len(rendered.text):,} characters) cannot fit", engine.max_length)
    tokens = len(engine.processor.tokenizer(rendered.text, add_special_tokens=False)["input_ids"])
    if tokens + max_tokens > engine.max_length:
        raise _too_long(f"the prompt (at least {tokens} tokens) plus max_tokens ({max_tokens}) is over", engine.max_length)
    temperature = limits.temperature if req.temperature is None else req.temperature
    prepared = None
    if state.preparer is not None:  # the processor's tensors made here, in a worker process, not on the engine's thread
        try:
            prepared = state.preparer(rendered)
        except Exception as exc:  # noqa: BLE001 - what the processor cannot read is the request's
            message = exc.message if isinstance(exc, VlmctlError) else f"{type(exc).__name__}: {exc}"
            raise OpenAIError(400, f"the processor cannot read this request: {message}", param="messages") from None
    return Job(rendered, n=req.n, max_tokens=max_tokens, temperature=0.0 if temperature < GREEDY_BELOW else temperature,
               top_p=req.top_p or 1.0, seed=req.seed, stop=stops, top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
               stream=bool(req.stream), prepared=prepared)


def _too_long(what: str, context: int) -> OpenAIError:
    return OpenAIError(400, f"{what} the model's context of {context} tokens (data.max_length)", param="messages",
                       code="context_length_exceeded")


async def _watching(request, job: Job, awaitable):
    """The result of `awaitable`, while a client that leaves cancels `job` (checked each second), so nobody's
    answer is generated for nothing; the engine then ends the job early."""
    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(1.0)
        job.cancelled.set()

    watcher = asyncio.create_task(watch())
    try:
        return await awaitable
    finally:
        watcher.cancel()


def _event_error(event: tuple) -> OpenAIError:
    """The OpenAIError of an engine's `("error", status, message, code)` event."""
    return OpenAIError(event[1], event[2], code=event[3], type="invalid_request_error" if event[1] < 500 else "server_error")


async def _collect(job: Job, events: asyncio.Queue, meta: dict, tokenizer, request) -> dict[str, Any]:
    """The whole chat.completion object of a non-streaming job (`_watching` the client)."""
    return await _watching(request, job, _gather(job, events, meta, tokenizer))


async def _gather(job: Job, events: asyncio.Queue, meta: dict, tokenizer) -> dict[str, Any]:
    texts, finish, tokens, logprobs = [""] * job.n, [None] * job.n, [0] * job.n, [None] * job.n
    while True:
        event = await events.get()
        kind = event[0]
        if kind == "delta":
            texts[event[1]] += event[2]
        elif kind == "done":
            finish[event[1]], tokens[event[1]] = event[2], event[3]
        elif kind == "logprobs":
            logprobs[event[1]] = {"content": [_logprob_entry(tokenizer, t, lp, top) for t, lp, top in event[2]]}
        elif kind == "error":
            raise _event_error(event)
        elif kind == "end":
            prompt = event[1]
            break
    choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "finish_reason": finish[i],
                "logprobs": logprobs[i]} for i in range(job.n)]
    return {**meta, "object": "chat.completion", "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": sum(tokens), "total_tokens": prompt + sum(tokens)}}


def _logprob_entry(tokenizer, token: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
    def one(t: int, lp: float) -> dict[str, Any]:
        text = tokenizer.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}


async def _stream(job: Job, events: asyncio.Queue, meta: dict, include_usage: bool, first: tuple, scope: dict):
    """The server-sent events of a streaming job whose `first` event has come: a first chunk with the role per
    choice, content deltas, a chunk with each choice's finish_reason, the usage chunk when asked
    (`stream_options.include_usage`), then `[DONE]`. A failure after the stream started is sent as an `error` event.
    The job is cancelled when the client leaves. The usage is recorded in `scope["vlmctl.usage"]` (the log line)."""

    def chunk(choices: list[dict], **extra) -> str:
        return f"data: {json.dumps({**meta, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"

    tokens = [0] * job.n
    try:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(job.n)])
        ready = deque([first])  # events taken from the queue and not sent yet
        while True:
            event = ready.popleft() if ready else await events.get()
            kind = event[0]
            if kind == "delta":
                while not events.empty():  # the client fell behind: its waiting tokens go out as one chunk
                    ready.append(events.get_nowait())
                text = event[2]
                while ready and ready[0][0] == "delta" and ready[0][1] == event[1]:
                    text += ready.popleft()[2]
                yield chunk([{"index": event[1], "delta": {"content": text}, "finish_reason": None}])
            elif kind == "done":
                tokens[event[1]] = event[3]
                yield chunk([{"index": event[1], "delta": {}, "finish_reason": event[2]}])
            elif kind == "error":
                yield f"data: {json.dumps(OpenAIError(event[1], event[2], code=event[3]).body())}\n\n"
                break
            elif kind == "end":
                scope["vlmctl.usage"] = (event[1], sum(tokens))
                if include_usage:
                    usage = {"prompt_tokens": event[1], "completion_tokens": sum(tokens), "total_tokens": event[1] + sum(tokens)}
                    yield chunk([], usage=usage)
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


__all__ = ["Limits", "PAGE", "ServerState", "create_app", "guard", "is_loopback_name", "key_matches", "logged"]
