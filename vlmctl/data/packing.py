"""Sequence packing: token-budget bins and packed batch assembly with per-sample positions.

Packing concatenates several samples into one row of at most `tokens_per_batch` tokens with no padding. Attention
stays inside each sample: position ids restart at 0 for every sample, and transformers derives the block-diagonal
causal mask from them (`masking_utils.find_packed_sequence_indices`) for sdpa / eager / flex attention, while the
varlen kernel receives the sample boundaries as `packed_cu_seqlens` (FlashAttention's varlen convention:
cumulative sequence lengths, int32, shape (num_samples + 1,)) and `packed_max_seqlen`. These are not named
`cu_seq_lens_q/k`: keyword arguments of a VLM's forward also reach its vision tower, whose Qwen-VL attention
passes its own `cu_seq_lens_q` (per-window boundaries), and the two would collide. transformers' own
FlashAttention path derives the boundaries from the position ids instead.

Qwen2/2.5/3-VL use 3-D mRoPE positions (temporal, height, width) for visual tokens. They are computed per sample
with the model's own `get_rope_index` (so they restart at 0 for each sample, as in unpacked training) and stacked
with the 1-D text positions as a (4, 1, T) tensor: row 0 is what transformers reads to build the packed mask,
rows 1-3 are the mRoPE positions (the layout `Qwen2_5_VLModel.forward` documents for packed inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any


def first_fit_decreasing(
    items: Iterable[tuple[Hashable, int]], budget: int, lookahead: int = 1024
) -> Iterator[list[Hashable]]:
    """Group `(key, length)` items into bins whose lengths sum to at most `budget` tokens.

    First-fit decreasing (Johnson 1973) over a bounded look-ahead buffer of `lookahead` items, so it streams: memory
    is O(lookahead) whatever the dataset size. The emptiest bin of each buffer is carried into the next one rather
    than emitted half-full. An item longer than `budget` gets a bin of its own (callers drop such samples as
    `too_long` beforehand). Deterministic: ties keep input order. Yields lists of keys.

    Raises ValueError for a non-positive budget or lookahead.
    """
    if budget <= 0 or lookahead <= 0:
        raise ValueError(f"budget and lookahead must be positive, got {budget} and {lookahead}")
    buffer: list[tuple[Hashable, int]] = []
    for item in items:
        buffer.append(item)
        if len(buffer) >= lookahead:
            bins = _ffd(buffer, budget)
            carry = min(range(len(bins)), key=lambda i: (sum(n for _, n in bins[i]), -i))
            for i, b in enumerate(bins):
                if i != carry:
                    yield [k for k, _ in b]
            buffer = list(bins[carry])
    if buffer:
        for b in _ffd(buffer, budget):
            yield [k for k, _ in b]


def _ffd(items: list[tuple[Hashable, int]], budget: int) -> list[list[tuple[Hashable, int]]]:
    order = sorted(range(len(items)), key=lambda i: -items[i][1])  # stable: ties keep input order
    bins: list[list[tuple[Hashable, int]]] = []
    room: list[int] = []
    for i in order:
        key, n = items[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append((key, n))
                room[b] -= n
                break
        else:
            bins.append([(key, n)])
            room.append(budget - n)
    return bins


def pack_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate encoded samples into one packed row.

    Each sample is a dict with `input_ids` and `labels` (1-D LongTensors of the same length L_i), optionally other
    per-token tensors of length L_i (Qwen-VL's `mm_token_type_ids`), and image tensors with images along dim 0
    (`pixel_values`, `image_grid_thw` (n_images, 3) for Qwen-VL), or per-sample image stacks [1, n_images, ...]
    (Idefics3's 5-D `pixel_values` and its `pixel_attention_mask`). Returns a dict with:

    - `input_ids`, `labels`: (1, T) with T = sum(L_i); the first label of every sample is -100 so no token is
      trained to predict the next sample's start (models shift labels left by one internally),
    - `position_ids`: (1, T), restarting at 0 for each sample,
    - `packed_cu_seqlens`: int32 (num_samples + 1,), `packed_max_seqlen`: int (tokens),
    - the other per-token tensors as (1, T) (zeros for samples without them),
    - image tensors concatenated along dim 0 (along dim 1 for per-sample stacks),
    - `seq_lens`: list of L_i (for per-sample losses and mRoPE positions).
    """
    import torch

    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    lens = [int(s["input_ids"].numel()) for s in samples]
    labels = []
    for s in samples:
        lab = s["labels"].clone()
        lab[0] = -100
        labels.append(lab)
    out: dict[str, Any] = {
        "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lens])[None],
        "seq_lens": lens,
    }
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    out["packed_cu_seqlens"] = cu
    out["packed_max_seqlen"] = max(lens)
    keys = [k for s in samples for k in s if k not in ("input_ids", "labels")]
    per_sample_stacks = any(getattr(s.get("pixel_values"), "ndim", 0) == 5 for s in samples)
    for key in dict.fromkeys(keys):
        present = [s.get(key) for s in samples]
        if all(v is None for v in present):
            continue
        if all(v is None or (v.ndim == 1 and v.numel() == n) for v, n in zip(present, lens)):  # per-token
            ref = next(v for v in present if v is not None)
            out[key] = torch.cat([v if v is not None else torch.zeros(n, dtype=ref.dtype) for v, n in zip(present, lens)])[None]
        else:
            out[key] = torch.cat([v for v in present if v is not None], dim=1 if per_sample_stacks else 0)
    return out


def mrope_position_ids(
    get_rope_index: Callable[..., tuple[Any, Any]],
    input_ids,
    mm_token_type_ids,
    image_grid_thw,
    seq_lens: list[int],
):
    """(4, 1, T) position ids for a packed Qwen-VL row: text positions + per-sample 3-D mRoPE positions.

    `get_rope_index` is the model's own (`model.model.get_rope_index`), called once per sample with that sample's
    tokens and image grids, so visual positions restart with each sample exactly as in unpacked training.
    `input_ids` / `mm_token_type_ids`: (1, T); `image_grid_thw`: (n_images, 3) for the whole row, in order.
    """
    import torch

    rows, start, img = [], 0, 0
    token_types = mm_token_type_ids[0]
    for n in seq_lens:
        ids = input_ids[:, start:start + n]
        types = token_types[start:start + n]
        # one image per contiguous run of image tokens
        n_images = int(((types[1:] == 1) & (types[:-1] != 1)).sum() + (types[0] == 1))
        grid = image_grid_thw[img:img + n_images] if n_images else None
        if grid is None:
            pos = torch.arange(n, device=input_ids.device).view(1, 1, -1).expand(3, 1, -1)
        else:
            pos, _ = get_rope_index(input_ids=ids, mm_token_type_ids=types[None], image_grid_thw=grid)
        rows.append(pos)
        start += n
        img += n_images
    mrope = torch.cat(rows, dim=-1)
    text = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens]).view(1, 1, -1)
    return torch.cat([text.to(mrope.dtype), mrope], dim=0)
