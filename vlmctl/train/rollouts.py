"""Rollouts for reinforcement learning from rewards (GRPO, arXiv 2402.03300): G answers per prompt, sampled from
the policy being trained.

    sampler = RolloutEngine(processor, family)            # once per run
    sampler.refresh(policy)                                # every rank, at the start of each rollout phase
    rollouts = sampler.generate(requests, group_size=8, max_new_tokens=256, temperature=1.0)
    rollouts = generate_rollouts(model, processor, requests, group_size=8, max_new_tokens=256)   # the fallback
    rollouts.texts[i]            # the i-th answer; rollouts.prompt_index[i] says which request it answers

`RolloutEngine` decodes with vlmctl's decoding engine (`vlmctl.inference.engine`: continuous batching, CUDA-graph
decode steps) on a replica of the policy: a plain copy of the model (no FSDP2 or DDP wrapping, sdpa attention) whose
weights `refresh` copies from the policy once per rollout phase, parameter by parameter (`DTensor.full_tensor` for
FSDP2's shards: public API, every rank in the same order, no rank ever holding two full parameters it does not
keep), as vLLM-based trainers sync their engine (TRL's colocate mode, veRL). Each rank then decodes its own prompts
with no collective, so ranks need not step together, and the replica's buffers keep their addresses, so the decode
graphs are captured once per run. A prompt is prefilled once and its G rollouts decode from copies of its cache
slot. Each rollout's tokens come with their log-probabilities under the temperature-scaled distribution they were
sampled from (`logprobs`), which GRPO compares with the trainer's (the rollout/trainer mismatch TRL and veRL
report). The replica costs one more copy of the weights in the compute dtype; `RolloutEngine.unavailable` says when
it is not used (no room on the GPU, a LoRA policy, ZeRO-3 partitions) and `generate_rollouts` then decodes with
transformers' `generate` on the policy itself:

Each request is rendered once by the chat template (`vlmctl.inference.render_request`, as `vlmctl generate` renders
it) and repeated `group_size` times in one left-padded batch, so the G answers of a prompt share one `generate`
call and one KV cache shape. Under FSDP2 or ZeRO-3 every forward gathers parameters collectively, so every rank
must run the same number of decoding steps: with a process group of more than one rank `generate` runs with
`synced_gpus=True` (transformers keeps a finished rank stepping until every rank is done).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from vlmctl.errors import UsageError

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.


@dataclass
class Rollouts:
    """The answers of one `generate_rollouts` call, one row per answer (R = requests x group_size rows).

    `prompt_index[i]`: the request row i answers (rows of one request are consecutive). `prompt_ids[i]`: the
    rendered prompt's token ids (no padding). `completion_ids[i]`: the generated token ids up to and including the
    first end-of-sequence token (at most `max_new_tokens`). `finished[i]`: whether row i ended with an
    end-of-sequence token (False: cut at `max_new_tokens`). `texts[i]`: the completion decoded without special
    tokens, stripped. `seconds`: wall time of generation (rendering and the processor included). `logprobs[i]`:
    the log-probability of each token of `completion_ids[i]` under the distribution it was sampled from (logits
    over the temperature), None where the rollouts came from `generate_rollouts`. `how`: what decoded them."""

    prompt_index: list[int]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    finished: list[bool]
    texts: list[str]
    seconds: float
    logprobs: list[list[float]] | None = None
    how: str = "transformers generate"

    @property
    def completion_tokens(self) -> int:
        """Generated tokens over all rows (end-of-sequence tokens counted)."""
        return sum(len(ids) for ids in self.completion_ids)


def _synced(group) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _split_rows(inputs, out, tok, eos: set, requests: int, group_size: int, start: float) -> Rollouts:
    """The kept rows (the first `requests` x `group_size`) of `generate`'s output `out` [rows, prompt width + new
    tokens] as a `Rollouts`: each prompt without its left padding, each completion up to and including its first
    end-of-sequence token (one of `eos`), and their decoded text; `start`: when generation began (perf_counter)."""
    width, kept = inputs["input_ids"].shape[1], requests * group_size
    mask = inputs["attention_mask"][:kept].bool().cpu()
    prompt_ids = [row[m].tolist() for row, m in zip(inputs["input_ids"][:kept].cpu(), mask)]
    completion_ids, finished = [], []
    for row in out[:kept, width:].cpu().tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        completion_ids.append(row if end is None else row[: end + 1])
        finished.append(end is not None)
    texts = [t.strip() for t in tok.batch_decode(completion_ids, skip_special_tokens=True)]
    return Rollouts(prompt_index=[i for i in range(requests) for _ in range(group_size)], prompt_ids=prompt_ids,
                    completion_ids=completion_ids, finished=finished, texts=texts, seconds=time.perf_counter() - start)


def _no_placeholders(processor) -> dict[str, Any]:
    """`generate` keywords that never sample a media placeholder token (`<|image_pad|>`, `<image>`...): a rollout is
    trained on as prompt + completion, and a placeholder in the completion would ask the model for media features
    it does not have."""
    from vlmctl.data.modalities import media_token_ids

    ids = sorted(media_token_ids(processor))
    return {"suppress_tokens": ids} if ids else {}


def generate_rollouts(model, processor, requests: Sequence[Any], *, group_size: int, max_new_tokens: int,
                      temperature: float = 1.0, top_p: float = 1.0, family: Any = None, video: Any = None,
                      group=None, extra_requests: Sequence[Any] = ()) -> Rollouts:
    """`group_size` sampled answers to each of `requests` (`GenerationRequest`s) from `model` in one batch of
    len(requests) x group_size rows: `input_ids` [R, longest prompt in tokens], at most `max_new_tokens` new tokens
    per row. Sampling with `temperature` and `top_p` (temperature 0: greedy, every row of a group equal). The model is
    put in eval mode for generation (no dropout) and back in its former mode after; no gradient is kept. Media
    placeholder tokens are never sampled (`_no_placeholders`).

    `model` may be wrapped by FSDP2 (its forward gathers the shards); with a process group of more than one rank
    (`group`, default the world) every rank must call this with the same `max_new_tokens` (collective).
    Raises UsageError for `group_size` or `max_new_tokens` below 1, a negative `temperature` or `top_p` outside
    (0, 1]; DataError for a request whose media parts point past its media (`render_request`).

    `extra_requests` are generated once each in the same batch and left out of the result: under FSDP2 or ZeRO-3 a
    rank whose prompts have no image adds a blank-image request, so its vision tower runs (gathers its parameters)
    whenever another rank's does."""
    import torch

    from vlmctl.distributed.engine import generation_parameters
    from vlmctl.inference.generation import _model_inputs, _sampling
    from vlmctl.inference.prompt import check_requests, model_family, render_request
    from vlmctl.train.kernels import padded_attention

    if group_size < 1 or max_new_tokens < 1:
        raise UsageError(f"group_size ({group_size}) and max_new_tokens ({max_new_tokens}) must be at least 1",
                         hint="set train.grpo.group_size and train.grpo.max_new_tokens to positive numbers")
    if temperature < 0 or not 0 < top_p <= 1:
        raise UsageError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature} and {top_p}",
                         hint="set train.grpo.temperature and train.grpo.top_p")
    start = time.perf_counter()
    family = family if family is not None else model_family(model)
    check_requests([*requests, *extra_requests], family)
    tok = processor.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    rendered = [render_request(r, processor, family) for r in requests]
    rows = [r for r in rendered for _ in range(group_size)] + [render_request(r, processor, family) for r in extra_requests]
    side, tok.padding_side = tok.padding_side, "left"  # every row continues from its last position
    try:
        inputs = _model_inputs(model, processor, [r.text for r in rows], [img for r in rows for img in r.images],
                               [c for r in rows for c in r.audios], [v for r in rows for v in r.videos], video)
    finally:
        tok.padding_side = side
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [tok.eos_token_id])
    training = model.training
    model.eval()
    try:
        # left-padded rows: not the varlen kernel; compiled layers run eagerly (each decoding step's shapes would
        # recompile them past dynamo's limit)
        with torch.no_grad(), generation_parameters(model), padded_attention(model), torch.compiler.set_stance("force_eager"):
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                 synced_gpus=_synced(group), **_sampling(temperature, top_p), **_no_placeholders(processor))
    finally:
        model.train(training)
    return _split_rows(inputs, out, tok, eos, len(requests), group_size, start)


