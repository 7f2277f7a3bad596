"""Run the server: load the model, start the engine, serve HTTP with uvicorn until SIGTERM or Ctrl-C.

    settings = ServeSettings(host="127.0.0.1", port=8000)
    serve(Path("outputs/runs/run1/final"), settings)                 # blocks; SIGTERM drains, then returns
    with running_server(model, processor, settings) as url: ...      # in a background thread (checks, tests)

Safe by default: the server binds 127.0.0.1; another address needs an API key (`check_settings`); without a key it
answers only loopback `Host` names, and pages of other origins only when `allowed_origins` lists them
(`vlmctl.serve.app.guard`). The port is bound before the model loads (`bind_socket`), so a port in use is one
UsageError, not a failure after loading. A connection whose request head has not arrived `head_seconds` after it
opened (or after its previous answer) is closed (`head_timeout_protocol`). On SIGTERM or Ctrl-C uvicorn stops accepting
connections and waits up to `drain_seconds` for the requests in flight (streams included) to finish; the engine
then answers what is still queued and stops.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from vlmctl.errors import UsageError
from vlmctl.serve.app import Limits, ServerState, create_app
from vlmctl.serve.engine import Engine
from vlmctl.serve.heap import GCPauses, freeze_heap, unfreeze_heap
from vlmctl.serve.loading import load_for_serving, model_choice, serving_plan

log = logging.getLogger("vlmctl.serve")

# uvicorn is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.


@dataclass
class ServeSettings:
    """How to serve: address, API key, the name clients use for the model (`model_name`; default
    `served_name(folder)`), limits (`Limits`), rows per batch, device and dtype (`load_for_serving`), the seconds
    SIGTERM waits for requests in flight, the longest prompt plus answer (`max_length`, `data.max_length`), the
    `data.video` settings, the project's `train` section (None outside a project: its defaults), the web origins
    allowed to call the server (`allowed_origins`, CORS; `*` any, with an API key only), where each request's log line
    goes (`log`), the seconds a connection may take to send a request's head (`head_seconds`) and the row length
    (prompt and answer, tokens) up to which the decode and prefill CUDA graphs are captured before the server listens
    (`warmup_length`; 0: as first needed), and the processes that run the processor on each request's prompt while it
    is read (`processor_workers`, `serve.prepare`; 0: the engine runs it at admission; None: `auto_processor_workers`;
    families without `collate_prompts` always run it at admission), and the folder `POST /start_profile` and
    `/stop_profile` record the decoding thread into (`profile_dir`, `Engine.profile`; None: those routes refuse), and
    whether the heap alive once the engine has warmed up is frozen out of the garbage collector's reach
    (`freeze_heap`, `serve.heap`: no full collection walks the model's and libraries' objects while serving), and
    whether `serve` runs the engine in a process of its own (`engine_process`, `serve.engine_process`; False: a thread
    of the server's process), and every how many tokens a streamed answer's text is sent (`stream_interval`; 1: each
    token)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_batch_size: int = 32
    max_length: int = 4096
    device: str = "auto"
    dtype: str = "auto"
    drain_seconds: float = 60.0
    video: Any = None
    train: Any = None  # the project's `train` section, whose precision and attention `auto` resolve as training's plan does
    allowed_origins: tuple[str, ...] = ()
    log: Callable[[str], None] | None = None
    head_seconds: float = 30.0
    warmup_length: int = 512  # graphs captured at start-up for rows of up to this many tokens (`Engine`)
    processor_workers: int | None = None  # processes running the processor on each request's prompt (`prepare.PromptPreparer`)
    profile_dir: Path | None = None  # where /start_profile and /stop_profile write torch.profiler traces (`Engine.profile`)
    freeze_heap: bool = True  # gc.freeze() once the engine is ready (`serve.heap.freeze_heap`)
    engine_process: bool = True  # `serve`: the engine in a child process (`serve.engine_process`), else in a thread
    stream_interval: int = 1  # a streamed answer's text every this many tokens (`DecodeEngine`'s `stream_interval`)
    start_seconds: float | None = None  # the longest the engine process may take to load and warm up (None: no limit)


AUTO_PROCESSOR_WORKERS = 4
"""Processor workers `auto` starts on a GPU: on one H200 (3B preset, 32 clients) 4 workers gave 2,677-2,787 output
tokens/s against 2,254-2,270 without, and at 1 and 8 clients the same within the rounds' spread (docs/benchmarks.md)."""


def auto_processor_workers(device: Any, cpus: int | None = None) -> tuple[int, str]:
    """(processor workers, why) when `--processor-workers` is not given: on a CUDA device `AUTO_PROCESSOR_WORKERS`, at
    most one per 4 of the `cpus` this process may run on (default: its CPU affinity, else `os.cpu_count()`), so the
    engine's thread, the HTTP thread and the request threads keep cores; none on another device, where the model's
    forward shares the CPU with the processor."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind != "cuda":
        return 0, f"the model runs on {kind}, whose forward would share the CPU with them"
    workers = min(AUTO_PROCESSOR_WORKERS, cpus // 4)
    if workers == 0:
        return 0, f"{cpus} CPU cores leave none for them"
    return workers, f"a CUDA device and {cpus} CPU cores"


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_settings(settings: ServeSettings) -> None:
    """Raise UsageError for an address other than loopback without an API key, an API key that cannot travel in an
    HTTP header (empty, spaces at its ends, control characters), `*` among the allowed origins without an API key,
    an allowed origin that is not `scheme://host[:port]`, a port outside 0..65535, or a non-positive batch size."""
    key = settings.api_key
    if key is not None and (not key or key != key.strip(" \t") or any(ord(c) < 32 or ord(c) == 127 for c in key)):
        raise UsageError("--api-key must be non-empty, without spaces at its ends and without control characters "
                         "(clients send it in an HTTP header, which cannot carry them)", hint="choose another key")
    if not is_loopback(settings.host) and not key:
        raise UsageError(f"binding {settings.host} exposes the model to other machines, and no API key is set",
                         hint="pass --api-key KEY (clients send Authorization: Bearer KEY), or keep --host 127.0.0.1")
    for origin in settings.allowed_origins:
        if origin == "*":
            if not key:
                raise UsageError("--allow-origin '*' lets every web page the user opens call the model, and no API key is set",
                                 hint="name the page's origin (--allow-origin http://localhost:3000), or pass --api-key KEY")
        elif not re.fullmatch(r"https?://[^/\s?#]+", origin):
            raise UsageError(f"--allow-origin {origin!r} is not an origin (scheme://host[:port], no path)",
                             hint="e.g. --allow-origin http://localhost:3000")
    if not 0 <= settings.port <= 65535:
        raise UsageError(f"--port {settings.port} is not a TCP port", hint="use 1..65535, e.g. --port 8000")
    if settings.max_batch_size <= 0:
        raise UsageError(f"--max-batch-size must be positive, got {settings.max_batch_size}", hint="e.g. --max-batch-size 8")
    if settings.stream_interval < 1:
        raise UsageError(f"--stream-interval must be at least 1 token, got {settings.stream_interval}", hint="e.g. --stream-interval 4")


def served_name(model_dir: Path) -> str:
    """The model's name in the API: its folder's name, or the run's for a run's `final` export."""
    model_dir = Path(model_dir).resolve()
    return model_dir.parent.name if model_dir.name == "final" and model_dir.parent.name else model_dir.name


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (`host`, `port`) (port 0: a free one), not yet listening: uvicorn listens on it
    (`Server.run(sockets=...)`), so the address is taken before the model loads. Raises UsageError for a port in use,
    one that needs privileges, or an address that is not this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT can be bound again
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is already in use (another server listens there)",
                             hint=f"stop that server, or choose another port, e.g. --port {free_port(host)}") from None
        if exc.errno == errno.EACCES:
            raise UsageError(f"port {port} needs privileges this user does not have", hint="choose a port above 1023, e.g. --port 8000") from None
        raise UsageError(f"cannot bind {host}:{port}: {exc.strerror or exc}",
                         hint="use an address of this machine (--host 127.0.0.1, or 0.0.0.0 with --api-key)") from None
    sock.set_inheritable(True)
    return sock


def http_protocol():
    """(uvicorn's HTTP protocol class, its name): httptools' where it is installed (its C parser, and responses
    written without h11's per-event Python), else h11's. On the 2-core CPU machine, 32 streaming clients of a model-free
    engine (`benchmarks/serve_http_cost.py`) cost the server 38-39 ms of CPU per 1,000 streamed tokens with httptools
    and uvloop against 47-48 ms with h11 and asyncio's loop (docs/benchmarks.md)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol, "httptools"
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol, "h11"


def head_timeout_protocol(seconds: float, base: type | None = None):
    """uvicorn's HTTP protocol (`base`; default `http_protocol()`'s), closing a connection whose request head (request
    line and headers) has not arrived `seconds` after the connection opened or its previous response ended: uvicorn
    itself waits forever for a head sent byte by byte, so idle or slow clients would hold connections without end."""
    base = base if base is not None else http_protocol()[0]

    class HeadTimeout(base):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the head arrived: a request is being answered (its body has its own limit)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeout


def _uvicorn_server(app, settings: ServeSettings):
    import uvicorn

    # loop "auto": uvloop where it is installed (`http_protocol` says why both are wanted)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=settings.drain_seconds, lifespan="off", loop="auto",
                            http=head_timeout_protocol(settings.head_seconds))
    return uvicorn.Server(config)


def make_state(model, processor, settings: ServeSettings, name: str, model_dir: Path | None = None) -> ServerState:
    """The app's state: the engine (its start-up graphs captured) and, with `settings.processor_workers` (None:
    `auto_processor_workers` for the model's device) and the model folder `model_dir`, the processor workers
    (`serve.prepare`) where the family batches prompts processed alone. With `model` None the engine runs in a child
    process that loads `model_dir` itself (`serve.engine_process.EngineProcess`, on `settings.device`); the
    processor workers start while it loads. Raises what loading raises (ModelError, UsageError)."""
    from vlmctl.inference import folder_family
    from vlmctl.inference.prompt import model_family

    if model is None:
        from vlmctl.inference import resolve_device
        from vlmctl.serve.engine_process import EngineProcess

        if model_dir is None:
            raise ValueError("make_state needs a loaded model or the folder of one")
        family, device = folder_family(Path(model_dir)), resolve_device(settings.device)
        engine = EngineProcess(Path(model_dir), device=device, dtype=settings.dtype, train=settings.train,
                               max_batch_size=settings.max_batch_size, max_length=settings.max_length,
                               video=settings.video, warmup_length=settings.warmup_length,
                               profile_dir=settings.profile_dir, freeze_heap=settings.freeze_heap,
                               stream_interval=settings.stream_interval)
    else:
        family, device, engine = model_family(model), next(model.parameters()).device, None
    preparer = None
    workers, why = settings.processor_workers, "--processor-workers"
    if workers is None:
        workers, why = auto_processor_workers(device)
    if workers == 0:
        where = f"on the engine's thread ({why})" if settings.processor_workers is None else "on the engine's thread"
    elif model_dir is None:
        where = "on the engine's thread (no model folder for worker processes to load it from)"
    elif not getattr(family, "collate_prompts", False):
        name_ = family.name if family is not None else "unknown"
        where = f"on the engine's thread (family {name_} batches prompts only through its processor)"
    else:
        from vlmctl.serve.prepare import PromptPreparer

        # the workers start (import transformers, load the processor) while the engine loads and captures its graphs
        try:
            preparer = PromptPreparer(model_dir, workers, video=settings.video, wait=False)
        except BaseException:
            if engine is not None:
                engine.close(timeout=0)
            raise
        where = f"{workers} worker processes ({why})"
    try:
        if engine is None:
            engine = Engine(model, processor, max_batch_size=settings.max_batch_size, max_length=settings.max_length,
                            family=family, video=settings.video, warmup_length=settings.warmup_length,
                            profile_dir=settings.profile_dir, stream_interval=settings.stream_interval)
        else:
            engine.wait_ready(settings.start_seconds)
    except BaseException:
        if preparer is not None:
            preparer.close(wait=False)
        raise
    if preparer is not None:
        try:
            preparer.wait_ready()
        except BaseException:
            engine.close(timeout=0)
            raise
    log.info("processor: %s", where)
    choice = engine.choice if model is None else model_choice(model)
    state = ServerState(engine=engine, model_name=settings.model_name or name, limits=settings.limits, api_key=settings.api_key,
                        choice=choice, loopback_only=is_loopback(settings.host) and not settings.api_key,
                        allowed_origins=tuple(settings.allowed_origins), log=settings.log, preparer=preparer,
                        processor=where, gc=GCPauses().install())
    if settings.freeze_heap:
        state.gc.froze = freeze_heap()
        log.info("garbage collector: %d objects alive after start-up frozen out of its collections", state.gc.froze)
    return state


def close_state(state: ServerState, drain_seconds: float) -> None:
    """Stop what `make_state` started: the engine (answering what runs for up to `drain_seconds`), the processor
    workers, the collector's pause counting; a heap it froze goes back to the collector."""
    state.engine.close(timeout=drain_seconds)
    if state.preparer is not None:
        state.preparer.close()
    if state.gc is not None:
        state.gc.remove()
        if state.gc.froze:
            unfreeze_heap()


def serve(model_dir: Path, settings: ServeSettings, *, on_ready=None, sock: socket.socket | None = None) -> None:
    """Load the model in `model_dir` and serve it until SIGTERM or Ctrl-C (module docstring). `on_ready(url, state)` is
    called once the model is loaded, before the server listens (`state`: the `ServerState`, its `model_name`). Raises
    UsageError for bad settings or an address that cannot be bound (both before loading), ModelError for a folder
    that cannot be loaded. `sock`: the socket to serve on, bound by the caller (`bind_socket`; default: bound here)."""
    from vlmctl.inference import check_model_dir

    check_settings(settings)
    check_model_dir(Path(model_dir))
    sock = sock if sock is not None else bind_socket(settings.host, settings.port)
    try:
        if settings.engine_process:  # the child loads the model; this process only its processor
            model = processor = None
        else:
            model, processor, _ = load_for_serving(Path(model_dir), device=settings.device, dtype=settings.dtype,
                                                   train=settings.train)
        state = make_state(model, processor, settings, served_name(model_dir), model_dir=Path(model_dir))
    except BaseException:
        sock.close()
        raise
    server = _uvicorn_server(create_app(state), settings)
    if on_ready:
        on_ready(_url(settings.host, settings.port), state)
    # uvicorn drains, then raises the signal again under the handler it found: this one makes SIGTERM a normal end
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None) if main else None
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        close_state(state, settings.drain_seconds)
        if main:
            signal.signal(signal.SIGTERM, previous)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def running_server(model, processor, settings: ServeSettings, name: str = "model", model_dir: Path | None = None) -> Iterator[str]:
    """Serve a loaded model from a background thread of this process (on a free port when `settings.port` is 0);
    yields the base URL once the server answers. Stops the server, the engine and the processor workers on exit.
    `model_dir`: the model's folder, which processor workers load the processor from; with `model` None, the engine
    runs in a process of its own that loads that folder (`make_state`)."""
    check_settings(settings)
    sock = bind_socket(settings.host, settings.port)
    settings.port = sock.getsockname()[1]
    state = make_state(model, processor, settings, name, model_dir=model_dir)
    server = _uvicorn_server(create_app(state), settings)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="vlmctl-serve-http", daemon=True)
    thread.start()
    url = _url(settings.host, settings.port)
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {url} did not start")
            time.sleep(0.02)
        yield url
    finally:
        server.should_exit = True
        thread.join(settings.drain_seconds)
        sock.close()
        close_state(state, settings.drain_seconds)


__all__ = ["AUTO_PROCESSOR_WORKERS", "ServeSettings", "auto_processor_workers", "bind_socket", "check_settings", "close_state", "free_port",
           "is_loopback", "load_for_serving", "model_choice", "running_server", "serve", "served_name", "serving_plan"]
