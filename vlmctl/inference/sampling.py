"""Per-row sampling for the decoding engine: every row of a decode batch has its own temperature, top_p, top_k,
repetition penalty and seed, and its tokens depend on those alone, never on the rows beside it.

    params = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1)
    tokens = sample(logits, rows)        # rows: the per-row tensors of `RowParams`

Greedy rows (temperature 0) take the argmax. Sampling rows draw with the Gumbel-max trick (argmax of the
filtered, temperature-scaled logits plus Gumbel noise is a draw from their softmax; Gumbel 1954, as vLLM and
FlashInfer sample), where the noise comes from a counter-based hash of (seed, step, token id) rather than a
generator's state: a row's draw at its k-th token is the same whatever else is in the batch, which slot it sits
in, or whether the step runs eagerly or replayed from a CUDA graph. A row without a seed gets one drawn from
torch's global generator when it is admitted, so `torch.manual_seed` makes a whole run repeatable.

Filtering follows transformers' logits processors (`generation/logits_process.py`): the repetition penalty on every
token seen so far, prompt included (CTRL, arXiv 1909.05858: a positive logit divided, a negative one multiplied),
then top-k, then top-p (keep the smallest set of most likely tokens whose probability reaches top_p, at least one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmctl.errors import UsageError

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of generation.

    `max_tokens`: at most this many new tokens per choice (the end-of-sequence token counted). `temperature` 0:
    greedy; else the logits are divided by it. `top_p` in (0, 1], `top_k` (0: off), `repetition_penalty` (1: off;
    > 0). `seed`: the choices' draws (None: drawn from torch's generator at admission). `stop`: strings that end a
    choice (the text before the first one is kept). `logprobs`: None, or the number of top alternatives returned
    with each token's log-probability (0: the token's alone). `ignore_eos`: keep generating past end-of-sequence
    tokens (benchmarks). `stop_token_ids`: extra token ids that end a choice.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise UsageError(f"max_tokens must be positive, got {self.max_tokens}", hint="e.g. --max-new-tokens 32")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}", hint="0 decodes greedily")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}", hint="1 keeps the whole distribution")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0, got {self.top_k}", hint="0 keeps every token")
        if self.repetition_penalty <= 0:
            raise UsageError(f"repetition_penalty must be positive, got {self.repetition_penalty}", hint="1 turns it off")
        if self.logprobs is not None and self.logprobs < 0:
            raise UsageError(f"logprobs must be >= 0, got {self.logprobs}", hint="0 returns each token's log-probability alone")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        """Argmax decoding with nothing that changes the logits."""
        return self.temperature == 0 and self.repetition_penalty == 1


def _mix(x: "torch.Tensor") -> "torch.Tensor":
    """A 32-bit integer hash of int64 values in [0, 2^32) (lowbias32, Chris Wellons' hash-prospector), in int64 so
    every product stays under 2^63 on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: "torch.Tensor", steps: "torch.Tensor", vocab: int) -> "torch.Tensor":
    """Uniform noise [B, vocab] float32 in (0, 1) from (seed [B], step [B], token id): the same numbers for the
    same (seed, step) on any device and batch (module docstring). 24 bits of the hash, so float32 holds them
    exactly and no value is 0 or 1."""
    import torch

    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    row = _mix((_mix(seeds & _MASK32) + (steps & _MASK32) * 0x9E3779B1) & _MASK32)  # [B]
    x = _mix((row[:, None] + ids[None, :] * 0x85EBCA77) & _MASK32)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: "torch.Tensor", temperature: "torch.Tensor", top_p: "torch.Tensor", top_k: "torch.Tensor",
           seeds: "torch.Tensor", steps: "torch.Tensor", *, penalty: "torch.Tensor | None" = None,
           seen: "torch.Tensor | None" = None, suppress: "torch.Tensor | None" = None,
           greedy_only: bool = False) -> "torch.Tensor":
    """The next token of each row [B] int64 from `logits` [B, V] float32 (module docstring for the rules).

    Per-row tensors [B]: `temperature` float32 (0: greedy), `top_p` float32, `top_k` int64 (0: off), `seeds` and
    `steps` int64 (the noise's counter). `penalty` [B] float32 with `seen` [B, V] bool: the repetition penalty on
    the tokens seen. `suppress` [V] bool: tokens never chosen. `greedy_only`: every row is greedy and unpenalized
    (the argmax alone, no sort). Fixed shapes and no host synchronization: the step can be captured in a CUDA graph.
    """
    import torch

    if suppress is not None:
        logits = logits.masked_fill(suppress, float("-inf"))
    if penalty is not None and seen is not None:
        p = penalty[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    greedy = logits.argmax(dim=-1)
    if greedy_only:
        return greedy
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp_max(vocab), torch.full_like(top_k, vocab))
    ordered = ordered.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    ordered = ordered.masked_fill((before >= top_p[:, None]) & (rank[None, :] > 0), float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, vocab)))
    pick = (ordered + gumbel.gather(1, order)).argmax(dim=-1, keepdim=True)
    drawn = order.gather(1, pick).squeeze(1)
    return torch.where(temperature > 0, drawn, greedy)


def logprob_entries(logits: "torch.Tensor", tokens: "torch.Tensor", top: int, temperature: "torch.Tensor | None" = None):
    """(token id, log-probability, [(token id, log-probability)] of the `top` most likely) per row, from `logits`
    [B, V] and the chosen `tokens` [B]: log-softmax of the raw logits, or of the logits divided by `temperature`
    [B] where it is positive (the distribution sampled from before top-k/top-p, as a trainer scores a rollout)."""
    import torch

    if temperature is not None:
        logits = logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()
    if top:
        values, ids = torch.topk(logp, top, dim=-1)
        alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alts = [[] for _ in chosen]
    return [(int(t), float(c), a) for t, c, a in zip(tokens.tolist(), chosen, alts)]


__all__ = ["SamplingParams", "logprob_entries", "sample", "uniform_noise"]
