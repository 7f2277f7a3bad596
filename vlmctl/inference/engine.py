"""The decoding engine: one model answering many requests with continuous batching over a static KV cache. `vlmctl
generate`, `eval`, `chat`, `serve` and GRPO's rollouts all decode through it.

    engine = DecodeEngine(model, processor, max_slots=32, max_length=4096)
    request = engine.submit(GenerationRequest(...), SamplingParams(max_tokens=64), n=1, on_event=print)
    while engine.busy:
        engine.step()           # admits waiting requests (prefill), then decodes one token for every running row
    request.completions[0].text

Each request is prefilled alone into a free cache slot (`runner.ModelRunner.prefill`: the family's own forward runs
the vision / audio encoders once and builds the prompt's embeddings and positions; the language model fills the
slot, in chunks for long prompts); its `n` choices copy that slot and decode side by side. Every `step()` first
admits waiting requests while slots are free, so a request that arrives while others decode starts at the next
step (`Request.admitted_step - submitted_step`), and a finished row's slot goes to the next request at once. The
decode step runs all running rows together with fixed shapes per bucket, captured in CUDA graphs on a GPU
(`runner` module docstring); each row samples with its own parameters (`sampling.SamplingParams`: temperature,
top_p, top_k, repetition penalty, seed) and stops on its own: an end-of-sequence token of the model's generation
config, its `max_tokens`, one of its `stop` strings (the text before it is kept), the cache's length, or
cancellation (`cancel`).

Events, handed to the request's `on_event` from the thread that calls `step()`, as tuples:
- `("delta", choice, text)`: more text of choice `choice` (leading whitespace dropped; the pieces joined equal the
  final text); a streamed choice sends one per generated token ("" while the token's text is held back), or one per
  `stream_interval` tokens;
- `("logprobs", choice, entries)`: per generated token `(token id, logprob, [(token id, logprob), ...] top)`, when
  asked (`SamplingParams.logprobs`), just before the choice's `done`;
- `("done", choice, finish_reason, completion_tokens)`: `stop` (end of sequence or a stop string) or `length`;
- `("end", prompt_tokens)`: every choice is done (the last event of a request that did not fail);
- `("error", status, message, code)`: the request failed (400: the processor cannot read it or it does not fit the
  context; 499: cancelled, before it started or while it decoded: the only event after `cancel`; 500: the model
  failed on it). Other requests are not affected. Every request ends with one `end` or one `error`.

Log-probabilities are those of the model's raw distribution (`logprobs="raw"`, what OpenAI's API returns), or of
the temperature-scaled one the row sampled from (`logprobs="sampled"`, what a GRPO trainer scores its rollouts
under).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from vlmctl.errors import UsageError
from vlmctl.inference.inputs import to_device, to_host
from vlmctl.inference.prompt import GenerationRequest, RenderedRequest
from vlmctl.inference.sampling import SamplingParams
from vlmctl.profiling import phase

if TYPE_CHECKING:
    import torch

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.

Event = tuple
OnEvent = Callable[[Event], None]


@dataclass
class Completion:
    """One choice of a request: its generated token ids (the end-of-sequence token excluded), its text (decoded
    without special tokens, stripped, cut before a stop string), why it ended, the tokens generated (the
    end-of-sequence token counted), the token that ended it (`stop_token`, when one did) and, when asked, one
    `(token id, logprob, top)` entry per generated token."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    generated: int = 0
    logprobs: list[tuple[int, float, list]] | None = None
    stop_token: int | None = None  # the end-of-sequence (or stop) token that ended it, not in `token_ids`


@dataclass(eq=False)
class Request:
    """A submitted request: what it asks (`prompt`, `params`, `n`), where its events go (`on_event`), and, as the
    engine works, its prompt length and token ids (`prompt_tokens`, `prompt_ids`, as the processor wrote them),
    choices (`completions`), failure (`error`: (status, message,
    code)), the engine steps it was submitted and admitted at, and when it was submitted and got its first token
    (`time.perf_counter` seconds: `first_token_at - submitted_at` is its time to first token)."""

    prompt: GenerationRequest | RenderedRequest
    params: SamplingParams
    n: int = 1
    on_event: OnEvent | None = None
    id: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)
    prompt_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    error: tuple[int, str, str | None] | None = None
    stream: bool = True
    submitted_step: int = 0
    admitted_step: int | None = None
    finished: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None  # perf_counter seconds when its first tokens reached the host
    prepared: dict[str, Any] | None = None  # the processor's tensors for its prompt alone (`DecodeEngine.submit`)

    def emit(self, event: Event) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def fail(self, status: int, message: str, code: str | None = None) -> None:
        self.error, self.finished = (status, message, code), True
        self.emit(("error", status, message, code))

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]


class _Launched(NamedTuple):
    """A decode step launched: the choices it decodes [(slot, choice)], its tokens on their way to the host (a
    buffer [rows] and the CUDA event after which it holds them, or None) and the logprob entries per slot."""

    live: list
    tokens: tuple
    entries: dict


