"""The decoding engine in a process of its own, for `vlmctl serve` (its default; `--engine-thread` keeps it in a thread
of the server's process).

    engine = EngineProcess(model_dir, device="cuda", max_batch_size=32, max_length=4096)   # starts loading
    engine.wait_ready()          # the model loaded and its graphs captured in the child; raises what the child raised
    engine.submit(job)           # as `serve.engine.Engine`: events arrive on `job.sink`, from a reader thread here
    engine.close(timeout=60)     # answers what runs, then the child exits

Why a process: the engine's worker thread launches every decode step from Python, and at many clients the server's
request threads, its event loop and the event relay run Python too. In one process they share one interpreter lock.
vLLM's V1 engine core and SGLang's scheduler run apart from their HTTP servers for that reason. Measured on one H200
at 32 clients (docs/benchmarks.md): an admission's host time fell from 6-11 ms to 2-3 ms, and a request's wait in
the engine's queue from 21-24 ms to 5-7 ms. Output tokens/s stayed the same within the rounds' spread, and a request's
way from its arrival to the queue did not get shorter.

The child (started with `spawn`, so it has its own CUDA context and the server's process none) loads the model
(`load_for_serving`), runs `serve.engine.Engine` in it, and talks to the server over one `multiprocessing.Pipe`:

- server -> child: ("submit", job id, the job's fields), ("cancel", job id), ("call", call id, name, argument) for
  `health` and `profile`, ("close", seconds);
- child -> server: ("ready", facts) once warmed up or ("failed", error kind, message, hint); ("events", [(job id,
  event), ...]) once per turn of the engine's loop (the events of `serve.engine`), ("reply", call id, ok, value);
  ("closed",) before it exits.

Pictures travel as the encoded bytes a request brought (`prepare.portable_image`) and processor tensors as numpy
arrays (pickled by value, as the processor workers return them), never through torch's shared-memory descriptors.
The server's process loads only the processor (rendering, token counts, the processor workers' collation happens in
the child). A child that dies fails its jobs in flight with 500 and later ones with 503; `/health` then says
`engine_alive: false`. The child ignores SIGINT (a Ctrl-C reaches the whole process group: the server drains and
then closes it) and exits when the pipe closes (the server died).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from vlmctl.errors import UsageError
from vlmctl.serve.engine import Engine

log = logging.getLogger("vlmctl.serve")

# torch and transformers are imported inside the functions that use them (and in the child): importing vlmctl (the
# CLI's start-up) must not pay for them.

FINAL = ("end", "error")  # a job's last event kinds


class EngineProcess:
    """`serve.engine.Engine`'s interface (what `serve.app` and `serve.server` use) over an engine in a child process
    (module docstring). The child starts at once; `wait_ready(timeout)` returns when it has loaded the model (on
    `device`, in `dtype`, with the `train` section's attention and precision: `load_for_serving`) and captured its
    start-up graphs (`warmup_length`), and raises the child's error otherwise: ModelError or UsageError as
    `load_for_serving` raises them, RuntimeError when the child exits without a word. `freeze_heap`: the child freezes
    its heap once warmed up (`serve.heap.freeze_heap`). Other arguments as `Engine`'s."""

    where = "process"

    def __init__(self, model_dir: Path, *, device: str = "auto", dtype: str = "auto", train: Any = None,
                 max_batch_size: int = 8, max_length: int = 4096, video: Any = None, warmup_length: int = 0,
                 profile_dir: Path | None = None, profile_seconds: float = 60.0, freeze_heap: bool = True,
                 stream_interval: int = 1):
        import multiprocessing

        from vlmctl.models import load_processor

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        options = {"device": device, "dtype": dtype, "train": train, "max_batch_size": max_batch_size,
                   "max_length": max_length, "video": video, "warmup_length": warmup_length, "profile_dir": profile_dir,
                   "profile_seconds": profile_seconds, "freeze_heap": freeze_heap, "stream_interval": stream_interval}
        self.process = context.Process(target=_child_main, args=(child, str(model_dir), options),
                                       name="vlmctl-serve-engine", daemon=True)
        self.process.start()
        child.close()
        self.video, self.max_length, self.max_batch_size = video, max_length, max_batch_size
        self.profiling = profile_dir is not None
        self.facts: dict[str, Any] = {}  # what the child reported when ready (`summary`, `choice`, its pid)
        self.family = None
        self.arriving = 0
        self.alive = True  # False once the child has gone (closed, or died)
        self._lock = threading.Lock()  # the job and call tables (never held while the pipe blocks)
        self._send_lock = threading.Lock()  # the pipe's sends (the reader never takes it, so it always drains the child)
        self._sinks: dict[int, Any] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._reader: threading.Thread | None = None
        try:
            self.processor = load_processor(str(model_dir))  # for rendering and token counts in the server's process
            tok = self.processor.tokenizer
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
        except BaseException:
            self._kill()
            raise

    # start-up

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for the child's model and graphs (class docstring); raises the child's error, or RuntimeError after
        `timeout` seconds (the child is stopped then)."""
        from vlmctl.families import get_family

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left is not None and left == 0.0:
                self._kill()
                raise RuntimeError(f"the engine process did not start within {timeout:g} s")
            if not self._conn.poll(left if left is not None else 1.0):
                if not self.process.is_alive() and not self._conn.poll(0):
                    self._kill()
                    raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while it started "
                                       "(its output above says why)")
                continue
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._kill()
                raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while it started "
                                   "(its output above says why)") from None
            if message[0] == "ready":
                self.facts = message[1]
                break
            if message[0] == "failed":
                self._kill()
                raise _rebuild(message[1], message[2], message[3])
        self.max_batch_size = self.facts["max_batch_size"]
        self.family = get_family(self.facts["family"]) if self.facts.get("family") else None
        self._reader = threading.Thread(target=self._read, name="vlmctl-serve-engine-reader", daemon=True)
        self._reader.start()

    # what `serve.app` and `serve.server` use

    def summary(self) -> str:
        """One line for people about decoding (the child's `DecodeEngine.summary`), and the child's pid."""
        return f"{self.facts.get('summary', '')}; in process {self.facts.get('pid')}"

    @property
    def choice(self) -> dict:
        """{"dtype", "attn_implementation"} of the model in the child (`serve.server.model_choice`)."""
        return dict(self.facts.get("choice", {}))

    # the prompt rendered in this process, with this process's processor and the child's family
    render = Engine.render

    def announce(self) -> None:
        with self._lock:
            self.arriving += 1

    def withdraw(self) -> None:
        with self._lock:
            self.arriving = max(0, self.arriving - 1)

    def submit(self, job, announced: bool = False) -> bool:
        """Send `job` to the child; False (nothing sent) once closing or once the child has gone. Its events come
        to `job.sink` from the reader thread; setting `job.cancelled` tells the child."""
        from vlmctl.serve.prepare import portable_image

        with self._lock:
            if announced:
                self.arriving = max(0, self.arriving - 1)
            if self._closing or not self.alive:
                return False
            job_id = next(self._ids)
            self._sinks[job_id] = job.sink
        job.cancelled = _Cancel(lambda: self._cancel(job_id), already=job.cancelled.is_set())
        rendered = job.rendered._replace(images=[portable_image(i) for i in job.rendered.images])
        prepared = None if job.prepared is None else {k: v.numpy() for k, v in job.prepared.items()}
        fields = {"rendered": rendered, "n": job.n, "max_tokens": job.max_tokens, "temperature": job.temperature,
                  "top_p": job.top_p, "seed": job.seed, "stop": list(job.stop), "top_logprobs": job.top_logprobs,
                  "stream": job.stream, "prepared": prepared, "cancelled": job.cancelled.is_set()}
        job.prepared = None
        if not self._send(("submit", job_id, fields)):
            with self._lock:
                self._sinks.pop(job_id, None)
            return False
        return True

    def health(self) -> dict[str, Any]:
        """As `Engine.health`, from the child (waits up to 10 s for it), with `arriving` counted here and
        `engine_alive`; a child that has gone gives `engine_alive: false` and the facts it reported at start."""
        figures: dict[str, Any] = {}
        if self.alive:
            try:
                figures = self.call("health").result(timeout=10)
            except Exception as exc:  # noqa: BLE001 - /health must answer, and say what it could not learn
                figures = {"engine_error": f"{type(exc).__name__}: {exc}"}
        return {**figures, "engine": self.where, "engine_pid": self.facts.get("pid"), "arriving": self.arriving,
                "engine_alive": self.alive}

    def profile(self, action: str) -> Future:
        """As `Engine.profile`, run in the child."""
        if not self.profiling:
            raise UsageError("profiling is off", hint="start the server with --profile-dir DIR")
        if action not in ("start", "stop"):
            raise ValueError(f"action must be start or stop, got {action!r}")
        if self._closing or not self.alive:
            raise UsageError("the server is shutting down")
        return self.call("profile", action)

    def call(self, name: str, argument: Any = None) -> Future:
        """A Future of the child's answer to `name` (`health`, `profile`); its exception is the child's error
        rebuilt (`_rebuild`), or RuntimeError once the child has gone."""
        future: Future = Future()
        with self._lock:
            call_id = next(self._ids)
            self._calls[call_id] = future
        if not self._send(("call", call_id, name, argument)):
            with self._lock:
                self._calls.pop(call_id, None)
            future.set_exception(RuntimeError("the engine process has stopped"))
        return future

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the child answer the queued and running ones (up to `timeout` seconds), wait for it
        to exit (stopped after `timeout` plus 10 s)."""
        with self._lock:
            first = not self._closing
            self._closing = True
        if first:
            self._send(("close", timeout))
        if self._reader is not None:
            self._reader.join(None if timeout is None else timeout + 10)
        self.process.join(10)
        self._kill()

    # inside

    def _send(self, message) -> bool:
        with self._send_lock:
            if not self.alive:
                return False
            try:
                self._conn.send(message)
                return True
            except (OSError, ValueError):  # the child has gone: the reader fails what it had
                return False

    def _cancel(self, job_id: int) -> None:
        with self._lock:
            wanted = job_id in self._sinks
        if wanted:
            self._send(("cancel", job_id))

    def _read(self) -> None:
        """The reader thread: the child's events to their jobs' sinks, its replies to their Futures, until it says
        it closed or its end of the pipe goes."""
        why = "the engine process stopped"
        try:
            while True:
                try:
                    message = self._conn.recv()
                except (EOFError, OSError):
                    self.process.join(5)
                    why = f"the engine process exited with code {self.process.exitcode}"
                    break
                kind = message[0]
                if kind == "events":
                    for job_id, event in message[1]:
                        sink = self._sinks.get(job_id)
                        if event[0] in FINAL:
                            with self._lock:
                                self._sinks.pop(job_id, None)
                        if sink is not None:
                            sink(event)
                elif kind == "reply":
                    with self._lock:
                        future = self._calls.pop(message[1], None)
                    if future is not None:
                        if message[2]:
                            future.set_result(message[3])
                        else:
                            future.set_exception(_rebuild(*message[3]))
                elif kind == "closed":
                    break
        finally:
            with self._lock:
                self.alive = False
                sinks, self._sinks = self._sinks, {}
                calls, self._calls = self._calls, {}
            if sinks and not self._closing:
                log.error("%s with %d jobs in flight; they fail with 500", why, len(sinks))
            for sink in sinks.values():
                sink(("error", 500, f"generation failed: {why}", "server_error"))
            for future in calls.values():
                future.set_exception(RuntimeError(why))

    def _kill(self) -> None:
        with self._lock:
            self.alive = False
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        self._conn.close()


class _Cancel(threading.Event):
    """A job's `cancelled` event whose first `set()` also tells the child."""

    def __init__(self, tell, already: bool = False):
        super().__init__()
        self._tell = tell
        if already:
            super().set()

    def set(self) -> None:
        if not self.is_set():
            super().set()
            self._tell()


def _error_parts(exc: BaseException) -> tuple[str, str, str | None]:
    """(kind, message, hint) of an error the child sends: its class name, its message, its hint (vlmctl's errors)."""
    return type(exc).__name__, str(getattr(exc, "message", exc)), getattr(exc, "hint", None)


def _rebuild(kind: str, message: str, hint: str | None = None) -> Exception:
    """The child's error as an exception of this process: vlmctl's own kinds and ProfileStateError as themselves, an
    OSError as one, anything else as RuntimeError naming the kind."""
    from vlmctl import errors
    from vlmctl.profiling import ProfileStateError

    if kind == "ProfileStateError":
        return ProfileStateError(message)
    known = getattr(errors, kind, None)
    if isinstance(known, type) and issubclass(known, errors.VlmctlError):
        return known(message, hint=hint) if hint else known(message)
    if kind in ("OSError", "FileNotFoundError", "PermissionError"):
        return OSError(message)
    return RuntimeError(f"{kind}: {message}")


def _child_main(conn, model_dir: str, options: dict[str, Any]) -> None:
    """The engine process: load, warm up, report ready, then serve the pipe's orders until closed."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which drains and then closes us
    child = _Child(conn)
    try:
        facts = child.start(Path(model_dir), options)
    except BaseException as exc:  # noqa: BLE001 - the server raises it
        child.send(("failed", *_error_parts(exc)))
        conn.close()
        return
    child.run(facts)


class _Child:
    """The child's side of the pipe: jobs in, events out (one send per turn of the engine's loop), calls answered."""

    def __init__(self, conn):
        from collections import deque

        self.conn = conn
        self.engine: Any = None
        self.gc: Any = None  # the child's collector pauses (`serve.heap.GCPauses`), /health's `engine_gc`
        self.lock = threading.Lock()  # the pipe's sends: events from the worker thread, replies from this one
        self.outbox: deque = deque()  # (job id, event), appended by the jobs' sinks
        self.jobs: dict[int, Any] = {}

    def start(self, model_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
        """Load the model as the server would (`load_for_serving`), start the engine (its graphs captured), freeze
        the heap (`freeze_heap`); the facts the server is told."""
        from vlmctl.inference.prompt import model_family
        from vlmctl.serve.heap import GCPauses, freeze_heap
        from vlmctl.serve.loading import load_for_serving

        model, processor, choice = load_for_serving(model_dir, device=options["device"], dtype=options["dtype"],
                                                    train=options["train"])
        family = model_family(model)
        self.engine = Engine(model, processor, max_batch_size=options["max_batch_size"], max_length=options["max_length"],
                             family=family, video=options["video"], warmup_length=options["warmup_length"],
                             profile_dir=options["profile_dir"], profile_seconds=options["profile_seconds"],
                             on_step=self.flush, stream_interval=options["stream_interval"])
        self.gc = GCPauses().install()
        if options["freeze_heap"]:
            self.gc.froze = freeze_heap()
        return {"pid": os.getpid(), "summary": self.engine.summary(), "choice": choice,
                "family": family.name if family is not None else None, "max_batch_size": self.engine.max_batch_size}

    def run(self, facts: dict[str, Any]) -> None:
        self.send(("ready", facts))
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):  # the server has gone: nobody reads what is left
                    self.engine.close(timeout=0)
                    return
                kind = message[0]
                if kind == "submit":
                    self.submit(message[1], message[2])
                elif kind == "cancel":
                    job = self.jobs.get(message[1])
                    if job is not None:
                        job.cancelled.set()
                elif kind == "call":
                    self.answer(message[1], message[2], message[3])
                elif kind == "close":
                    self.engine.close(timeout=message[1])
                    self.flush()
                    self.send(("closed",))
                    return
        finally:
            self.conn.close()

    def submit(self, job_id: int, fields: dict[str, Any]) -> None:
        import torch

        from vlmctl.inference.prompt import _to_rgb
        from vlmctl.serve.engine import Job

        rendered = fields.pop("rendered")
        rendered = rendered._replace(images=[_to_rgb(i) if isinstance(i, (bytes, bytearray)) else i for i in rendered.images])
        prepared = fields.pop("prepared")
        if prepared is not None:
            prepared = {k: torch.from_numpy(v) for k, v in prepared.items()}
        cancelled = fields.pop("cancelled")

        def sink(event, job_id=job_id):
            self.outbox.append((job_id, event))
            if event[0] in FINAL:
                self.jobs.pop(job_id, None)

        job = Job(rendered, prepared=prepared, sink=sink, **fields)
        if cancelled:
            job.cancelled.set()
        self.jobs[job_id] = job
        if not self.engine.submit(job):
            job.fail(503, "the server is shutting down", "unavailable")
            self.flush()

    def answer(self, call_id: int, name: str, argument: Any) -> None:
        """Answer a call: `health` at once, `profile` when the worker has done it (from the Future's callback)."""
        def reply(future: Future) -> None:
            exc = future.exception()
            self.send(("reply", call_id, True, future.result()) if exc is None else ("reply", call_id, False, _error_parts(exc)))

        try:
            if name == "health":
                figures = {**self.engine.health(), "engine_gc": self.gc.describe()}
                self.send(("reply", call_id, True, figures))
            elif name == "profile":
                self.engine.profile(argument).add_done_callback(reply)
            else:
                raise ValueError(f"no call named {name!r}")
        except Exception as exc:  # noqa: BLE001 - the server's to report
            self.send(("reply", call_id, False, _error_parts(exc)))

    def flush(self) -> None:
        """Send the events made so far, in one message (called on the worker thread after each turn). Taken and
        sent under the send lock, so two flushes never reorder one job's events."""
        if not self.outbox:
            return
        with self.lock:
            batch = []
            while self.outbox:
                batch.append(self.outbox.popleft())
            if batch:
                self._send(("events", batch))

    def send(self, message) -> None:
        with self.lock:
            self._send(message)

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # the server has gone
            pass


__all__ = ["EngineProcess"]
