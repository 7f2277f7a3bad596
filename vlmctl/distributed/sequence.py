"""Sequence parallelism for long samples (`train.sequence_parallel: N`): Ulysses attention for HF models
(DeepSpeed-Ulysses, arXiv 2309.14509, in the layout of DeepSpeed's `UlyssesSPAttentionHF` from the ALST paper,
arXiv 2506.13996; `ulysses_attention`, on PyTorch's functional all-to-alls).

The N ranks of a sequence-parallel group (the mesh's `sp` dimension) read the same packed row. Every rank embeds
the whole row (text embeddings, the vision tower's visual tokens merged in, Qwen's 3-D mRoPE positions computed on
the whole sample: `position_hook` and the model's own code run before the split), then the language model sees
only its 1/N of the sequence:

- `split_sequence` (a forward pre-hook on the language model) pads the row to a multiple of N tokens (the padding
  is one more packed segment with no labels) and keeps this rank's contiguous slice of `inputs_embeds` and of the
  position ids (any leading dims: mRoPE's (4, 1, T) too). Packed segments may cross the split: the segment
  boundaries (`packed_cu_seqlens`) stay those of the whole row.
- Attention: Ulysses' all-to-all turns the (T/N tokens, all heads) shard into (T tokens, heads/N) before the core
  attention and back after it, so each rank attends over the whole row for its heads. The core is the run's
  varlen kernel on CUDA (`kernels.varlen_attention_forward`), else sdpa with the block-diagonal causal mask of the
  row's segments (`segment_attention`): both exact, so the loss equals the unsplit row's.
- Loss: each rank computes the cross-entropy of the labelled tokens its slice predicts: liger-kernel's fused loss
  given the slice's next-token labels (`local_shift_labels`) where liger is on, else the LM head's chunked loss of
  those positions (`local_targets`, `train.kernels.token_losses`); neither materialises the slice's logits. The sum over the group's ranks is the row's loss, and the gradients are reduced over
  every rank of the data-parallel and sequence-parallel dimensions (`ParallelDims.grad_mesh`).
- The vision tower (Qwen2-VL / Qwen2.5-VL: encoders whose spec sets `sequence_split` go through `split_vision`): the images of a row are spread over the group's ranks
  (contiguous runs balanced by patches), each rank encodes its own and the visual tokens are all-gathered
  (autograd-aware: the backward sums the ranks' gradients), so a row's images need 1/N of the vision activations.
  Other families' vision towers encode every image on every rank (same result, no saving).

Why Ulysses and not PyTorch's `torch.distributed.tensor.experimental.context_parallel` (ring attention): ring
attention shards the sequence into load-balanced chunks and rotates key/value blocks around the ring, but it wraps
SDPA's dense causal kernels; the packed rows vlmctl trains on need per-segment (document) masking whose segments
cross the split, which Ulysses gets for free (after its all-to-all each rank runs the ordinary varlen kernel over
the whole row) and which ring attention would need a masked kernel per block pair for. Ulysses needs the heads to
divide over N (ring attention does not) and moves 4 activations per layer through an all-to-all (inside one node:
`ParallelDims` keeps a group on one node). Their throughput on GPUs has not been compared yet (docs/benchmarks.md
lists the measurements that need two or more GPUs).

Raises ConfigError (see `check_sequence_parallel`) for heads that do not divide over N or padded batches (packing
is required).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmctl.errors import ConfigError

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# So are the vlmctl modules that load numpy when imported.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

ULYSSES_NAME = "vlmctl_ulysses"  # the attention implementation name the language model is switched to
SHARD_ATTR = "vlmctl_sequence_shard"  # where `apply_sequence_parallel` leaves the shard on the model


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of a packed row split over the `size` ranks of its sequence-parallel `group`."""

    group: Any
    rank: int
    size: int

    def padded(self, length: int) -> int:
        """The row's length (tokens) rounded up to a multiple of `size`."""
        return -(-length // self.size) * self.size

    def bounds(self, length: int) -> tuple[int, int]:
        """[start, end) of this rank's slice of a row of `length` tokens (after padding, see `padded`)."""
        n = self.padded(length) // self.size
        return self.rank * n, (self.rank + 1) * n


def check_sequence_parallel(size: int, text_config: Any, *, packing: bool) -> None:
    """Raise ConfigError unless a language model with `text_config` can be split over `size` ranks: packed rows,
    attention heads divisible by `size`, and key/value heads dividing or divided by it (Ulysses scatters heads)."""
    if size <= 1:
        return
    if not packing:
        raise ConfigError(f"train.sequence_parallel={size} splits packed rows; padded micro-batches cannot be split",
                          hint="set train.packing=true (every family that packs), or train.sequence_parallel=1")
    heads = int(getattr(text_config, "num_attention_heads"))
    kv = int(getattr(text_config, "num_key_value_heads", None) or heads)
    if heads % size or (kv % size and size % kv):
        raise ConfigError(f"train.sequence_parallel={size}: the language model's {heads} attention heads "
                          f"({kv} key/value heads) cannot be spread over {size} ranks",
                          hint=f"use a sequence_parallel that divides {heads} (and divides or is a multiple of {kv})")


def apply_sequence_parallel(model, family, shard: SequenceShard, core_attention=None) -> None:
    """Split `model`'s language model over `shard`'s group (see the module docstring); call it on every rank before
    wrapping (FSDP2 / DeepSpeed). `core_attention`: the transformers attention function that attends over the whole
    row after the all-to-all (the run's varlen kernel on CUDA, `train.kernels.varlen_attention_forward`); None:
    `segment_attention` (sdpa). No-op for `shard.size == 1`."""
    if shard.size <= 1:
        return
    from vlmctl.families.spec import _find_prefix

    text_config = model.config.get_text_config()
    check_sequence_parallel(shard.size, text_config, packing=True)
    _register_ulysses(shard, core_attention or segment_attention)
    _set_text_attention(model, ULYSSES_NAME)
    language_model = model.get_submodule(_find_prefix(model, family.language_model))
    language_model.register_forward_pre_hook(split_sequence(shard), with_kwargs=True)
    for encoder in family.encoders.values():  # e.g. Qwen-VL's images over the group
        if encoder.sequence_split:
            split_vision(model.get_submodule(_find_prefix(model, encoder.path)), shard)
    if family.sequence_parallel_plan is not None:
        family.sequence_parallel_plan(model, shard)
    setattr(model, SHARD_ATTR, shard)


def _set_text_attention(model, name: str) -> None:
    """Switch the language model (only) to `name`: the vision (or audio) tower keeps its own implementation, since
    its sequence is not split. The language model reads the text config object the composite config holds."""
    model.config.get_text_config()._attn_implementation_internal = name


def _register_ulysses(shard: SequenceShard, core) -> None:
    """Register `vlmctl_ulysses` with transformers: Ulysses' all-to-all around the core attention
    (`ulysses_attention`). Its mask function returns None: the core builds the segment mask of the whole row itself."""
    from transformers import AttentionInterface, AttentionMaskInterface

    ulysses = ulysses_attention(core, shard)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        # transformers' mask (if any) is for the local slice; the core uses the row's segments instead
        return ulysses(module, query, key, value, None, *args, **kwargs)

    AttentionInterface.register(ULYSSES_NAME, attention)
    AttentionMaskInterface.register(ULYSSES_NAME, lambda *args, **kwargs: None)


def ulysses_attention(core, shard: SequenceShard):
    """DeepSpeed-Ulysses attention (arXiv 2309.14509) as a transformers attention function: query (1, H, T/N, D)
    and key/value (1, H_kv, T/N, D) of this rank's slice go through one all-to-all each to (T, H/N) -- the whole
    row for 1/N of the heads --, `core` attends over the row, and one all-to-all brings its (1, T, H/N, D) output
    back to (1, T/N, H, D), the slice for every head. Key/value heads fewer than N are repeated up to N first
    (each rank needs the ones its query heads read). Rank r holds heads [r H/N, (r + 1) H/N) in between.

    The layout and the head arithmetic are those of DeepSpeed's `UlyssesSPAttentionHF`
    (`deepspeed/runtime/sequence_parallel/ulysses_sp.py`); the all-to-alls are PyTorch's functional,
    autograd-aware collectives (`all_to_all_single_autograd`), so a compiled decoder layer traces through them:
    DeepSpeed's class updates its own attributes in every call when row lengths vary, which Dynamo refuses inside
    an activation checkpoint (the whole checkpointed layer then ran eagerly), and it all-gathers the position ids
    in every layer for cores that need them (vlmctl's cores do not)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    n = shard.size

    def to_heads(x):  # (1, H, t, D) of this rank's t tokens -> (T, H/N, D): the row, for this rank's heads
        _, heads, t, dim = x.shape
        if heads < n:  # fewer key/value heads than ranks: repeat each (the query heads of a rank share one)
            x = x.repeat_interleave(n // heads, dim=1)
            heads = n
        # token-major (the projections' own layout), heads split into N groups, group j sent to rank j
        send = x[0].transpose(0, 1).reshape(t, n, heads // n, dim).transpose(0, 1).contiguous()
        return all_to_all_single_autograd(send, None, None, shard.group).reshape(n * t, heads // n, dim)

    def to_tokens(out):  # (1, T, H/N, D) -> (1, T/N, H, D): back to this rank's tokens, every head
        _, total, heads, dim = out.shape
        got = all_to_all_single_autograd(out[0].reshape(n, total // n, heads, dim).contiguous(), None, None, shard.group)
        return got.transpose(0, 1).reshape(total // n, n * heads, dim)[None]

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        q, k, v = (to_heads(x).transpose(0, 1)[None] for x in (query, key, value))  # (1, H/N, T, D) views
        out, weights = core(module, q, k, v, attention_mask, *args, **kwargs)
        return to_tokens(out), weights

    return attention


def segment_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Exact attention over a whole packed row with sdpa and the block-diagonal causal mask of its segments.

    query (1, H, T, D), key/value (1, H_kv, T, D); segments from `packed_cu_seqlens` int32 (n + 1,) (tokens), else
    the row is one segment. Returns ((1, T, H, D), None) like transformers' attention functions. Memory is
    O(T^2) for the mask: the CPU path (GPUs use the varlen kernel)."""
    import torch
    import torch.nn.functional as F

    total = query.shape[2]
    cu = kwargs.get("packed_cu_seqlens")
    if cu is None:
        cu = torch.tensor([0, total])
    segment = torch.bucketize(torch.arange(total, device=query.device), cu.to(query.device)[1:], right=True)
    pos = torch.arange(total, device=query.device)
    mask = (segment[:, None] == segment[None, :]) & (pos[:, None] >= pos[None, :])
    key_, value_ = key, value
    if key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key_, value_ = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(query, key_.to(query.dtype), value_.to(query.dtype), attn_mask=mask,
                                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def split_sequence(shard: SequenceShard):
    """The language model's forward pre-hook: pad the row to a multiple of `shard.size` and keep this rank's slice
    of `inputs_embeds` (1, T, E; a copy of its T/N positions, so the whole row's tensor is freed once the model's
    forward has handed it over) and the position ids (..., 1, T); the padding becomes one more segment of
    `packed_cu_seqlens`."""
    import torch
    import torch.nn.functional as F

    def hook(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        if embeds is None or args:
            raise ConfigError("train.sequence_parallel: this family calls its language model without inputs_embeds "
                              "as a keyword; it cannot be split", hint="set train.sequence_parallel=1")
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].ndim == 2 and not bool(kwargs["attention_mask"].all()):
            raise ConfigError("train.sequence_parallel splits packed rows; this batch is padded",
                              hint="set train.packing=true")
        total = embeds.shape[1]
        pad = shard.padded(total) - total
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(total, device=embeds.device)[None]
        cu = kwargs.get("packed_cu_seqlens")
        if cu is None:
            cu = torch.tensor([0, total], dtype=torch.int32, device=embeds.device)
        if pad:
            embeds = F.pad(embeds, (0, 0, 0, pad))
            tail = torch.arange(pad, device=positions.device, dtype=positions.dtype)
            positions = torch.cat([positions, tail.expand(*positions.shape[:-1], pad)], dim=-1)
            cu = torch.cat([cu, cu.new_tensor([total + pad])])
            kwargs["packed_max_seqlen"] = max(int(kwargs.get("packed_max_seqlen") or 0), pad)
        start, end = shard.bounds(total)
        # a copy, not a view: a view would keep the whole row's embeddings (T x E) alive for the whole step, since
        # the first decoder layer keeps its input for backward (7 KiB per row token on the 7B)
        kwargs["inputs_embeds"] = embeds[:, start:end].clone()
        kwargs["position_ids"] = positions[..., start:end]
        kwargs["packed_cu_seqlens"] = cu
        kwargs["attention_mask"] = None
        kwargs.pop("cache_position", None)
        return args, kwargs

    return hook


def local_targets(target_pos, total: int, shard: SequenceShard | None):
    """The labelled target positions (n,) of a row of `total` tokens whose logits this rank computes: those t whose
    predicting position t - 1 lies in its slice. Returns (targets, logits_to_keep): the positions t and the
    indices of t - 1 within the local slice (all of them, unshifted, without a shard)."""
    if shard is None or shard.size <= 1:
        return target_pos, target_pos - 1
    start, end = shard.bounds(total)
    mine = target_pos[(target_pos - 1 >= start) & (target_pos - 1 < end)]
    return mine, mine - 1 - start


def local_shift_labels(labels, shard: SequenceShard):
    """The next-token labels of this rank's slice of a packed row: (1, n) for `labels` (1, T) (-100: ignored), where
    entry j is the label of token start + j + 1, the one position start + j predicts; -100 past the row's end and
    over the split's padding. What liger-kernel's fused loss takes as `shift_labels` for a slice whose hidden states
    are local (it would otherwise shift the labels within the slice and lose the target across the boundary)."""
    import torch.nn.functional as F

    total = labels.shape[-1]
    start, end = shard.bounds(total)
    shifted = F.pad(labels[..., 1:], (0, shard.padded(total) - total + 1), value=-100)
    return shifted[..., start:end].contiguous()


def split_vision(visual, shard: SequenceShard) -> None:
    """Spread a Qwen-VL vision tower's images over `shard`'s group: each rank encodes a contiguous run of the
    images (balanced by patches, `image_runs`), and the merged visual tokens of all runs are all-gathered in image
    order, so the output equals the unsplit tower's. With fewer images than ranks every rank encodes them all (each
    rank must run the tower: FSDP2 gathers its weights collectively)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    forward = visual.forward

    def split_forward(hidden_states, grid_thw, **kwargs):
        patches = [int(n) for n in grid_thw.prod(-1).tolist()]  # per image
        runs = image_runs(patches, shard.size)
        if runs is None:
            return forward(hidden_states, grid_thw, **kwargs)
        first, last = runs[shard.rank]
        out = forward(hidden_states[sum(patches[:first]):sum(patches[:last])], grid_thw[first:last], **kwargs)
        merge = int(visual.spatial_merge_size) ** 2
        sizes = [sum(patches[a:b]) // merge for a, b in runs]
        return BaseModelOutputWithPooling(last_hidden_state=None, pooler_output=gather_rows(out.pooler_output, sizes, shard))

    visual.forward = split_forward


def image_runs(patches: list[int], ranks: int) -> list[tuple[int, int]] | None:
    """Contiguous runs [first, last) of images, one non-empty run per rank, whose largest patch count is the smallest
    possible (`patches`: patches per image; the linear partition problem, solved by a binary search on the largest
    run with a greedy fill). None when there are fewer images than ranks."""
    if len(patches) < ranks:
        return None

    def fill(limit: int) -> list[tuple[int, int]]:
        runs, first, load = [], 0, 0
        for i, n in enumerate(patches):
            if load + n > limit and i > first:
                runs.append((first, i))
                first, load = i, 0
            load += n
        return runs + [(first, len(patches))]

    low, high = max(patches), sum(patches)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(fill(mid)) <= ranks else (mid + 1, high)
    runs = fill(low)
    while len(runs) < ranks:  # splitting a run never raises the largest load
        k = max(range(len(runs)), key=lambda j: runs[j][1] - runs[j][0])
        first, last = runs[k]
        runs[k:k + 1] = [(first, last - 1), (last - 1, last)]
    return runs


def gather_rows(local, sizes: list[int], shard: SequenceShard):
    """All-gather `local` (sizes[rank], E) from every rank of the group into (sum(sizes), E) in rank order; the
    backward reduce-scatters, summing the ranks' gradients for each rank's rows
    (`torch.distributed._functional_collectives.all_gather_single_autograd`, named `all_gather_tensor_autograd`
    before torch 2.12)."""
    import torch
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

    longest = max(sizes)
    padded = F.pad(local, (0, 0, 0, longest - local.shape[0]))
    gathered = all_gather(padded.contiguous(), gather_dim=0, group=shard.group)
    return torch.cat([part[:n] for part, n in zip(gathered.split(longest), sizes)])
