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
    `served_name(folder)`), limits (`Limits`), rows per batch, device and dtype (`load_for_serving`), the seconds
    SIGTERM waits for requests in flight, the longest prompt plus answer (`max_length`, `data.max_length`), the
    `data.video` settings and the project's `train` section (None outside a project: its defaults)."""

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
    train: Any = None  # the project's `train` section, whose precision and attention `auto` resolve as training's plan does


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


def serving_plan(device: str, dtype: str = "auto", train: Any = None) -> tuple[str, str]:
    """(compute dtype, attention backend) to serve with on `device` (a resolved torch device name): the decisions of
    training's run plan (`vlmctl.config.plan.build_plan`) for `train` (a TrainSection; None: the defaults) on this
    machine, for padded batches, since the engine left-pads its rows. `dtype` other than `auto` is kept. The
    attention backend is one of the plan's (flash_attn, sdpa, flex, eager); a run trained with the packed-row
    kernel (varlen) is served with sdpa, as its GRPO rollouts are generated (`train.kernels.padded_attention`).
    On CPU: (fp32, sdpa); on a GPU with bf16: bf16, and flash_attn where flash-attn is installed, else sdpa."""
    from vlmctl.config.plan import DeviceFacts, build_plan
    from vlmctl.config.train import TrainSection

    train = train if train is not None else TrainSection()
    if dtype != "auto":
        train = train.model_copy(update={"precision": dtype})
    plan = build_plan(train.model_copy(update={"packing": False}), DeviceFacts.here(cuda=device.startswith("cuda")))
    attention = plan.attention.value
    return plan.precision.value, "sdpa" if attention == "varlen" else attention


def load_for_serving(model_dir: Path, *, device: str = "auto", dtype: str = "auto", train: Any = None) -> tuple[Any, Any, dict]:
    """(model, processor, choice) for serving `model_dir`: loaded by `load_for_generation` on `device` in the dtype
    of `serving_plan`, its attention set to the plan's backend (`train.kernels`, as training sets it). `choice`:
    {"dtype", "attn_implementation"} as the model holds them (what /health reports). Raises UsageError for an
    unknown device or dtype, or a backend this machine cannot run (flash_attn without flash-attn), ModelError as
    `load_for_generation`."""
    from vlmctl.inference import load_for_generation, resolve_device
    from vlmctl.train import kernels

    device = resolve_device(device)
    precision, attention = serving_plan(device, dtype, train)
    try:
        implementation = kernels.resolve_attn_implementation(attention, device.split(":")[0])
    except ValueError as exc:
        raise UsageError(str(exc).replace("train.attn_implementation", "the attention backend"),
                         hint="set train.attn_implementation=sdpa (or auto) in the project") from None
    model, processor = load_for_generation(Path(model_dir), device=device, dtype=precision)
    if model.config._attn_implementation != implementation:
        kernels.set_attention(model, implementation)
    return model, processor, model_choice(model)


def model_choice(model) -> dict:
    """{"dtype", "attn_implementation"} of a loaded model: its parameters' dtype name (bf16, fp16, fp32) and the
    attention implementation of its language model."""
    import torch

    dtype = next(model.parameters()).dtype
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {"dtype": names.get(dtype, str(dtype)), "attn_implementation": text._attn_implementation}


def make_state(model, processor, settings: ServeSettings, name: str) -> ServerState:
    engine = Engine(model, processor, max_batch_size=settings.max_batch_size, max_length=settings.max_length,
                    video=settings.video)
    return ServerState(engine=engine, model_name=settings.model_name or name, limits=settings.limits, api_key=settings.api_key,
                       choice=model_choice(model))


def serve(model_dir: Path, settings: ServeSettings, *, on_ready=None) -> None:
    """Load the model in `model_dir` and serve it until SIGTERM or Ctrl-C (module docstring). `on_ready(url, state)` is
    called once the model is loaded, before the server listens (`state`: the `ServerState`, its `model_name`). Raises UsageError for bad settings (before
    loading), ModelError for a folder that cannot be loaded."""
    from vlmctl.inference import check_model_dir

    check_settings(settings)
    check_model_dir(Path(model_dir))
    model, processor, _ = load_for_serving(Path(model_dir), device=settings.device, dtype=settings.dtype, train=settings.train)
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


__all__ = ["ServeSettings", "check_settings", "free_port", "is_loopback", "load_for_serving", "model_choice", "running_server",
           "serve", "served_name", "serving_plan"]
