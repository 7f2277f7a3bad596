"""Run the server: load the model, start the engine, serve HTTP with uvicorn until SIGTERM or Ctrl-C.

    settings = ServeSettings(host="127.0.0.1", port=8000)
    serve(Path("outputs/runs/run1/final"), settings)                 # blocks; SIGTERM drains, then returns
    with running_server(model, processor, settings) as url: ...      # in a background thread (checks, tests)

Safe by default: the server binds 127.0.0.1; another address needs an API key (`check_settings`). On SIGTERM or
Ctrl-C uvicorn stops accepting connections and waits up to `drain_seconds` for the requests in flight (streams
included) to finish; the engine then answers what is still queued and stops.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from vlmctl.errors import UsageError
from vlmctl.serve.app import Limits, ServerState, create_app
from vlmctl.serve.engine import Engine

# uvicorn is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.


@dataclass
class ServeSettings:
    """How to serve: address, API key, the name clients use for the model (`model_name`; default
    `served_name(folder)`), limits (`Limits`), rows per batch, device and dtype (`load_for_generation`), the seconds
    SIGTERM waits for requests in flight, and the longest prompt plus answer (`max_length`, `data.max_length`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_batch_size: int = 8
    max_length: int = 4096
    device: str = "auto"
    dtype: str = "auto"
    drain_seconds: float = 60.0
    video: Any = None


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_settings(settings: ServeSettings) -> None:
    """Raise UsageError for an address other than loopback without an API key, a port outside 0..65535, or a
    non-positive batch size."""
    if not is_loopback(settings.host) and not settings.api_key:
        raise UsageError(f"binding {settings.host} exposes the model to other machines, and no API key is set",
                         hint="pass --api-key KEY (clients send Authorization: Bearer KEY), or keep --host 127.0.0.1")
    if not 0 <= settings.port <= 65535:
        raise UsageError(f"--port {settings.port} is not a TCP port", hint="use 1..65535, e.g. --port 8000")
    if settings.max_batch_size <= 0:
        raise UsageError(f"--max-batch-size must be positive, got {settings.max_batch_size}", hint="e.g. --max-batch-size 8")


def served_name(model_dir: Path) -> str:
    """The model's name in the API: its folder's name, or the run's for a run's `final` export."""
    model_dir = Path(model_dir).resolve()
    return model_dir.parent.name if model_dir.name == "final" and model_dir.parent.name else model_dir.name


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _uvicorn_server(app, settings: ServeSettings):
    import uvicorn

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=settings.drain_seconds, lifespan="off")
    return uvicorn.Server(config)


def make_state(model, processor, settings: ServeSettings, name: str) -> ServerState:
    engine = Engine(model, processor, max_batch_size=settings.max_batch_size, max_length=settings.max_length,
                    video=settings.video)
    return ServerState(engine=engine, model_name=settings.model_name or name, limits=settings.limits, api_key=settings.api_key)


def serve(model_dir: Path, settings: ServeSettings, *, on_ready=None) -> None:
    """Load the model in `model_dir` and serve it until SIGTERM or Ctrl-C (module docstring). `on_ready(url, state)` is
    called once the model is loaded, before the server listens (`state`: the `ServerState`, its `model_name`). Raises UsageError for bad settings (before
    loading), ModelError for a folder that cannot be loaded."""
    from vlmctl.inference import check_model_dir, load_for_generation

    check_settings(settings)
    check_model_dir(Path(model_dir))
    model, processor = load_for_generation(Path(model_dir), device=settings.device, dtype=settings.dtype)
    state = make_state(model, processor, settings, served_name(model_dir))
    server = _uvicorn_server(create_app(state), settings)
    if on_ready:
        on_ready(f"http://{settings.host}:{settings.port}", state)
    # uvicorn drains, then raises the signal again under the handler it found: this one makes SIGTERM a normal end
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None) if main else None
    try:
        server.run()
    finally:
        state.engine.close(timeout=settings.drain_seconds)
        if main:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def running_server(model, processor, settings: ServeSettings, name: str = "model") -> Iterator[str]:
    """Serve a loaded model from a background thread of this process (on a free port when `settings.port` is 0);
    yields the base URL once the server answers. Stops the server and the engine on exit."""
    if settings.port == 0:
        settings.port = free_port(settings.host)
    check_settings(settings)
    state = make_state(model, processor, settings, name)
    server = _uvicorn_server(create_app(state), settings)
    thread = threading.Thread(target=server.run, name="vlmctl-serve-http", daemon=True)
    thread.start()
    url = f"http://{settings.host}:{settings.port}"
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
        state.engine.close(timeout=settings.drain_seconds)


__all__ = ["ServeSettings", "check_settings", "free_port", "is_loopback", "running_server", "serve", "served_name"]
