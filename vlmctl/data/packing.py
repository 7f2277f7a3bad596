"""Sequence packing: token-budget bins, their compute balancing, and packed batch assembly with per-sample positions.

`first_fit_decreasing` groups samples into bins of at most `tokens_per_batch` tokens; `balance_bins` splits one
optimizer step's samples again into as many bins of as equal estimated cost as the budget allows (compute-balanced
data parallelism, `vlmctl.data.samplers`).

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

from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Modules the CLI's start-up loads anyway are imported next to their use as well.


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


def balance_bins(tokens: Sequence[int], costs: Sequence[int], bins: int, *, budget: int | None = None,
                 size: int | None = None, start: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Split items 0..n-1 into `bins` groups whose summed `costs` are as equal as possible: the largest group's cost
    as small as it gets (multiway number partitioning, the makespan of identical machines).

    `tokens`, `costs`: int arrays [n] (tokens; integer costs such as FLOPs, so every rank computes the same
    groups); `budget`: at most this many tokens per group (packed rows), or None; `size`: exactly this many items
    per group (padded micro-batches), or None; `start`: a feasible grouping to fall back on and improve (the
    sampler's own bins), needed when the constraints are tight.

    Longest processing time first (Graham 1969: items by decreasing cost, each to the cheapest group with room),
    then local search on the most expensive group (move one of its items, or swap one for a cheaper item of
    another group, when that lowers the larger of the two groups' costs and fits their budgets), from the LPT
    grouping and from `start`; the better result wins. Deterministic: ties go to the lower item and group index.
    Returns `bins` lists of item indices (ascending), the groups in decreasing cost.

    Raises ValueError when neither LPT nor `start` gives a feasible grouping.
    """
    tokens, costs = np.asarray(tokens, dtype=np.int64), np.asarray(costs, dtype=np.int64)
    limits = _Limits(tokens, costs, budget, size)
    given = [sorted(int(i) for i in b) for b in start] if start is not None else None
    found = [g for g in (_lpt(limits, bins), _differencing(costs, bins), given)
             if g is not None and limits.feasible(g, bins)]
    if not found:
        raise ValueError(f"{len(tokens)} items do not fit {bins} groups of budget {budget}, size {size}")
    best = min((_improve(limits, g) for g in found), key=limits.rank)
    return sorted((sorted(g) for g in best), key=lambda g: (-int(costs[g].sum()), g[:1]))


class _Limits:
    """The items' tokens and costs and the groups' constraints (`balance_bins`)."""

    def __init__(self, tokens: np.ndarray, costs: np.ndarray, budget: int | None, size: int | None):
        self.tokens, self.costs, self.budget, self.size = tokens, costs, budget, size

    def feasible(self, groups: list[list[int]], bins: int) -> bool:
        items = sorted(i for g in groups for i in g)
        return (len(groups) == bins and items == list(range(len(self.tokens)))
                and all(self.budget is None or self.tokens[g].sum() <= self.budget for g in groups)
                and all(self.size is None or len(g) == self.size for g in groups))

    def rank(self, groups: list[list[int]]) -> tuple[int, int]:
        """Sort key of a grouping: the largest cost, then the sum of squared costs (scaled), smaller is better."""
        loads = [int(self.costs[g].sum()) for g in groups]
        return max(loads), sum((x / max(max(loads), 1)) ** 2 for x in loads)


def _lpt(limits: _Limits, bins: int) -> list[list[int]] | None:
    """Longest processing time first under the constraints; None when an item finds no group with room."""
    tokens, costs = limits.tokens, limits.costs
    load = np.zeros(bins, dtype=np.int64)
    used = np.zeros(bins, dtype=np.int64)
    groups: list[list[int]] = [[] for _ in range(bins)]
    for i in np.lexsort((np.arange(len(costs)), -tokens, -costs)):
        room = np.ones(bins, dtype=bool) if limits.budget is None else used + tokens[i] <= limits.budget
        if limits.size is not None:
            room &= np.asarray([len(g) < limits.size for g in groups])
        if not room.any():
            return None
        b = int(np.argmin(np.where(room, load, np.iinfo(np.int64).max)))
        groups[b].append(int(i))
        load[b] += costs[i]
        used[b] += tokens[i]
    return groups


def _differencing(costs: np.ndarray, bins: int) -> list[list[int]]:
    """Karmarkar and Karp's largest differencing method (1982) for `bins`-way partitioning, without constraints:
    every item starts as a partition with its cost in one part; the two partitions of the largest spread are
    merged, the heaviest part of one with the lightest of the other, until one partition is left."""
    import heapq

    heap = []
    for i in np.lexsort((np.arange(len(costs)), -costs)):
        parts = [(int(costs[i]), [int(i)])] + [(0, []) for _ in range(bins - 1)]
        heap.append((-int(costs[i]), int(i), parts))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, key_a, a = heapq.heappop(heap)
        _, key_b, b = heapq.heappop(heap)
        a = sorted(a, key=lambda p: -p[0])
        b = sorted(b, key=lambda p: p[0])
        merged = sorted(((x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b)), key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(key_a, key_b), merged))
    return [g for _, g in heap[0][2]] if heap else [[] for _ in range(bins)]


def _improve(limits: _Limits, groups: list[list[int]], max_rounds: int | None = None) -> list[list[int]]:
    """Local search: while a move or swap out of the most expensive group lowers the larger of the two groups'
    costs (within budget), apply the best one. Each step lowers the sorted cost vector, so it ends."""
    groups = [list(g) for g in groups]
    rounds = max_rounds if max_rounds is not None else 4 * sum(len(g) for g in groups) + 8
    for _ in range(rounds):
        loads = [int(limits.costs[g].sum()) for g in groups]
        h = int(np.argmax(loads))
        step = _best_exchange(limits, groups, loads, h)
        if step is None:
            break
        b, i, j = step
        groups[h].remove(i)
        groups[b].append(i)
        if j is not None:
            groups[b].remove(j)
            groups[h].append(j)
        groups[h].sort()
        groups[b].sort()
    return groups


def _best_exchange(limits: _Limits, groups: list[list[int]], loads: list[int], h: int):
    """(group, item of group h, item of that group or None for a move) of the exchange that lowers the larger of
    the two groups' costs the most below loads[h]; None when there is none."""
    tokens, costs = limits.tokens, limits.costs
    src = np.asarray(groups[h], dtype=np.int64)
    used_h = int(tokens[src].sum())
    best, best_value = None, loads[h]
    for b, other in enumerate(groups):
        if b == h:
            continue
        dst = np.asarray(other, dtype=np.int64)
        # columns: the items of group b to swap in, plus one "nothing" column (a move) when sizes are free
        move = limits.size is None
        cj = np.concatenate([costs[dst], [0] if move else []]).astype(np.int64)
        tj = np.concatenate([tokens[dst], [0] if move else []]).astype(np.int64)
        delta = costs[src][:, None] - cj[None, :]
        shift = tokens[src][:, None] - tj[None, :]
        value = np.maximum(loads[h] - delta, loads[b] + delta)
        ok = value < best_value
        if limits.budget is not None:
            ok &= (used_h - shift <= limits.budget) & (int(tokens[dst].sum()) + shift <= limits.budget)
        if ok.any():
            flat = int(np.argmin(np.where(ok, value, np.iinfo(np.int64).max)))
            r, c = divmod(flat, len(cj))
            best_value = int(value[r, c])
            best = (b, int(src[r]), int(dst[c]) if c < len(dst) else None)
    return best


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
