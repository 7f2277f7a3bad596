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


def make(kind: str, rank: int = 0, world_size: int = 2, weights=None, balanced: bool = False) -> BatchSampler:
    lengths = np.random.default_rng(1).integers(5, 90, size=131)
    # balanced: costs that are not proportional to tokens (a quadratic term), three micro-batches per step
    split = {"costs": lengths**2 + 40 * lengths, "step_batches": 3} if balanced else {}
    if kind == "padded":
        return DistributedBatchSampler(lengths, micro_batch_size=3, world_size=world_size, rank=rank, seed=4,
                                       group_by_length=True, weights=weights, **split)
    return PackedBatchSampler(lengths, tokens_per_batch=200, world_size=world_size, rank=rank, seed=4, weights=weights,
                              **split)


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
def test_every_position_resumes_at_the_next_micro_batch(kind, weighted, balanced):
    weights = np.where(np.arange(131) % 2 == 0, 2.0, 0.5) if weighted else None
    sampler = make(kind, weights=weights, balanced=balanced)
    assert sampler.balancing == balanced
    n = sampler.batches_per_epoch
    run = take(sampler, 3 * n + 2)
    # positions inside a step too (balanced steps are 3 micro-batches), and steps across epoch ends
    for position in (0, 1, 2, n - 1, n, n + 1, 2 * n + 3):
        assert take(make(kind, weights=weights, balanced=balanced), 5, position) == run[position:position + 5], position
    if balanced:
        assert run != take(make(kind, weights=weights), 3 * n + 2)  # the costs did change the split


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_balanced_ranks_share_each_step_and_the_order_does_not_depend_on_the_process(kind):
    ranks = [make(kind, rank=r, balanced=True) for r in range(2)]
    again = [make(kind, rank=r, balanced=True) for r in range(2)]
    n = 3 * ranks[0].batches_per_epoch
    for sampler, twin in zip(ranks, again):
        assert take(sampler, n) == take(twin, n)  # a pure function of the inputs: every rank computes the same split
    plain = [make(kind, rank=r) for r in range(2)]
    steps = [take(s, n) for s in ranks], [take(s, n) for s in plain]
    for start in range(0, n - 2, 3):  # a step's samples over both ranks: the same with and without balancing
        balanced, unbalanced = ([i for rank in runs for batch in rank[start:start + 3] for i in batch] for runs in steps)
        assert sorted(balanced) == sorted(unbalanced) and len(balanced) > 6


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
