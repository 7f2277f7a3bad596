"""The sampler base: epochs of global micro-batches dealt to ranks, resumable from one integer, for every subclass."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vlmctl.data.loader import DistributedBatchSampler, PackedBatchSampler
from vlmctl.data.samplers import BatchSampler, epoch_indices


def take(sampler: BatchSampler, n: int, position: int = 0) -> list[list[int]]:
    sampler.set_position(position)
    return list(itertools.islice(iter(sampler), n))


def make(kind: str, rank: int = 0, world_size: int = 2, weights=None) -> BatchSampler:
    lengths = np.random.default_rng(1).integers(5, 90, size=131)
    if kind == "padded":
        return DistributedBatchSampler(lengths, micro_batch_size=3, world_size=world_size, rank=rank, seed=4,
                                       group_by_length=True, weights=weights)
    return PackedBatchSampler(lengths, tokens_per_batch=200, world_size=world_size, rank=rank, seed=4, weights=weights)


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("weighted", [False, True])
def test_every_position_resumes_at_the_next_micro_batch(kind, weighted):
    weights = np.where(np.arange(131) % 2 == 0, 2.0, 0.5) if weighted else None
    sampler = make(kind, weights=weights)
    n = sampler.batches_per_epoch
    run = take(sampler, 3 * n + 2)
    for position in (0, 1, n - 1, n, n + 1, 2 * n + 3):
        assert take(make(kind, weights=weights), 5, position) == run[position:position + 5], position


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_ranks_share_each_global_micro_batch(kind):
    ranks = [make(kind, rank=r) for r in range(2)]
    assert isinstance(ranks[0], BatchSampler) and ranks[0].batches_per_epoch == ranks[1].batches_per_epoch
    globals_ = ranks[0].global_batches(0)
    assert len(globals_) == ranks[0].epoch_batches(0) == ranks[0].batches_per_epoch
    for g, (a, b) in enumerate(zip(take(ranks[0], len(globals_)), take(ranks[1], len(globals_)))):
        assert a == ranks[0].deal(globals_[g]) and b == ranks[1].deal(globals_[g]) and not set(a) & set(b)


def test_epoch_order_is_the_seeded_weighted_shuffle():
    sampler = make("padded")
    assert sampler.epoch_order(3).tolist() == epoch_indices(131, None, 4, 3).tolist()
    assert sampler.locate(2 * sampler.batches_per_epoch + 1) == (2, 1)
    assert BatchSampler.locate(sampler, 2 * sampler.batches_per_epoch + 1) == (2, 1)  # the base's walk agrees
