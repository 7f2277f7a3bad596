"""The HTTP side of `vlmctl serve`: an ASGI app (Starlette) over an `Engine`.

Routes: `POST /v1/chat/completions` (JSON, or server-sent events with `"stream": true`), `GET /v1/models`,
`GET /health` (never behind the API key: load balancers probe it), `GET /` (the chat page). With an API key every
`/v1/` route needs `Authorization: Bearer KEY` (401 otherwise). Bodies over `max_body_bytes` get 413 before they
are read whole. Every error is OpenAI's error object (`OpenAIError`) with a 4xx status for the client's mistakes
and 5xx for the server's; no request's error stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmctl.serve.engine import Engine, Job
from vlmctl.serve.protocol import ChatCompletionRequest, OpenAIError, parse_request, to_generation_request

# starlette is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules are imported next to their use as well.

PAGE = Path(__file__).with_name("page.html")


@dataclass
class Limits:
    """What one request may ask for. `max_body_bytes`: request body; `max_image_pixels`: width x height per image
    (`data.max_image_pixels`); `max_tokens`: the most tokens per choice (`data.max_length` by default) and
    `default_max_tokens` when the request gives none; `max_n`: choices per request; `media_roots`: folders local
    image paths may lie in (none: data: URLs only)."""

    max_body_bytes: int = 32 << 20
    max_image_pixels: int = 64_000_000
    max_tokens: int = 4096
    default_max_tokens: int = 256
    max_n: int = 8
    media_roots: tuple[Path, ...] = ()
    temperature: float = 0.0  # when a request gives none (0: greedy, as `vlmctl chat`)


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    choice: dict = field(default_factory=dict)  # the model's compute dtype and attention implementation (`model_choice`)


def create_app(state: ServerState):
    """The Starlette app serving `state.engine` under the name `state.model_name`."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise OpenAIError(401, "missing or wrong API key: send Authorization: Bearer KEY", type="authentication_error",
                              code="invalid_api_key")

    async def health(request: Request) -> JSONResponse:
        engine = state.engine
        return JSONResponse({"status": "ok", "model": state.model_name, "queued": engine.queued, "running": engine.running,
                             **state.choice, "batches": engine.batches, "rows": engine.rows,
                             "generate_seconds": round(engine.generate_seconds, 4), "wait_seconds": round(engine.wait_seconds, 4)})

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    async def models(request: Request) -> JSONResponse:
        try:
            authorize(request)
        except OpenAIError as exc:
            return error(exc)
        return JSONResponse({"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                                         "owned_by": "vlmctl"}]})

    async def completions(request: Request):
        state.engine.announce()  # the worker may wait for this request while it renders (Engine.batch_window_s)
        try:
            return await answer(request)
        finally:
            if not getattr(request.state, "submitted", False):
                state.engine.withdraw()

    async def answer(request: Request):
        try:
            authorize(request)
            body = await _read_body(request, state.limits.max_body_bytes)
            try:
                req = parse_request(json.loads(body))
            except (ValueError, UnicodeDecodeError) as exc:
                raise OpenAIError(400, f"the body is not JSON: {exc}") from None
            if req.model != state.model_name:
                raise OpenAIError(404, f"the model {req.model!r} does not exist here; this server serves {state.model_name!r}",
                                  param="model", code="model_not_found")
            job = await asyncio.to_thread(_job, state, req)
        except OpenAIError as exc:
            return error(exc)
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job.sink = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        request.state.submitted = True  # the engine counts the announcement as ended, queued or refused
        if not state.engine.submit(job, announced=True):
            return error(OpenAIError(503, "the server is shutting down", type="server_error", code="unavailable"))
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
        if req.stream:
            # the first event decides the status: a job refused by the engine (context too long, inputs the
            # processor cannot read) is a 4xx like any other, not an error inside a 200 stream
            first = await _watching(request, job, events.get())
            if first[0] == "error":
                return error(_event_error(first))
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(job, events, meta, include_usage, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return JSONResponse(await _collect(job, events, meta, state.engine.processor.tokenizer, request))
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
              Route("/v1/chat/completions", completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found, Exception: crashed})


async def _read_body(request, limit: int) -> bytes:
    """The body, or OpenAIError(413) as soon as it is over `limit` bytes (the Content-Length is not trusted)."""
    declared = request.headers.get("content-length")
    too_big = OpenAIError(413, f"the request body is over the limit of {limit:,} bytes (--max-body-mb)", code="request_too_large")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _job(state: ServerState, req: ChatCompletionRequest) -> Job:
    """The engine's job for a validated request (media read, prompt rendered). Raises OpenAIError(400)."""
    from vlmctl.data.images import MediaRoots
    from vlmctl.errors import VlmctlError

    limits = state.limits
    max_tokens = req.max_completion_tokens or req.max_tokens or min(limits.default_max_tokens, limits.max_tokens)
    if max_tokens > limits.max_tokens:
        raise OpenAIError(400, f"max_tokens {max_tokens} is over this server's limit of {limits.max_tokens}", param="max_tokens")
    if req.n > limits.max_n:
        raise OpenAIError(400, f"n {req.n} is over this server's limit of {limits.max_n}", param="n")
    if req.stream and req.logprobs:
        raise OpenAIError(400, "logprobs are given only without streaming", param="logprobs")
    roots = MediaRoots.of(Path.cwd(), limits.media_roots)
    from vlmctl.inference.chat import audio_window

    engine = state.engine
    request = to_generation_request(req, roots, limits.max_image_pixels, audio_seconds=audio_window(engine.processor),
                                    video=engine.video)
    try:
        rendered = engine.render(request)
    except VlmctlError as exc:
        raise OpenAIError(400, exc.message, param="messages") from None
    except Exception as exc:  # noqa: BLE001 - the chat template's own refusals (jinja2 TemplateError and others)
        raise OpenAIError(400, f"the model's chat template refuses these messages: {exc}", param="messages") from None
    temperature = limits.temperature if req.temperature is None else req.temperature
    return Job(rendered, n=req.n, max_tokens=max_tokens, temperature=temperature, top_p=req.top_p or 1.0, seed=req.seed,
               stop=req.stops(), top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)


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


async def _stream(job: Job, events: asyncio.Queue, meta: dict, include_usage: bool, first: tuple):
    """The server-sent events of a streaming job whose `first` event has come: a first chunk with the role per
    choice, content deltas, a chunk with each choice's finish_reason, the usage chunk when asked
    (`stream_options.include_usage`), then `[DONE]`. A failure after the stream started is sent as an `error` event.
    The job is cancelled when the client leaves."""

    def chunk(choices: list[dict], **extra) -> str:
        return f"data: {json.dumps({**meta, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"

    tokens = [0] * job.n
    try:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(job.n)])
        pending = [first]
        while True:
            event = pending.pop() if pending else await events.get()
            kind = event[0]
            if kind == "delta":
                yield chunk([{"index": event[1], "delta": {"content": event[2]}, "finish_reason": None}])
            elif kind == "done":
                tokens[event[1]] = event[3]
                yield chunk([{"index": event[1], "delta": {}, "finish_reason": event[2]}])
            elif kind == "error":
                yield f"data: {json.dumps(OpenAIError(event[1], event[2], code=event[3]).body())}\n\n"
                break
            elif kind == "end":
                if include_usage:
                    usage = {"prompt_tokens": event[1], "completion_tokens": sum(tokens), "total_tokens": event[1] + sum(tokens)}
                    yield chunk([], usage=usage)
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


__all__ = ["Limits", "PAGE", "ServerState", "create_app"]
