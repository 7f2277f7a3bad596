"""One model answering many requests: a queue, and a worker thread that batches compatible requests.

    engine = Engine(model, processor, max_batch_size=8, max_length=4096)
    job = Job(request, n=1, max_tokens=64, temperature=0.0, top_p=1.0, seed=None, stop=[], sink=events.append)
    engine.submit(job)       # events arrive on `sink` from the worker thread
    engine.close()           # answers what is queued, then stops the worker

The worker takes the oldest queued job and every later one it can share a `model.generate` call with (greedy
jobs together; sampling jobs with the same temperature and top_p; a seeded job alone, so its seed decides its
tokens), up to `max_batch_size` rows (a job of `n` choices is `n` rows). Requests the server has received but not yet
rendered are announced (`announce`); while any is on its way and the batch has room, the worker waits for it, up
to `batch_window_s` seconds. It also waits, as long, until the batch holds as many rows as the previous call had:
the clients a call answered come back at nearly the same moment, but the first one's request reaches the queue a
few milliseconds before the others are even received, and a worker that started at once would answer it alone and
the rest in the next call (four clients measured at 2 requests per call, alternating 1 and 3). A lone client (one
row per call) never waits. Prompts are rendered by the model's chat
template (`vlmctl.inference.render_request`, as `vlmctl generate` and `vlmctl chat` render them) and left-padded,
as `vlmctl.inference.generate` does, so a greedy answer equals `generate`'s for the same request (up to
floating-point ties between batch shapes). transformers' continuous batching (`generate_batch`) takes token ids
only, not images, so it is not used.

Each row stops on its own: at an end-of-sequence token of the model's generation config, at its `max_tokens`, at
one of its `stop` strings (the text before it is kept) or when its job is cancelled (a client that went away).
A job's failure never reaches another: a batch whose inputs cannot be built, or whose generation fails before any
token was sent, is run again one job at a time, so only the job at fault fails.

Events, called from the worker thread (`sink(event)`), as tuples:
- `("delta", choice, text)`: more text of choice `choice` (its leading whitespace dropped; the pieces joined equal
  the final text);
- `("done", choice, finish_reason, completion_tokens)`: `stop` (end of sequence or a stop string) or `length`;
- `("logprobs", choice, entries)`: per generated token `(token id, logprob, [(token id, logprob), ...] top)`, from
  the model's raw logits (log-softmax), when the job asked for them;
- `("end", prompt_tokens)`: the job is complete (always the last event of a job that did not fail);
- `("error", status, message, code)`: the job failed, or was cancelled before it started (499; the last event).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from vlmctl.inference.prompt import GenerationRequest, RenderedRequest

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# So are the vlmctl modules that load numpy when imported.

Event = tuple
Sink = Callable[[Event], None]


@dataclass
class Job:
    """One chat completion request to answer: the request rendered (`rendered`, by `Engine.render`), `n` choices of at
    most `max_tokens` tokens each, sampling settings (`temperature` 0: greedy), the `stop` strings, `top_logprobs`
    (None: no logprobs; else the number of alternatives per token) and where its events go (`sink`)."""

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

    def key(self) -> tuple:
        """Jobs with equal keys share one `generate` call."""
        if self.seed is not None:
            return ("seeded", id(self))
        return ("greedy",) if self.temperature == 0 else ("sample", self.temperature, self.top_p)

    def fail(self, status: int, message: str, code: str | None = None) -> None:
        self.sink(("error", status, message, code))


class _Row:
    """One choice of one job while it is generated: its tokens, the text sent so far, whether it is done.

    The text streamed is decoded incrementally (`_advance`): each token decodes only the tokens since the last
    complete character, after the ones before them for context (text-generation-inference's `decode_token`, in
    `server/text_generation_server/models/model.py`), so a row's cost per token does not grow with its length (a whole
    decode of 1,024 tokens took 0.8 ms on the CPU, paid per row and token). The final text is one whole decode, as
    `vlmctl generate`'s."""

    def __init__(self, job: Job, choice: int, tokenizer, eos: set[int]):
        self.job, self.choice, self.tok, self.eos = job, choice, tokenizer, eos
        self.tokens: list[int] = []
        self.sent = ""
        self.finish: str | None = None
        self.generated = 0  # tokens generated, the one that ended the row included
        self.decoded = ""  # text of tokens[:self._read] (`_advance`)
        self._prefix = self._read = 0
        # decoding pieces is exact where the tokenizer's decoding concatenates (byte-level BPE, SentencePiece given the
        # context tokens); one that cleans up spaces before punctuation across pieces is decoded whole each step
        self._pieces = not getattr(tokenizer, "clean_up_tokenization_spaces", False)

    @property
    def done(self) -> bool:
        return self.finish is not None or self.job.cancelled.is_set()

    def step(self, token: int) -> None:
        """Take the next generated token; send the text it completes."""
        if self.done:
            return
        self.generated += 1
        if token in self.eos:
            self._finish("stop", self._text())
            return
        self.tokens.append(token)
        text = self._advance().lstrip()
        if any(s in text for s in self.job.stop):
            whole = self._text()  # the final text, cut at its first stop string
            self._finish("stop", whole[:_first_stop(whole, self.job.stop)])
        elif len(self.tokens) >= self.job.max_tokens:
            self._finish("length", self._text())
        else:
            self._send(self._safe(text))

    def close(self) -> None:
        """Finish a row that generation left unfinished (its `max_tokens` reached on the last step)."""
        if self.finish is None and not self.job.cancelled.is_set():
            self._finish("length", self._text())

    def _text(self) -> str:
        return self.tok.decode(self.tokens, skip_special_tokens=True).lstrip()

    def _advance(self) -> str:
        """The text of the tokens so far, as a whole decode gives it (a character still partly decoded included, as
        U+FFFD), decoding only the tokens since the last complete character (class docstring)."""
        if not self._pieces:
            return self._text()
        decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        context = decode(self.tokens[self._prefix:self._read])
        window = decode(self.tokens[self._prefix:])
        tail = window[len(context):] if window.startswith(context) else decode(self.tokens[self._read:])
        if tail and not tail.endswith("\ufffd") and window.startswith(context):
            self.decoded += tail
            self._prefix, self._read = self._read, len(self.tokens)
            return self.decoded
        if len(self.tokens) - self._read > 16:  # a long run without a complete character: start again from here
            self.decoded = decode(self.tokens)
            self._prefix = self._read = len(self.tokens)
            return self.decoded
        return self.decoded + tail

    def _safe(self, text: str) -> str:
        """The part of `text` that can be sent now: not a partly decoded character, not the start of a stop string,
        no trailing whitespace (the final text is stripped)."""
        text = text.rstrip("\ufffd")
        for stop in self.job.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    text = text[:-k]
                    break
        return text.rstrip()

    def _send(self, text: str) -> None:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            self.job.sink(("delta", self.choice, text[len(self.sent):]))
            self.sent = text

    def _finish(self, reason: str, text: str) -> None:
        self._send(text.strip())
        self.finish = reason
        self.job.sink(("done", self.choice, reason, self.generated))