def _parameter_name(name: str) -> str:
    """A parameter's name without the wrappers training adds (torch.compile's `_orig_mod.`, activation
    checkpointing's `_checkpoint_wrapped_module.`, DDP's `module.`)."""
    for part in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(part, "")
    return name[len("module."):] if name.startswith("module.") else name


class RolloutEngine:
    """GRPO's rollouts through the decoding engine on a replica of the policy (module docstring).

    `processor`, `family`: the policy's; `video`: the `data.video` settings. `max_slots`: rollouts decoded at once
    (a step's prompts x group size is the natural value). The replica is built at the first `refresh`; memory for it
    and its cache is checked there against half of what the GPU has free.
    """

    def __init__(self, processor, family, *, video: Any = None, max_slots: int = 64):
        self.processor, self.family, self.video, self.max_slots = processor, family, video, int(max_slots)
        self.replica = None
        self.decoder = None
        self.unavailable = ""  # why rollouts go through `generate_rollouts` instead, once decided
        self._names: dict[str, str] = {}

    def _build(self, policy, params: dict[str, Any]):
        """The replica of `policy` (its model class from its config, sdpa attention, eval mode) on the device of its
        parameters, in their dtype; None (and `unavailable` says why) where it cannot be made."""
        import copy

        import torch
        import transformers

        from vlmctl.train.kernels import unwrapped

        base = unwrapped(policy)
        if hasattr(base, "peft_config"):
            self.unavailable = "a LoRA policy: its adapters are not copied into a replica"
            return None
        if any(hasattr(p, "ds_id") for p in params.values()):
            self.unavailable = "ZeRO-3 partitions the policy's parameters"
            return None
        first = next(iter(params.values()))
        device, dtype = first.device, first.dtype
        need = sum(p.numel() * p.element_size() for p in params.values())
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            if need > free / 2:
                self.unavailable = (f"no room for a replica on the GPU ({need / 2**30:.1f} GiB of weights, "
                                    f"{free / 2**30:.1f} GiB free)")
                return None
        config = copy.deepcopy(base.config)
        for sub in [config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {})]:
            if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                sub._attn_implementation_internal = "sdpa"  # padded prompts; training's varlen kernel takes packed rows
        cls = getattr(transformers, self.family.model_class)
        with torch.device("meta"):
            replica = cls(config)
        replica = replica.to_empty(device=device).to(dtype).eval()
        replica.tie_weights()  # the LM head shares the embeddings again (the meta init left them apart)
        replica.generation_config = copy.deepcopy(getattr(base, "generation_config", replica.generation_config))
        for name, buffer in base.named_buffers():  # rotary frequencies and other buffers the meta init left empty
            own = dict(replica.named_buffers()).get(_parameter_name(name))
            if own is not None and own.shape == buffer.shape:
                own.copy_(buffer)
        mine = dict(replica.named_parameters())
        missing = [n for n in params if n not in mine]
        if missing:
            self.unavailable = f"the replica has no parameter {missing[0]} of the policy"
            return None
        filled = {mine[n].data_ptr() for n in params}
        unfilled = [n for n, p in replica.named_parameters(remove_duplicate=False) if p.data_ptr() not in filled]
        if unfilled:  # a tensor no policy parameter fills would decode from uninitialized memory
            self.unavailable = f"the replica's parameter {unfilled[0]} has no counterpart in the policy"
            return None
        return replica

    def refresh(self, policy) -> bool:
        """Copy the policy's current weights into the replica (built at the first call). Collective under FSDP2:
        every rank calls it, at the same point of the step. Returns False when rollouts must use
        `generate_rollouts` (`unavailable` says why)."""
        import torch
        from torch.distributed.tensor import DTensor

        from vlmctl.distributed.float8 import high_precision

        if self.unavailable:
            return False
        named = {_parameter_name(n): p for n, p in policy.named_parameters()}
        with torch.no_grad():
            if self.replica is None:
                probe = {n: (p.to_local() if isinstance(p, DTensor) else p) for n, p in named.items()}
                self.replica = self._build(policy, probe)
                if not self._everyone(self.replica is not None, next(iter(probe.values())).device):
                    self.replica = None
                    self.unavailable = self.unavailable or "another rank cannot hold a replica of the policy"
                    return False
                from vlmctl.inference.engine import DecodeEngine
                from vlmctl.data.modalities import media_token_ids

                self.decoder = DecodeEngine(self.replica, self.processor, family=self.family, max_slots=self.max_slots,
                                            max_length=2048, video=self.video, strict_context=False, max_context=32_768,
                                            suppress_tokens=sorted(media_token_ids(self.processor)), logprobs="sampled")
            own = dict(self.replica.named_parameters())
            for name, param in named.items():  # one full parameter at a time, every rank in the same order
                full = high_precision(param.full_tensor() if isinstance(param, DTensor) else param)
                own[name].copy_(full)
        return True

    @staticmethod
    def _everyone(ok: bool, device) -> bool:
        """Whether every rank has `ok` (one all-reduce under several ranks): the ranks decode the same way, or the
        collective weight copy of one and transformers' synced generation of another would wait on each other."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return ok
        flag = torch.tensor([1 if ok else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def generate(self, requests: Sequence[Any], *, group_size: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0) -> Rollouts:
        """`group_size` answers to each of `requests` (`GenerationRequest`s) from the replica, each request prefilled
        once. Seeds come from torch's generator (seed it per micro-batch for repeatable rollouts). Raises
        UsageError for bad settings (as `generate_rollouts`), DataError for a request the processor cannot read,
        ModelError when the model fails."""
        from vlmctl.inference.generation import raise_failed
        from vlmctl.inference.sampling import SamplingParams

        if group_size < 1 or max_new_tokens < 1:
            raise UsageError(f"group_size ({group_size}) and max_new_tokens ({max_new_tokens}) must be at least 1",
                             hint="set train.grpo.group_size and train.grpo.max_new_tokens to positive numbers")
        start = time.perf_counter()
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, logprobs=0)
        done = self.decoder.generate(list(requests), params, n=group_size)
        raise_failed(done)
        completion_ids, finished, texts, logprobs = [], [], [], []
        for request in done:
            for c in request.completions:
                ids = c.token_ids + ([c.stop_token] if c.stop_token is not None else [])
                completion_ids.append(ids)
                finished.append(c.stop_token is not None)
                texts.append(c.text)
                logprobs.append([lp for _, lp, _ in (c.logprobs or [])][: len(ids)])
        return Rollouts(prompt_index=[i for i in range(len(done)) for _ in range(group_size)],
                        prompt_ids=[r.prompt_ids for r in done for _ in range(group_size)], completion_ids=completion_ids,
                        finished=finished, texts=texts, seconds=time.perf_counter() - start, logprobs=logprobs,
                        how=f"vlmctl engine ({self.decoder.mode})")
