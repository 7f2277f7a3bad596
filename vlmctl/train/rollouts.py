"""Rollouts for reinforcement learning from rewards (GRPO, arXiv 2402.03300): G answers per prompt, sampled from
the policy being trained.

    rollouts = generate_rollouts(model, processor, requests, group_size=8, max_new_tokens=256, temperature=1.0)
    rollouts.texts[i]            # the i-th answer; rollouts.prompt_index[i] says which request it answers

Each request is rendered once by the chat template (`vlmctl.inference.render_request`, as `vlmctl generate` renders
it) and repeated `group_size` times in one left-padded batch, so the G answers of a prompt share one `generate`
call and one KV cache shape. Under FSDP2 or ZeRO-3 every forward gathers parameters collectively, so every rank
must run the same number of decoding steps: with a process group of more than one rank `generate` runs with
`synced_gpus=True` (transformers keeps a finished rank stepping until every rank is done).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
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
    tokens, stripped. `seconds`: wall time of generation (rendering and the processor included)."""

    prompt_index: list[int]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    finished: list[bool]
    texts: list[str]
    seconds: float

    @property
    def completion_tokens(self) -> int:
        """Generated tokens over all rows (end-of-sequence tokens counted)."""
        return sum(len(ids) for ids in self.completion_ids)


def _synced(group) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


@contextmanager
def _gathered(model):
    """The sharded parameters `generate` needs, gathered as a training forward gathers them.

    FSDP2: the root's own parameters (those of no inner `fully_shard` unit: embeddings, the vision embeddings, the
    projector...) stay gathered for the whole generation: `generate` runs the vision tower through
    `get_image_features` before the root's forward (whose hook would gather them), and every decoding step reuses
    them; the inner units gather theirs in their hooks. ZeRO-3: every module's hooks gather its own parameters, and
    the parameters a module reads from another one (`nn.MultiheadAttention` reads its `out_proj.weight`) are
    gathered on access while the modules are marked in a forward, as `DeepSpeedEngine.forward` marks them (its
    automated discovery of external parameters). Nothing to do for other models."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        # the root's first forward sets up its units' communication state; generation may reach an inner unit first
        model._get_fsdp_state()._lazy_init()
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
        return
    if not any(hasattr(p, "ds_id") for p in model.parameters()):  # not partitioned by ZeRO-3
        yield
        return
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    modules = list(model.modules())
    for module in modules:
        ensure_zero_ordered_dict(module)
        module._parameters._in_forward = True
    try:
        yield
    finally:
        for module in modules:
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = False


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

    from vlmctl.inference.generation import _model_inputs, _sampling
    from vlmctl.inference.prompt import check_requests, model_family, render_request

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
        with torch.no_grad(), _gathered(model):
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                 synced_gpus=_synced(group), **_sampling(temperature, top_p), **_no_placeholders(processor))
    finally:
        model.train(training)
    width, kept = inputs["input_ids"].shape[1], len(requests) * group_size
    mask = inputs["attention_mask"][:kept].bool().cpu()
    prompt_ids = [row[m].tolist() for row, m in zip(inputs["input_ids"][:kept].cpu(), mask)]
    completion_ids, finished = [], []
    for row in out[:kept, width:].cpu().tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        completion_ids.append(row if end is None else row[: end + 1])
        finished.append(end is not None)
    texts = [t.strip() for t in tok.batch_decode(completion_ids, skip_special_tokens=True)]
    return Rollouts(prompt_index=[i for i in range(len(requests)) for _ in range(group_size)], prompt_ids=prompt_ids,
                    completion_ids=completion_ids, finished=finished, texts=texts, seconds=time.perf_counter() - start)