class Engine:
    """Answers `Job`s with one loaded model (`load_for_generation`) in a worker thread (module docstring).

    `max_batch_size`: rows per `generate` call. `max_length`: the longest prompt plus `max_tokens` a job may ask
    for, in tokens (the project's `data.max_length`); a longer one fails with 400 `context_length_exceeded`.
    `family`: the model's `FamilySpec` (default: from its config). `video`: the `data.video` settings.
    `batch_window_s`: the longest the worker waits, once it holds a job, for announced requests and for the rows
    of the previous call to join its batch (seconds; see the module docstring).
    """

    def __init__(self, model, processor, *, max_batch_size: int = 8, max_length: int = 4096, family: Any = None,
                 video: Any = None, batch_window_s: float = 0.25):
        from vlmctl.inference.prompt import model_family

        self.model, self.processor = model, processor
        self.family = family if family is not None else model_family(model)
        self.max_batch_size, self.max_length, self.video = max_batch_size, max_length, video
        tok = processor.tokenizer
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._arriving = 0  # requests announced and not yet submitted or withdrawn
        self.batch_window_s = batch_window_s
        self.running = 0  # rows being generated now
        self.batches = 0  # `generate` calls so far
        self.rows = 0  # rows of those calls, in all
        self.generate_seconds = 0.0  # wall-clock seconds inside those calls (prefill, decoding, tokens streamed)
        self.wait_seconds = 0.0  # seconds the worker held a job while waiting for more rows (`batch_window_s`)
        self._last_rows = 1  # rows of the previous call: the clients likely to come back together
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
        return len(self._pending)

    def announce(self) -> None:
        """A request is on its way: the worker may wait for it (`batch_window_s`). Each announcement ends with one
        `submit(..., announced=True)` or one `withdraw()`."""
        with self._cond:
            self._arriving += 1

    def withdraw(self) -> None:
        """An announced request will not come (it failed before it became a job)."""
        with self._cond:
            self._arriving = max(0, self._arriving - 1)
            self._cond.notify()

    def submit(self, job: Job, announced: bool = False) -> bool:
        """Queue `job` (`announced`: it was announced); False (nothing queued) once the engine is closing."""
        with self._cond:
            if announced:
                self._arriving = max(0, self._arriving - 1)
            if self._closing:
                return False
            self._pending.append(job)
            self._cond.notify()
        return True

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, answer the queued ones, stop the worker (waiting up to `timeout` seconds)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._worker.join(timeout)

    def _take(self) -> list[Job] | None:
        """The next batch: the oldest job and the later compatible ones (module docstring); None when closed."""
        with self._cond:
            while not self._pending:
                if self._closing:
                    return None
                self._cond.wait()
            first = self._pending.popleft()
            batch, rows = [first], first.n
            start = time.monotonic()
            deadline = start + self.batch_window_s
            target = min(self._last_rows, self.max_batch_size)
            while True:
                for job in list(self._pending):
                    if job.key() == first.key() and rows + job.n <= self.max_batch_size:
                        self._pending.remove(job)
                        batch.append(job)
                        rows += job.n
                left = deadline - time.monotonic()
                settled = not self._arriving and rows >= target
                if rows >= self.max_batch_size or settled or self._closing or left <= 0:
                    self._last_rows = rows
                    self.wait_seconds += time.monotonic() - start
                    return batch
                self._cond.wait(left)

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            live = []
            for job in batch:
                if job.cancelled.is_set():  # its client left while it waited
                    job.fail(499, "the client closed the connection", "client_closed")
                else:
                    live.append(job)
            try:
                self._run(live)
            except BaseException as exc:  # noqa: BLE001 - the worker must outlive any one batch
                for job in batch:
                    job.fail(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")

    def _run(self, jobs: list[Job]) -> None:
        """Generate one batch; on a failure before any text was sent, each job again alone (module docstring)."""
        if not jobs:
            return
        from vlmctl.inference.generation import _model_inputs

        tok = self.processor.tokenizer
        rows_of = [j for j in jobs for _ in range(j.n)]
        side, tok.padding_side = tok.padding_side, "left"  # generation continues from the last position of every row
        try:
            inputs = _model_inputs(self.model, self.processor, [j.rendered.text for j in rows_of],
                                   [img for j in rows_of for img in j.rendered.images],
                                   [c for j in rows_of for c in j.rendered.audios], [v for j in rows_of for v in j.rendered.videos],
                                   self.video)
        except Exception as exc:  # noqa: BLE001 - the processor's errors are the request's
            return self._split(jobs, 400, f"the processor cannot read this request: {type(exc).__name__}: {exc}", "invalid_request")
        finally:
            tok.padding_side = side
        lengths = inputs["attention_mask"].sum(dim=1).tolist()
        starts = [sum(j.n for j in jobs[:k]) for k in range(len(jobs))]
        too_long = [j for j, s in zip(jobs, starts) if lengths[s] + j.max_tokens > self.max_length]
        for job, start in zip(jobs, starts):
            if job in too_long:
                job.fail(400, f"the prompt ({lengths[start]} tokens) plus max_tokens ({job.max_tokens}) is over the "
                         f"model's context of {self.max_length} tokens (data.max_length)", "context_length_exceeded")
        if too_long:
            return self._run([j for j in jobs if j not in too_long])
        rows = [_Row(j, c, tok, self.eos) for j in jobs for c in range(j.n)]
        try:
            out = self._generate(jobs, rows, inputs)
        except Exception as exc:  # noqa: BLE001 - handed to the jobs at fault
            if any(r.sent or r.finish for r in rows):
                for job in jobs:
                    job.fail(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")
                return
            return self._split(jobs, 500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")
        for row in rows:
            row.close()
        for job, start in zip(jobs, starts):
            if job.top_logprobs is not None and not job.cancelled.is_set():
                for row in rows[start : start + job.n]:
                    job.sink(("logprobs", row.choice, _logprobs(out, start + row.choice, row.generated, job.top_logprobs)))
            job.sink(("end", int(lengths[start])))

    def _split(self, jobs: list[Job], status: int, message: str, code: str) -> None:
        if len(jobs) == 1:
            jobs[0].fail(status, message, code)
        else:
            for job in jobs:
                self._run([job])

    def _generate(self, jobs: list[Job], rows: list[_Row], inputs: dict[str, Any]):
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        from vlmctl.inference.generation import _sampling

        class Streamer(BaseStreamer):
            prompt = True

            def put(self, value):
                if self.prompt:  # the first call hands over the prompt
                    self.prompt = False
                    return
                for row, token in zip(rows, value.view(-1).tolist()):
                    row.step(token)

            def end(self):
                pass

        class RowsDone(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.tensor([r.done for r in rows], dtype=torch.bool, device=input_ids.device)

        first = jobs[0]
        if first.seed is not None:
            torch.manual_seed(first.seed)
        logprobs = any(j.top_logprobs is not None for j in jobs)
        self.running = len(rows)
        self.batches += 1
        self.rows += len(rows)
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                return self.model.generate(**inputs, max_new_tokens=max(j.max_tokens for j in jobs),
                                           pad_token_id=self.processor.tokenizer.pad_token_id, streamer=Streamer(),
                                           stopping_criteria=StoppingCriteriaList([RowsDone()]),
                                           output_logits=logprobs, return_dict_in_generate=logprobs,
                                           **_sampling(first.temperature, first.top_p))
        finally:
            self.running = 0
            self.generate_seconds += time.perf_counter() - start


def _first_stop(text: str, stops: list[str]) -> int:
    """Where the first of `stops` begins in `text` (its length when none occurs)."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))


def _logprobs(out, row: int, steps: int, top: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token id, logprob, top alternatives) of the first `steps` generated tokens of batch row `row`, from the raw
    logits `generate` returned (`output_logits=True`): log-softmax over the vocabulary."""
    import torch

    prompt = out.sequences.shape[1] - len(out.logits)
    entries = []
    for step in range(min(steps, len(out.logits))):
        logp = torch.log_softmax(out.logits[step][row].float(), dim=-1)
        token = int(out.sequences[row, prompt + step])
        values, ids = torch.topk(logp, top) if top else (torch.empty(0), torch.empty(0, dtype=torch.long))
        entries.append((token, float(logp[token]), [(int(i), float(v)) for i, v in zip(ids, values)]))
    return entries


__all__ = ["Engine", "Event", "Job", "Sink"]