class _Choice:
    """One choice while it is generated: its slot, cache length and text (streamed text decoded incrementally: each
    token decodes only the tokens since the last complete character, after the ones before them for context,
    text-generation-inference's `decode_token` in `server/text_generation_server/models/model.py`, so a row's cost
    per token does not grow with its length; the final text is one whole decode)."""

    def __init__(self, request: Request, index: int, slot: int, tokenizer, eos: set[int], interval: int = 1):
        self.request, self.index, self.slot, self.tok, self.eos = request, index, slot, tokenizer, eos
        self.interval = interval  # a streamed choice's text goes out at its first token and every `interval`-th
        self.out = Completion(logprobs=[] if request.params.logprobs is not None else None)
        request.completions.append(self.out)
        self.length = 0  # cache positions used (prompt + generated tokens fed back)
        self.inflight = 0  # decode steps launched whose token it has not taken yet (0 or 1)
        self.sent = ""
        self.decoded = ""  # text of tokens[:self._read] (`_advance`)
        self._prefix = self._read = 0
        # decoding pieces is exact where the tokenizer's decoding concatenates (byte-level BPE, SentencePiece given the
        # context tokens); one that cleans up spaces before punctuation across pieces is decoded whole each step
        self._pieces = not getattr(tokenizer, "clean_up_tokenization_spaces", False)

    @property
    def done(self) -> bool:
        return self.out.finish_reason is not None

    def take(self, token: int, logprob: tuple | None, max_len: int) -> None:
        """Take the next generated token (and its logprob entry); send the text it completes; finish when it ends."""
        params, out = self.request.params, self.out
        out.generated += 1
        if out.logprobs is not None and logprob is not None:
            out.logprobs.append(logprob)
        if (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids:
            out.stop_token = token
            return self._finish("stop", self._text())
        out.token_ids.append(token)
        text = self._advance().lstrip() if params.stop or self.request.stream else ""
        if params.stop and any(s in text for s in params.stop):
            whole = self._text()  # the final text, cut at its first stop string
            return self._finish("stop", whole[:_first_stop(whole, params.stop)])
        if len(out.token_ids) >= params.max_tokens or self.length >= max_len:
            return self._finish("length", self._text())
        due = self.interval == 1 or out.generated == 1 or out.generated % self.interval == 0
        if self.request.stream and due and not self._send(self._safe(text)):
            # a token whose text is held back (a partial character, a stop string's start, trailing space) still
            # reaches the client, as an empty delta: its time to first token and the stream's pace stay visible
            self.request.emit(("delta", self.index, ""))

    def _text(self) -> str:
        return self.tok.decode(self.out.token_ids, skip_special_tokens=True).lstrip()

    def _advance(self) -> str:
        """The text of the tokens so far, as a whole decode gives it (a character still partly decoded included, as
        U+FFFD), decoding only the tokens since the last complete character (class docstring)."""
        tokens = self.out.token_ids
        if not self._pieces:
            return self._text()
        decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        context = decode(tokens[self._prefix:self._read])
        window = decode(tokens[self._prefix:])
        tail = window[len(context):] if window.startswith(context) else decode(tokens[self._read:])
        if tail and not tail.endswith("\ufffd") and window.startswith(context):
            self.decoded += tail
            self._prefix, self._read = self._read, len(tokens)
            return self.decoded
        if len(tokens) - self._read > 16:  # a long run without a complete character: start again from here
            self.decoded = decode(tokens)
            self._prefix = self._read = len(tokens)
            return self.decoded
        return self.decoded + tail

    def _safe(self, text: str) -> str:
        """The part of `text` that can be sent now: not a partly decoded character, not the start of a stop string,
        no trailing whitespace (the final text is stripped)."""
        text = text.rstrip("\ufffd")
        for stop in self.request.params.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    text = text[:-k]
                    break
        return text.rstrip()

    def _send(self, text: str, final: bool = False) -> bool:
        """Send what `text` adds to the text sent so far (as it grows when streaming; once, whole, at the end when
        not). Returns whether anything was sent."""
        if (self.request.stream or final) and len(text) > len(self.sent) and text.startswith(self.sent):
            self.request.emit(("delta", self.index, text[len(self.sent):]))
            self.sent = text
            return True
        return False

    def _finish(self, reason: str, text: str) -> None:
        self.out.text = text.strip()
        self._send(self.out.text, final=True)
        self.out.finish_reason = reason
        if self.out.logprobs is not None:
            self.request.emit(("logprobs", self.index, list(self.out.logprobs)))
        self.request.emit(("done", self.index, reason, self.out.generated))


def _first_stop(text: str, stops: Sequence[str]) -> int:
    """Where the first of `stops` begins in `text` (its length when none occurs)."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))


def model_defaults(model) -> dict[str, Any]:
    """The sampling settings a model's generation config sets on purpose (`repetition_penalty`, `top_k`), which
    transformers' `generate` applies to every call: {} when it sets none. Values equal to transformers' own defaults
    are not counted (a top_k of 50 nobody chose does not cut every sampled row)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    try:
        chosen = config.to_diff_dict()
    except Exception:  # noqa: BLE001 - a config that cannot diff itself sets nothing we can trust
        return {}
    out: dict[str, Any] = {}
    if chosen.get("repetition_penalty") not in (None, 1.0):
        out["repetition_penalty"] = float(chosen["repetition_penalty"])
    if chosen.get("top_k"):
        out["top_k"] = int(chosen["top_k"])
    return out


def eos_ids(model, tokenizer) -> set[int]:
    """The end-of-sequence token ids of the model's generation config (what `generate` stops at); the tokenizer's
    EOS token when the config names none."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])


class DecodeEngine:
    """Continuous batching over one loaded model (module docstring).

    `model`, `processor`: as `load_for_generation` returns them (or a policy being trained, see GRPO's rollouts).
    `family`: its `FamilySpec` (default: from its config). `max_slots`: rows decoded at once (the KV cache's
    slots; on a GPU at most what half its free memory holds). `max_length`: the longest prompt + answer a row may
    reach, in tokens (cache positions per slot). `video`: the `data.video` settings videos are sampled by.
    `graphs`, `kernels`, `prefill_chunk`, `fuse`, `prefill_graphs`, `encoder_graphs`: see `runner.ModelRunner`. `overlap`: launch each decode step before
    taking the tokens of the one before it, so the host's work per token (stops, text, events) runs while the GPU
    decodes (`_decode`). `prefill_batch`: prompts prefilled together in
    one forward (right-padded to the longest). `suppress_tokens`: ids never sampled (GRPO:
    media placeholders). `logprobs`: "raw" or "sampled" (module docstring). `strict_context`: refuse (400) a request
    whose prompt plus `max_tokens` is over `max_length` (else its choices end with "length" there). `max_context`:
    how far `max_length` may grow for a longer request (the cache is enlarged; None: it never grows). `stream_interval`: a
    streamed choice sends its text at its first token, then every this many tokens, and at its end (SGLang's
    `--stream-interval`): fewer, longer deltas for clients that parse every chunk; 1: every token. Raises UsageError
    for a non-positive `max_slots`, `max_length` or `stream_interval`, ModelError for a model whose language model
    cannot be found.
    """

    def __init__(self, model, processor, *, family: Any = None, max_slots: int = 32, max_length: int = 4096, video: Any = None,
                 graphs: bool | None = None, kernels: str | None = None, prefill_chunk: int = 4096, prefill_batch: int = 16,
                 suppress_tokens: Sequence[int] = (), logprobs: str = "raw", strict_context: bool = True,
                 max_context: int | None = None, overlap: bool = True, fuse: bool = True, prefill_graphs: bool | None = None,
                 encoder_graphs: bool | None = None, stream_interval: int = 1):
        from vlmctl.inference.kv_cache import bytes_per_token
        from vlmctl.inference.prompt import model_family
        from vlmctl.inference.runner import ModelRunner, kv_budget_slots

        if max_slots < 1 or max_length < 2:
            raise UsageError(f"the engine needs at least one slot and two positions, got {max_slots} and {max_length}",
                             hint="e.g. --batch-size 8")
        if logprobs not in ("raw", "sampled"):
            raise UsageError(f"logprobs must be 'raw' or 'sampled', got {logprobs!r}")
        if int(stream_interval) < 1:
            raise UsageError(f"the stream interval must be at least one token, got {stream_interval}", hint="e.g. --stream-interval 1")
        self.stream_interval = int(stream_interval)
        self.model, self.processor, self.video = model, processor, video
        self.family = family if family is not None else model_family(model)
        # a prompt batch's position ids computed on the host where the family can (`FamilySpec.prompt_positions`)
        hook = getattr(self.family, "prompt_positions", None)
        self._host_positions = hook(model) if hook is not None else None
        self.tok = processor.tokenizer
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.eos = eos_ids(model, self.tok)
        self.defaults = model_defaults(model)
        self.logprobs_mode = logprobs
        self.strict_context = strict_context
        self.max_context = max_context
        device = next(model.parameters()).device
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        dtype_bytes = next(model.parameters()).element_size()
        slots = max_slots
        if device.type == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(device)
            slots = kv_budget_slots(free // 2, bytes_per_token(config, dtype_bytes), max_length, max_slots)
        self.max_length = int(max_length)
        self.runner = ModelRunner(model, self.family, slots=slots, max_len=self.max_length, graphs=graphs, kernels=kernels,
                                  prefill_chunk=prefill_chunk, suppress=tuple(suppress_tokens), fuse=fuse,
                                  prefill_graphs=prefill_graphs, encoder_graphs=encoder_graphs)
        self.prefill_batch = max(1, int(prefill_batch))
        self.slots: list[_Choice | None] = [None] * slots
        self._incoming: deque[Request] = deque()
        self._waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self.steps = 0  # decode steps run
        self.prefills = 0
        self.tokens_generated = 0
        self.prefill_seconds = 0.0  # in the runner's prefill and the first tokens' draw
        self.inputs_seconds = 0.0  # in the processor and the inputs' copy to the device, at admission
        self.collated = 0  # admissions whose inputs were batched from tensors prepared before submission
        self.collated_positions = 0  # of those, the admissions whose position ids were prepared too (none computed here)
        self.admitted = 0  # requests taken from the queue into a prefill
        self.queue_seconds = 0.0  # their waits, from `Request.submitted_at` to the start of their prefill
        self.decode_seconds = 0.0
        self.overlap = bool(overlap)
        self.overlapped = 0  # decode steps launched before the tokens of the step before them were taken
        self._pending: _Launched | None = None  # the step launched last, its tokens not taken yet
        self._pinned: list | None = None
        # first tokens sampled on the device and fed to the next step there, read back with it (`_defer_first`)
        self.defer_first = True
        self._firsts: list[tuple[list[_Choice], tuple]] = []
        self.deferred_first = 0  # admissions whose first tokens were read back after the next step's launch

    # ---- what the engine does and holds

    @property
    def mode(self) -> str:
        """How decode steps run: "cuda-graphs" or "eager" (`reason` says why not graphs)."""
        return self.runner.mode

    @property
    def reason(self) -> str:
        return self.runner.reason

    @property
    def max_slots(self) -> int:
        return len(self.slots)

    @property
    def running(self) -> int:
        """Choices being decoded now."""
        return sum(c is not None for c in self.slots)

    @property
    def queued(self) -> int:
        """Requests submitted and not yet admitted."""
        return len(self._incoming) + len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.queued)

    def summary(self) -> str:
        """One line for people: "CUDA graphs, liger kernels, 32 slots of 4,096 tokens" or "eager (not a CUDA device),
        8 slots of 2,048 tokens"."""
        how = "CUDA graphs" if self.mode == "cuda-graphs" else f"eager ({self.reason})" if self.reason else "eager"
        kernels = f", {self.runner.kernels} kernels" if self.runner.kernels != "none" else ""
        return f"{how}{kernels}, {self.max_slots} slots of {self.max_length:,} tokens"

    def describe(self) -> dict[str, Any]:
        """What /health and the logs report: mode (and why), slots, cache positions, steps, tokens."""
        return {"decode": self.mode, **({"decode_reason": self.reason} if self.reason else {}), "kernels": self.runner.kernels,
                "slots": self.max_slots,
                "max_length": self.max_length, "cuda_graphs": self.runner.graph_count, "decode_steps": self.steps,
                "overlapped_steps": self.overlapped,
                "prefills": self.prefills, "prefill_seconds": round(self.prefill_seconds, 4),
                "inputs_seconds": round(self.inputs_seconds, 4), "decode_seconds": round(self.decode_seconds, 4),
                "collated_prefills": self.collated, "collated_positions": self.collated_positions,
                "merged_prefills": self.runner.merged_prefills, "deferred_first_tokens": self.deferred_first,
                "admitted_requests": self.admitted,
                "queue_seconds": round(self.queue_seconds, 4),
                "prefill_graph_replays": self.runner.prefill_graphs,
                **({"prefill_reason": self.runner.prefill_reason} if self.runner.prefill_reason else {}),
                **({"encoders_varlen": self.runner.encoders_varlen} if self.runner.encoders_varlen else {}),
                **({"rope_routed": self.runner.rope_routed} if self.runner.rope_routed else {}),
                **{f"{name}_encoder_graph_replays": g.replays for name, g in self.runner.encoder_graphs.items()},
                **{f"{name}_encoder_new_layouts": g.new_layouts for name, g in self.runner.encoder_graphs.items()},
                **{f"{name}_encoder_graph_reason": g.reason for name, g in self.runner.encoder_graphs.items() if g.reason},
                "tokens_generated": self.tokens_generated}

    def warmup(self, up_to: int) -> tuple[int, float]:
        """Capture, before requests come, the CUDA graphs that rows of at most `up_to` cached positions (prompt and
        answer, tokens) would otherwise meet for the first time while other rows wait: the decode step of every
        row bucket (`ModelRunner.capture_decode`) and the padded prefill of every (rows, length) bucket up to
        `prefill_batch` rows (`_warm_prefills`). Returns (graphs captured, seconds). Call it while no row decodes;
        a no-op off CUDA."""
        started = time.perf_counter()
        before = self.runner.captures
        self.runner.capture_decode(min(int(up_to), self.max_length))
        self._warm_prefills(up_to)
        return self.runner.captures - before, time.perf_counter() - started

    def _warm_prefills(self, up_to: int) -> None:
        """Prefill a text prompt of each length bucket (`runner.PREFILL_MIN_BUCKET` doubling up to `up_to`) in each
        row bucket up to `prefill_batch` rows, `PREFILL_CAPTURE_AT` times, so each bucket's graph is captured here.
        A prefill bucket holds the language model's part of any prompt of its shape (the encoders' outputs arrive
        as embeddings), so text stands in for every modality. Buckets over `PREFILL_GRAPH_TOKENS` never run from
        a graph and are skipped, as is a length the chat template alone already passes; a family whose prefills do
        not run padded (extra inputs for its language model) stops after the first."""
        from vlmctl.inference.runner import PREFILL_CAPTURE_AT, PREFILL_GRAPH_TOKENS, PREFILL_MIN_BUCKET

        runner = self.runner
        if not (runner.use_graphs and runner.pad_prefill):
            return
        longest = min(int(up_to), self.max_length - 1, runner.prefill_chunk)
        most = min(self.prefill_batch, self.max_slots)
        width = PREFILL_MIN_BUCKET
        while width <= longest and runner.use_graphs and runner.pad_prefill:
            try:
                prompt = self._prompt_of(width)
            except Exception:  # noqa: BLE001 - a chat template that refuses the filler: no warm-up, serving goes on
                return
            rows = 1
            while prompt is not None and rows <= most and rows * width <= PREFILL_GRAPH_TOKENS:
                for _ in range(PREFILL_CAPTURE_AT):
                    padded = runner.padded_prefills
                    self.generate([prompt] * rows, SamplingParams(max_tokens=1, ignore_eos=True))
                    if runner.padded_prefills == padded:  # this family's prefills do not run padded: nothing to warm
                        return
                rows *= 2
            width *= 2

    def _prompt_of(self, width: int) -> GenerationRequest | None:
        """A text request whose rendered prompt takes more than `width` / 2 and at most `width` tokens (None when
        the chat template alone takes more)."""
        from vlmctl.inference.prompt import render_request
        from vlmctl.inference.runner import PREFILL_MIN_BUCKET

        def tokens(words: int) -> tuple[GenerationRequest, int]:
            request = GenerationRequest(messages=[{"role": "user", "content": [{"type": "text", "text": " ".join(["warm"] * words)}]}])
            return request, len(self.tok(render_request(request, self.processor, self.family).text,
                                         add_special_tokens=False)["input_ids"])

        base = tokens(0)[1]  # the chat template's own tokens
        if base > width:
            return None
        per = max((tokens(8)[1] - base) / 8, 1e-3)  # tokens per word of the filler
        words = max(0, int((3 * width // 4 - base) / per))
        for _ in range(8):  # the estimate, then a few corrections into the window
            request, n = tokens(words)
            if width // 2 < n <= width or (width == PREFILL_MIN_BUCKET and n <= width):
                return request
            words = max(0, words + int((3 * width // 4 - n) / per) or (1 if n <= width // 2 else -1))
        return None

    # ---- requests

    def submit(self, prompt: GenerationRequest | RenderedRequest, params: SamplingParams | None = None, *, n: int = 1,
               on_event: OnEvent | None = None, id: str = "", stream: bool = True,
               cancelled: threading.Event | None = None, prepared: dict[str, Any] | None = None,
               submitted_at: float | None = None) -> Request:
        """Queue a request (thread-safe); it is admitted at a coming `step()`. A `GenerationRequest` is rendered by
        the chat template at admission (`render_request`). `stream`: send `delta` events as the text grows (else only
        the final text, in `completions`). `cancelled`: an event whose setting cancels the request (default: a new
        one, set by `cancel`). `prepared`: the processor's tensors for this prompt alone, on the host
        (`inputs.processor_inputs` of its rendered text and media), made before it was submitted: where the family
        batches such tensors (`FamilySpec.collate_prompts`) and every prompt of an admission has them, they are batched
        (`inputs.collate_inputs`) instead of calling the processor at admission; it may also hold the prompt's
        `position_ids` ([..., 1, T], the family's `prompt_positions` of it alone), used in place of computing them at
        admission. `submitted_at`: the `time.perf_counter` seconds the request counts its wait from (default: now; a
        server passes when the request reached its queue).
        Raises UsageError for `n` outside [1, max_slots]."""
        if not 1 <= n <= self.max_slots:
            raise UsageError(f"n must be between 1 and the engine's {self.max_slots} slots, got {n}", hint="ask for fewer choices")
        params = params if params is not None else SamplingParams()
        request = Request(prompt, params, n=n, on_event=on_event, id=id or getattr(prompt, "id", ""), stream=stream,
                          submitted_step=self.steps, prepared=prepared,
                          **({"submitted_at": submitted_at} if submitted_at is not None else {}),
                          **({"cancelled": cancelled} if cancelled is not None else {}))
        with self._lock:
            self._incoming.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop generating for `request` (thread-safe): its slots are freed at the next step, and its last event is
        `("error", 499, ...)`."""
        request.cancelled.set()

    def abort(self, status: int, message: str, code: str | None = None) -> None:
        """Fail every running and waiting request (after a step that failed for all of them) and free every slot."""
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
        failed = {id(c.request): c.request for c in self.slots if c is not None}
        failed.update({id(r): r for r in self._waiting})
        self._waiting.clear()
        self._pending = None
        self._firsts.clear()
        for slot in range(len(self.slots)):
            self.slots[slot] = None
            self.runner.release(slot)
        for request in failed.values():
            if not request.finished:
                request.fail(status, message, code)

    def generate(self, prompts: Sequence[GenerationRequest | RenderedRequest], params: SamplingParams | Sequence[SamplingParams],
                 *, n: int = 1, progress: Callable[[int, int], None] | None = None) -> list[Request]:
        """Submit every prompt (with `params`, one for all or one each) and step until all are done; the requests in
        prompt order. `progress(done, total)` after each finished request."""
        many = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        done = [0]

        def counter(event: Event) -> None:
            if event[0] in ("end", "error"):
                done[0] += 1
                if progress:
                    progress(done[0], len(prompts))

        requests = [self.submit(p, q, n=n, on_event=counter, stream=False) for p, q in zip(prompts, many)]
        while any(not r.finished for r in requests):
            self.step()
        self.settle()
        return requests

    # ---- the loop

    def step(self) -> None:
        """Admit what waits while slots are free (prefill), then decode one token for every running choice."""
        import torch

        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
        with torch.inference_mode():  # every buffer the engine touches is written under it
            self._drop_cancelled()
            if self._waiting:
                with phase("engine.admit"):
                    self._admit()
            if self.running:
                self._decode()

    def _drop_cancelled(self) -> None:
        for slot, choice in enumerate(self.slots):
            if choice is not None and choice.request.cancelled.is_set():
                self._free(slot)
        for request in [r for r in self._waiting if r.cancelled.is_set()]:
            self._waiting.remove(request)
            request.fail(499, "the request was cancelled before it started", "client_closed")

    def _free(self, slot: int) -> None:
        choice = self.slots[slot]
        self.slots[slot] = None
        self.runner.release(slot)
        request = choice.request if choice is not None else None
        if request is None or request.finished:
            return
        if request.cancelled.is_set():
            if not any(c is not None and c.request is request for c in self.slots):  # its last row: say it ended
                request.fail(499, "the request was cancelled while it was decoded", "client_closed")
        elif len(request.completions) == request.n and all(c.finish_reason for c in request.completions):
            self._end(request)

    def _end(self, request: Request) -> None:
        request.finished = True
        request.emit(("end", request.prompt_tokens))

    def _admit(self) -> None:
        """Prefill waiting requests, oldest first, while their choices fit the free slots (`prefill_batch` prompts
        per forward)."""
        while self._waiting:
            free = [i for i, c in enumerate(self.slots) if c is None]
            batch: list[Request] = []
            while self._waiting and len(batch) < self.prefill_batch and sum(r.n for r in batch) + self._waiting[0].n <= len(free):
                batch.append(self._waiting.popleft())
            if not batch:
                return
            now = time.perf_counter()
            self.admitted += len(batch)
            self.queue_seconds += sum(now - r.submitted_at for r in batch)
            self._start(batch)

    def _render(self, request: Request) -> RenderedRequest | None:
        """The request's prompt rendered by the chat template, or None after failing it (400)."""
        from vlmctl.errors import VlmctlError
        from vlmctl.inference.prompt import check_requests, render_request

        prompt = request.prompt
        if isinstance(prompt, RenderedRequest):
            return prompt
        try:
            check_requests([prompt], self.family)
            return render_request(prompt, self.processor, self.family)
        except VlmctlError as exc:
            request.fail(400, exc.message, "invalid_request")
        except Exception as exc:  # noqa: BLE001 - the chat template's own refusals are the request's
            request.fail(400, f"the model's chat template refuses this request: {type(exc).__name__}: {exc}", "invalid_request")
        return None

    def _inputs(self, rendered: list[RenderedRequest], prepared: list[dict[str, Any] | None] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
        """The processor's tensors for `rendered` prompts, padded on the right (every row's tokens start at 0): on the
        model's device, and on the host (with the position ids the family computes there, `FamilySpec.prompt_positions`).
        `prepared`: each prompt's own tensors where they were made before submission (`submit`), batched without
        the processor where the family allows (`FamilySpec.collate_prompts`); with every prompt's `position_ids`
        among them ([..., 1, T], its `prompt_positions` computed alone: `serve.prepare`), batched too
        (`collate_positions`) instead of computed here."""
        from vlmctl.inference.inputs import collate_inputs, collate_positions, processor_inputs, to_model

        host = None
        if prepared and all(p is not None for p in prepared) and getattr(self.family, "collate_prompts", False):
            items = [dict(p) for p in prepared]
            positions = [item.pop("position_ids", None) for item in items]  # computed alone, where the family can
            host = collate_inputs(items, self.tok.pad_token_id)
            if host is not None:
                self.collated += 1
                if self._host_positions is not None and all(p is not None for p in positions):
                    batch = collate_positions(positions, int(host["input_ids"].shape[1]))
                    if batch is not None:
                        host["position_ids"] = batch
                        self.collated_positions += 1
        if host is None:
            side, self.tok.padding_side = self.tok.padding_side, "right"
            try:
                host = processor_inputs(self.processor, [r.text for r in rendered], [i for r in rendered for i in r.images],
                                        [a for r in rendered for a in r.audios], [v for r in rendered for v in r.videos],
                                        self.video)
            finally:
                self.tok.padding_side = side
        if self._host_positions is not None and "position_ids" not in host:
            positions = self._host_positions(host)
            if positions is not None:
                host["position_ids"] = positions
        return to_model(self.model, host), host

    def _start(self, batch: list[Request]) -> None:
        """Prefill `batch` in one forward into slots from `free`, copy each to its other choices' slots, sample every
        choice's first token. A request the processor cannot read, or that does not fit the context, fails alone;
        when the batch's forward fails, each request is tried again alone."""
        from vlmctl.errors import VlmctlError

        pairs = [(r, p) for r in batch if (p := self._render(r)) is not None]
        if not pairs:
            return
        free = [i for i, c in enumerate(self.slots) if c is None]
        started = time.perf_counter()
        try:
            with phase("engine.inputs"):
                inputs, host = self._inputs([p for _, p in pairs], [r.prepared for r, _ in pairs])
        except Exception as exc:  # noqa: BLE001 - the processor's errors are the request's: find whose
            if len(pairs) > 1:
                for request, _ in pairs:
                    self._start([request])
                return
            message = exc.message if isinstance(exc, VlmctlError) else f"the processor cannot read this request: {type(exc).__name__}: {exc}"
            return pairs[0][0].fail(400, message, "invalid_request")
        finally:
            self.inputs_seconds += time.perf_counter() - started
        width = int(inputs["input_ids"].shape[1])
        refused = [r for r, _ in pairs if not self._fits(r, width)]
        if refused:
            for request in [r for r, _ in pairs if r not in refused]:
                self._start([request])
            return
        slots, at = [], 0
        for request, _ in pairs:
            slots.append(free[at:at + request.n])
            at += request.n
        started = time.perf_counter()
        try:
            with phase("engine.prefill"):
                out = self.runner.prefill(inputs, [s[0] for s in slots], host)
                for own, end in zip(slots, out.ends):
                    for slot in own[1:]:
                        self.runner.cache.copy_slot(own[0], slot, end)
            for b, (request, _) in enumerate(pairs):
                request.prompt_tokens, request.admitted_step = int(out.tokens[b]), self.steps
                request.prompt_ids = host["input_ids"][b, out.first[b]:out.ends[b]].tolist()
            with phase("engine.first_tokens"):
                self._first_tokens([r for r, _ in pairs], slots, out)
        except Exception as exc:  # noqa: BLE001 - the model's failure on a request is that request's
            for request, own in zip((r for r, _ in pairs), slots):
                for slot in own:
                    if self.slots[slot] is not None and self.slots[slot].request is request:
                        self.slots[slot] = None
                        self.runner.release(slot)
            if len(pairs) > 1:
                for request, _ in pairs:
                    request.completions.clear()
                    self._start([request])
                return
            request = pairs[0][0]
            request.completions.clear()
            return request.fail(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")
        finally:
            self.prefills += 1
            self.prefill_seconds += time.perf_counter() - started
        for request, _ in pairs:
            request.prepared = None  # in its cache now: the prompt's tensors are not read again
            if not request.finished and all(c.finish_reason for c in request.completions):
                self._end(request)

    def _fits(self, request: Request, length: int) -> bool:
        """Whether a prompt taking `length` cache positions (its padded row) and, with `strict_context`, its
        `max_tokens` fit the context, the cache grown up to `max_context` where allowed; fails the request (400)
        otherwise."""
        from vlmctl.inference.runner import bucket

        need = length + request.params.max_tokens
        if need > self.max_length and self.max_context and self.max_length < self.max_context:
            try:
                self.runner.grow(bucket(need, self.max_context, self.max_length))
                self.max_length = self.runner.max_len
            except Exception as exc:  # noqa: BLE001 - out of memory: the request fails below, the others go on
                request.fail(400, f"the cache cannot grow to {need} positions for this request: {type(exc).__name__}: {exc}",
                             "context_length_exceeded")
                return False
        if length >= self.max_length:
            request.fail(400, f"the prompt ({length} tokens) does not fit the model's context of {self.max_length} tokens",
                         "context_length_exceeded")
            return False
        if self.strict_context and need > self.max_length:
            request.fail(400, f"the prompt ({length} tokens) plus max_tokens ({request.params.max_tokens}) is over the model's "
                         f"context of {self.max_length} tokens", "context_length_exceeded")
            return False
        return True

    def _first_tokens(self, requests: list[Request], slots: list[list[int]], out) -> None:
        """Sample the first token of every choice of `requests` (prefilled together: `out`, the runner's `Prefilled`;
        `slots[b]`: request b's choices' slots) in one draw and one read-back, then admit the choices that go on into
        their slots. Each choice's token depends on its own row and parameters alone (`sampling.sample`), so this is
        what drawing each request apart gives."""
        import torch

        from vlmctl.inference.sampling import sample

        dev = out.logits.device
        params = [self._params(r) for r in requests]
        bases = [p.seed if p.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()) for p in params]
        owner = [b for b, own in enumerate(slots) for _ in own]  # the request of each choice, in order
        seeds = [(bases[b] + c) & 0x7FFFFFFF for b, own in enumerate(slots) for c in range(len(own))]
        column = lambda values, dtype: to_device(torch.tensor(values, dtype=dtype), dev)  # noqa: E731
        rows = out.logits[column(owner, torch.long)].float()
        seen = None
        if any(p.repetition_penalty != 1 for p in params):
            seen = torch.zeros(len(owner), rows.shape[1], dtype=torch.bool, device=dev)
            for i, b in enumerate(owner):
                if params[b].repetition_penalty != 1:
                    seen[i, column(requests[b].prompt_ids, torch.long)] = True
        first = sample(rows, column([params[b].temperature for b in owner], torch.float32),
                       column([params[b].top_p for b in owner], torch.float32), column([params[b].top_k for b in owner], torch.long),
                       column(seeds, torch.long), torch.zeros(len(owner), dtype=torch.long, device=dev),
                       penalty=column([params[b].repetition_penalty for b in owner], torch.float32), seen=seen,
                       suppress=self.runner.suppress, greedy_only=all(p.greedy for p in params))
        if self.defer_first and seen is None and all(p.logprobs is None for p in params):
            return self._defer_first(requests, slots, out, params, seeds, first)
        entries: list = [None] * len(owner)
        at = 0
        for b, own in enumerate(slots):
            if params[b].logprobs is not None:
                entries[at:at + len(own)] = self._logprob_entries(rows[at:at + len(own)], first[at:at + len(own)], params[b], len(own))
            at += len(own)
        tokens = first.tolist()
        now = time.perf_counter()
        admitted: list[tuple[int, int, int]] = []  # (choice index, slot, request index) of the choices that go on
        at = 0
        for b, (request, own) in enumerate(zip(requests, slots)):
            request.first_token_at = now
            for c, slot in enumerate(own):
                i = at + c
                choice = _Choice(request, c, slot, self.tok, self.eos, self.stream_interval)
                choice.length = out.ends[b]
                choice.take(int(tokens[i]), entries[i], self.max_length)
                self.tokens_generated += 1
                if not choice.done:
                    self.slots[slot] = choice
                    admitted.append((i, slot, b))
            at += len(own)
        if not admitted:
            return
        marks = [(torch.tensor(requests[b].prompt_ids + [tokens[i]], dtype=torch.long)
                  if params[b].repetition_penalty != 1 else None) for i, _, b in admitted]
        self.runner.admit_rows([s for _, s, _ in admitted], [tokens[i] for i, _, _ in admitted],
                               [out.positions[b] for _, _, b in admitted], [out.ends[b] for _, _, b in admitted],
                               temperature=[params[b].temperature for _, _, b in admitted],
                               top_p=[params[b].top_p for _, _, b in admitted], top_k=[params[b].top_k for _, _, b in admitted],
                               penalty=[params[b].repetition_penalty for _, _, b in admitted],
                               seeds=[seeds[i] for i, _, _ in admitted], steps=[1] * len(admitted), seen=marks,
                               first=[out.first[b] for _, _, b in admitted])

    def _defer_first(self, requests: list[Request], slots: list[list[int]], out, params: list[SamplingParams],
                     seeds: list[int], first: "torch.Tensor") -> None:
        """Admit every choice of `requests` with its first token `first` [choices] as the device holds it: the next
        decode step reads it there, and the host takes it (`_take_firsts`) once that step is launched, so an
        admission never waits for the device (reading the tokens here would wait for the prefill and the decode
        step in flight, and leave the GPU idle while the host admits). A choice that its first token ends (an
        end-of-sequence token, `max_tokens=1`) decodes one token that is dropped. Not for choices that ask for
        logprobs or a repetition penalty, whose first token the host needs now (`_first_tokens`)."""
        choices: list[_Choice] = []
        where: list[tuple[int, int]] = []  # (slot, request index) of each choice, in `first`'s order
        for b, (request, own) in enumerate(zip(requests, slots)):
            for c, slot in enumerate(own):
                choice = _Choice(request, c, slot, self.tok, self.eos, self.stream_interval)
                choice.length = out.ends[b]
                self.slots[slot] = choice
                choices.append(choice)
                where.append((slot, b))
        self.runner.admit_rows([s for s, _ in where], first, [out.positions[b] for _, b in where],
                               [out.ends[b] for _, b in where], temperature=[params[b].temperature for _, b in where],
                               top_p=[params[b].top_p for _, b in where], top_k=[params[b].top_k for _, b in where],
                               penalty=[params[b].repetition_penalty for _, b in where], seeds=seeds,
                               steps=[1] * len(where), seen=[None] * len(where), first=[out.first[b] for _, b in where])
        self._firsts.append((choices, to_host(first)))
        self.deferred_first += 1

    def _take_firsts(self) -> None:
        """Hand each choice admitted by `_defer_first` its first token (before any later step's token: they were
        drawn first); a choice that ended or was cancelled since drops it. Nothing to do without any."""
        firsts, self._firsts = self._firsts, []
        for choices, (buffer, event) in firsts:
            if event is not None:
                with phase("engine.wait_for_tokens"):
                    event.synchronize()
            tokens = buffer.tolist()
            now = time.perf_counter()
            with phase("engine.take_tokens"):
                for choice, token in zip(choices, tokens):
                    choice.request.first_token_at = choice.request.first_token_at or now
                    if choice.done or self.slots[choice.slot] is not choice:
                        continue
                    choice.take(int(token), None, self.max_length)
                    self.tokens_generated += 1
                    if choice.done:
                        self._free(choice.slot)

    def _params(self, request: Request) -> SamplingParams:
        """The request's parameters with the model's generation-config defaults where the request left them unset."""
        params = request.params
        updates = {k: v for k, v in self.defaults.items() if getattr(params, k) in (0, 1.0)}
        if updates:
            from dataclasses import replace

            params = request.params = replace(params, **updates)
        return params

    def _logprob_entries(self, logits, tokens, params: SamplingParams, n: int):
        import torch

        from vlmctl.inference.sampling import logprob_entries

        temperature = None
        if self.logprobs_mode == "sampled":
            temperature = torch.full((n,), params.temperature, dtype=torch.float32, device=logits.device)
        return logprob_entries(logits, tokens, params.logprobs or 0, temperature)

    def _decode(self) -> None:
        """Launch one decode step for every running choice, then take the tokens of the step before it (`overlap`),
        or of this one when it cannot overlap: a choice asks for logprobs (read from the step's logits), or one more
        position could pass the cache's end."""
        import torch

        started = time.perf_counter()
        if not self._can_overlap():
            self.settle()
        live = [(slot, c) for slot, c in enumerate(self.slots) if c is not None]
        if not live:
            return
        rows = live[-1][0] + 1
        kv_len = max(c.length + c.inflight for _, c in live) + 1
        greedy = all(c.request.params.greedy for _, c in live)
        with phase("engine.decode_step"):
            tokens = self.runner.step(rows, kv_len, greedy)
        want = [(slot, c) for slot, c in live if c.request.params.logprobs is not None]
        entries: dict[int, tuple] = {}
        if want:
            index = to_device(torch.tensor([s for s, _ in want]), tokens.device)
            for (slot, c), entry in zip(want, self._logprob_rows(index, tokens, want)):
                entries[slot] = entry
        self.steps += 1
        for _, choice in live:
            choice.inflight += 1
        launched = _Launched(live, self._host_tokens(tokens, rows), entries)
        previous, self._pending = self._pending, launched
        self._take_firsts()  # drawn before this step was launched: their wait is for the prefill, not for this step
        if previous is not None:
            self._take(previous)
            self.overlapped += 1
        if want or not self._can_overlap():
            self.settle()
        self.decode_seconds += time.perf_counter() - started

    def _can_overlap(self) -> bool:
        """Whether one more step may be launched before the tokens of the one in flight are taken: every running
        choice then still writes inside the cache (a choice the step in flight ends decodes one wasted token)."""
        return self.overlap and all(c.length + c.inflight < self.max_length for c in self.slots if c is not None)

    def _host_tokens(self, tokens: "torch.Tensor", rows: int):
        """The step's tokens [rows] copied to the host without waiting (a pinned buffer and an event on CUDA; two
        buffers in turn, so the copy of one step never overwrites the one not yet read); on the CPU, a copy."""
        import torch

        if tokens.device.type == "cuda" and self._pinned is None:
            self._pinned = [torch.empty(len(self.slots), dtype=tokens.dtype, pin_memory=True) for _ in range(2)]
        return to_host(tokens[:rows], self._pinned[self.steps % 2][:rows] if self._pinned else None)

    def _take(self, launched: "_Launched") -> None:
        """Hand each choice of a launched step its token: a choice that ended, or whose slot went to another, since
        the step was launched drops it. The first tokens of rows admitted before it are taken first (`_decode`,
        `settle`)."""
        buffer, event = launched.tokens
        if event is not None:
            with phase("engine.wait_for_tokens"):
                event.synchronize()
        host = buffer.tolist()
        with phase("engine.take_tokens"):  # detokenizing, stop strings and each token's event
            for slot, choice in launched.live:
                choice.inflight -= 1
                if choice.done or self.slots[slot] is not choice:
                    continue
                choice.length += 1
                choice.take(host[slot], launched.entries.get(slot), self.max_length)
                self.tokens_generated += 1
                if choice.done:
                    self._free(slot)

    def settle(self) -> None:
        """Take the first tokens not yet read (`_defer_first`), then the tokens of the step still in flight, if any
        (after the last request ended: its tokens are dropped), so that the runner's buffers are no longer written."""
        import torch

        if self._firsts or self._pending is not None:
            with torch.inference_mode():
                self._take_firsts()
                if self._pending is not None:
                    self._take(self._pending)
            self._pending = None

    def _logprob_rows(self, index, tokens, want):
        from vlmctl.inference.sampling import logprob_entries

        logits = self.runner.logits[index]
        chosen = tokens[index]
        temperature = None
        if self.logprobs_mode == "sampled":
            temperature = self.runner.temperature[index]
        top = max(c.request.params.logprobs or 0 for _, c in want)
        entries = logprob_entries(logits, chosen, top, temperature)
        return [(t, lp, alts[: c.request.params.logprobs or 0]) for (t, lp, alts), (_, c) in zip(entries, want)]


def engine_for(model, processor, *, family: Any = None, max_slots: int = 8, max_length: int = 4096, video: Any = None,
               **options: Any) -> DecodeEngine:
    """The `DecodeEngine` of `model`, made once and kept on the model (its CUDA graphs and cache are reused by the
    next call) while the settings stay the same; a new one otherwise."""
    key = (id(processor), max_slots, max_length, id(video), tuple(sorted(options.items())))
    engine = getattr(model, "_vlmctl_decode_engine", None)
    if engine is not None and getattr(engine, "_key", None) == key and not engine.busy:
        return engine
    engine = DecodeEngine(model, processor, family=family, max_slots=max_slots, max_length=max_length, video=video, **options)
    engine._key = key
    try:
        object.__setattr__(model, "_vlmctl_decode_engine", engine)
    except Exception:  # noqa: BLE001 - a model that takes no attributes gets a new engine each call
        pass
    return engine


__all__ = ["Completion", "DecodeEngine", "Request", "engine_for", "eos_ids", "model_defaults"]
