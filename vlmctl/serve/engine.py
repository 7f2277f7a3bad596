"""One model answering many requests: a queue, and a worker thread that runs the decoding engine
(`vlmctl.inference.engine.DecodeEngine`) with continuous batching.

    engine = Engine(model, processor, max_batch_size=8, max_length=4096)
    job = Job(rendered, n=1, max_tokens=64, temperature=0.0, top_p=1.0, seed=None, stop=[], sink=events.append)
    engine.submit(job)       # events arrive on `sink` from the worker thread
    engine.close()           # answers what is queued and running, then stops the worker

The worker hands each submitted job to the decoding engine and steps it while anything runs: a job joins the rows
being decoded at the next step (its prompt prefilled into free cache slots, several new prompts in one forward),
and a row that finishes frees its slot for the next job at once, so clients never wait for each other's answers to
end. Up to `max_batch_size` rows decode together (a job of `n` choices is `n` rows); each row has its own sampling
settings and seed, so jobs of any settings share a step. Prompts are rendered by the model's chat template
(`vlmctl.inference.render_request`, as `vlmctl generate` and `vlmctl chat` render them), so a greedy answer equals
`generate`'s for the same request (up to floating-point ties between batch shapes).

Each row stops on its own: at an end-of-sequence token of the model's generation config, at its `max_tokens`, at
one of its `stop` strings (the text before it is kept) or when its job is cancelled (a client that went away). A
job's failure never reaches another: a job the processor cannot read, or whose prompt plus `max_tokens` is over
`max_length`, fails alone (400), as does one the model fails on (500).

Events, called from the worker thread (`sink(event)`), as tuples (`vlmctl.inference.engine` documents them):
- `("delta", choice, text)`: more text of choice `choice` (its leading whitespace dropped; the pieces joined equal
  the final text); one per generated token when streamed, "" while the token's text is held back;
- `("logprobs", choice, entries)`: per generated token `(token id, logprob, [(token id, logprob), ...] top)`, from
  the model's raw logits (log-softmax), when the job asked for them;
- `("done", choice, finish_reason, completion_tokens)`: `stop` (end of sequence or a stop string) or `length`;
- `("end", prompt_tokens)`: the job is complete (always the last event of a job that did not fail);
- `("error", status, message, code)`: the job failed, or was cancelled (499; the last event).

`announce` / `withdraw` tell the engine a request is being read; with continuous batching nothing waits for it,
and they only count what is on its way (`arriving`, in /health).

With `profile_dir`, `profile("start")` and `profile("stop")` record the worker thread under torch.profiler
(`vlmctl.profiling.ThreadProfile`: the engine's phases as named ranges, the GPU's kernels, where the GPU sat idle
and how much of that it had no request to run) into `profile_dir/profile-NNN/`. The worker starts and stops the
profile itself, between two steps (torch records the host ops of the thread that starts it); writing the trace
pauses decoding for as long as it takes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vlmctl.errors import UsageError
from vlmctl.inference.prompt import GenerationRequest, RenderedRequest
from vlmctl.profiling import WAIT_FOR_WORK, ProfileStateError, ThreadProfile, phase

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# So are the vlmctl modules that load numpy when imported.

Event = tuple
Sink = Callable[[Event], None]
log = logging.getLogger("vlmctl.serve")


@dataclass
class Job:
    """One chat completion request to answer: the request rendered (`rendered`, by `Engine.render`), `n` choices of at
    most `max_tokens` tokens each, sampling settings (`temperature` 0: greedy), the `stop` strings, `top_logprobs`
    (None: no logprobs; else the number of alternatives per token), whether its text is streamed (`stream`: a job
    answered whole gets one delta, its final text, and no per-token decoding) and where its events go (`sink`)."""

    rendered: RenderedRequest
    n: int = 1
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int | None = None
    sink: Sink = lambda event: None
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: bool = True  # text deltas as the answer grows (else the final text only, at its end)
    prepared: dict[str, Any] | None = None  # the processor's tensors for its prompt alone (`DecodeEngine.submit`)
    queued_at: float | None = None  # perf_counter seconds when `Engine.submit` queued it (its wait counts from there)

    def params(self):
        """The job's `SamplingParams`."""
        from vlmctl.inference.sampling import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                              stop=tuple(self.stop), logprobs=self.top_logprobs)

    def fail(self, status: int, message: str, code: str | None = None) -> None:
        self.sink(("error", status, message, code))


class Engine:
    """Answers `Job`s with one loaded model (`load_for_generation`) in a worker thread (module docstring).

    `max_batch_size`: rows decoded together (the decoding engine's slots). `max_length`: the longest prompt plus
    `max_tokens` a job may ask for, in tokens (the project's `data.max_length`); a longer one fails with 400
    `context_length_exceeded`. `family`: the model's `FamilySpec` (default: from its config). `video`: the
    `data.video` settings. `warmup_length`: before the worker starts, the CUDA graphs of the decode step (every
    batch size) and of short prefills (every bucket up to `prefill_batch` prompts) are captured for rows of up to
    this many tokens (prompt and answer; `DecodeEngine.warmup`), so that no client's tokens wait for a capture
    later; 0: captured as they are first needed. `profile_dir`: where `profile` writes (None: profiling off);
    `profile_seconds`: the longest a profile records before the worker stops it itself. `options`: passed to
    `DecodeEngine` (`graphs`, `kernels`, `prefill_batch`). `on_step`: called on the worker thread after each turn of
    its loop (jobs handed over, one step) and once before it ends; the engine process (`serve.engine_process`) sends
    the events of that turn to the server from there.
    """

    where = "thread"  # the engine runs in a thread of the server's process (`/health`'s `engine`)

    def __init__(self, model, processor, *, max_batch_size: int = 8, max_length: int = 4096, family: Any = None,
                 video: Any = None, warmup_length: int = 0, profile_dir: Path | None = None, profile_seconds: float = 60.0,
                 on_step: Callable[[], None] | None = None, **options: Any):
        from vlmctl.inference.engine import DecodeEngine

        self.model, self.processor = model, processor
        self.decoder = DecodeEngine(model, processor, family=family, max_slots=max_batch_size, max_length=max_length,
                                    video=video, **options)
        self.family, self.video, self.max_length = self.decoder.family, video, max_length
        self.max_batch_size = self.decoder.max_slots
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self.arriving = 0  # requests announced and not yet submitted or withdrawn
        self.rows = 0  # rows decoded, summed over the decode steps (rows / batches: rows per step)

        self.busy_seconds = 0.0  # seconds the worker spent stepping the engine (prefill, decoding, tokens sent)
        self.profiler = ThreadProfile(profile_dir, profile_seconds) if profile_dir is not None else None
        self.last_profile: dict[str, Any] | None = None  # what the last profile wrote (`ThreadProfile.stop`)
        self._orders: deque[tuple[str, Future]] = deque()  # profile starts and stops for the worker
        self._on_step = on_step
        log.info("decoding: %s%s, %d slots of %d tokens", self.decoder.mode,
                 f" ({self.decoder.reason})" if self.decoder.reason else "", self.max_batch_size, max_length)
        if warmup_length > 0:
            captured, seconds = self.decoder.warmup(warmup_length)
            if captured:
                log.info("decoding: %d CUDA graphs (decode steps, prefills) captured for rows of up to %d tokens "
                         "in %.1f s", captured, min(warmup_length, max_length), seconds)
        self._worker = threading.Thread(target=self._loop, name="vlmctl-serve-engine", daemon=True)
        self._worker.start()

    def render(self, request: GenerationRequest) -> RenderedRequest:
        """`request` as its prompt text and media (`render_request`). Raises UsageError for a modality the model
        does not take, DataError for a media part past the request's media; the chat template's own errors
        (e.g. roles that do not alternate) as they come (jinja2's TemplateError)."""
        from vlmctl.inference.prompt import check_requests, render_request

        check_requests([request], self.family)
        return render_request(request, self.processor, self.family)

    @property
    def queued(self) -> int:
        return len(self._pending) + self.decoder.queued

    @property
    def running(self) -> int:
        """Rows being decoded now."""
        return self.decoder.running

    @property
    def batches(self) -> int:
        """Decode steps so far."""
        return self.decoder.steps

    @property
    def profiling(self) -> bool:
        """Whether `profile` may be asked (the engine was given a `profile_dir`)."""
        return self.profiler is not None

    def summary(self) -> str:
        """One line for people about decoding (`DecodeEngine.summary`)."""
        return self.decoder.summary()

    def describe(self) -> dict[str, Any]:
        """What /health reports about decoding (`DecodeEngine.describe`: mode and why, slots, steps, tokens)."""
        return {**self.decoder.describe(), "arriving": self.arriving}

    def health(self) -> dict[str, Any]:
        """/health's decoding figures: `queued`, `running` (rows), `batches` (decode steps), `rows` (summed over the
        steps), `busy_seconds` (the worker's seconds stepping the engine), where the engine runs (`engine`) and
        `describe()`."""
        return {"queued": self.queued, "running": self.running, "batches": self.batches, "rows": self.rows,
                "busy_seconds": round(self.busy_seconds, 4), "engine": self.where, **self.describe()}

    def announce(self) -> None:
        """A request is on its way (counted until one `submit(..., announced=True)` or one `withdraw()`)."""
        with self._cond:
            self.arriving += 1

    def withdraw(self) -> None:
        """An announced request will not come (it failed before it became a job)."""
        with self._cond:
            self.arriving = max(0, self.arriving - 1)

    def submit(self, job: Job, announced: bool = False) -> bool:
        """Queue `job` (`announced`: it was announced); False (nothing queued) once the engine is closing."""
        with self._cond:
            if announced:
                self.arriving = max(0, self.arriving - 1)
            if self._closing:
                return False
            job.queued_at = time.perf_counter()
            self._pending.append(job)
            self._cond.notify()
        return True

    def profile(self, action: str) -> Future:
        """Start (`"start"`) or stop (`"stop"`) recording the worker thread (module docstring); the worker does it
        before its next step. The Future's result: for a start {"recording": True, "max_seconds", "profile_dir"};
        for a stop what `ThreadProfile.stop` returns (the folder written, the seconds recorded, the GPU's busy, idle
        and waiting seconds, the idle report). It raises ProfileStateError for a start while one records, or a stop while
        none does (naming the folder of a profile that stopped itself). Raises UsageError at once without a
        `profile_dir`, ValueError for another action."""
        if self.profiler is None:
            raise UsageError("profiling is off", hint="start the server with --profile-dir DIR")
        if action not in ("start", "stop"):
            raise ValueError(f"action must be start or stop, got {action!r}")
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise UsageError("the server is shutting down")
            self._orders.append((action, future))
            self._cond.notify()
        return future

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, answer the queued and running ones, stop the worker (waiting up to `timeout` seconds)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._worker.join(timeout)

    def _idle(self) -> bool:
        return not self._pending and not self.decoder.busy and not self._closing and not self._orders

    def _loop(self) -> None:
        try:
            self._turns()
        finally:
            if self._on_step is not None:
                self._on_step()

    def _turns(self) -> None:
        while True:
            with self._cond:
                if self._idle():
                    with phase(WAIT_FOR_WORK):  # the GPU has no work: a profile's idle report counts it apart
                        while self._idle() and not (self.profiler is not None and self.profiler.expired()):
                            self._cond.wait(self.profiler.remaining() if self.profiler is not None else None)
                if self._closing and not self._pending and not self.decoder.busy:
                    if self.profiler is not None and self.profiler.active:  # what was recorded is written, not lost
                        self._stop_profile("the server stopped")
                    for _, future in self._orders:
                        future.set_exception(ProfileStateError("the server stopped"))
                    self._orders.clear()
                    return
                jobs = list(self._pending)
                self._pending.clear()
                orders = list(self._orders)
                self._orders.clear()
            for action, future in orders:
                self._profile_order(action, future)
            if self.profiler is not None and self.profiler.expired():
                self._stop_profile(f"it recorded for {self.profiler.max_seconds:g} s")
            for job in jobs:
                self._hand_over(job)
            started = time.perf_counter()
            try:
                rows = self.decoder.running
                self.decoder.step()
                self.rows += rows
            except BaseException as exc:  # noqa: BLE001 - the worker must outlive any one step
                log.exception("decoding failed")
                self.decoder.abort(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")
            self.busy_seconds += time.perf_counter() - started
            if self._on_step is not None:
                self._on_step()

    def _profile_order(self, action: str, future: Future) -> None:
        """Start or stop the profile on this (the worker's) thread; the outcome goes to `future`."""
        try:
            if action == "start":
                self.profiler.start()
                future.set_result({"recording": True, "max_seconds": self.profiler.max_seconds,
                                   "profile_dir": str(self.profiler.root)})
            elif not self.profiler.active and self.last_profile is not None and self.last_profile.get("stopped"):
                raise ProfileStateError(f"no profile is recording: the last one stopped because {self.last_profile['stopped']}; "
                                   f"it is in {self.last_profile['folder']}")
            else:
                self.last_profile = self.profiler.stop()
                future.set_result(self.last_profile)
        except Exception as exc:  # noqa: BLE001 - the caller's to report (a start while recording, a full disk)
            future.set_exception(exc)

    def _stop_profile(self, why: str) -> None:
        """Stop a profile nobody stopped, and say where it went."""
        try:
            self.last_profile = {**self.profiler.stop(), "stopped": why}
            log.warning("profile stopped because %s: %s", why, self.last_profile["folder"])
        except Exception:  # noqa: BLE001 - the worker must outlive a profile it cannot write
            log.exception("the profile could not be written")

    def _hand_over(self, job: Job) -> None:
        if job.cancelled.is_set():  # its client left while it waited
            return job.fail(499, "the client closed the connection", "client_closed")
        try:
            self.decoder.submit(job.rendered, job.params(), n=job.n, on_event=job.sink, cancelled=job.cancelled,
                                stream=job.stream, prepared=job.prepared, submitted_at=job.queued_at)
            job.prepared = None  # the decoder's request holds them until its prefill
        except Exception as exc:  # noqa: BLE001 - a job the engine refuses (n over the slots) fails alone
            job.fail(400, str(getattr(exc, "message", exc)), "invalid_request")


__all__ = ["Engine", "Event", "Job", "Sink"]
