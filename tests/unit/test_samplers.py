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


# ------------------------------------------------------------------------------------------- modality grouping

# The order with grouping off, recorded from the samplers before modality grouping existed (`_off_digest`): grouping
# off must keep every run's batches, sample for sample.
OFF_DIGESTS = {
    ("padded", False, False): "c2f6a015562cbc9e", ("padded", False, True): "33e7956337f6c645",
    ("padded", True, False): "1c429d370a18a17c", ("padded", True, True): "36015f4fd9040b96",
    ("length", False, False): "975c9febf76e03f7", ("length", False, True): "04e736523d916f85",
    ("length", True, False): "deb2c9c50b15bb0e", ("length", True, True): "3a7eb715b378a4b7",
    ("packed", False, False): "394236654d07e73e", ("packed", False, True): "7c8a05aee427bd7f",
    ("packed", True, False): "c652abcb9745ae36", ("packed", True, True): "79334995b0a02272",
}


def _off_digest(kind: str, weighted: bool, balanced: bool, **extra) -> str:
    """sha256 (16 hex digits) of 3 epochs + 1 micro-batch from position 0 and 5 from position n + 3, for 1, 2 and 3
    ranks (padded, length-grouped padded or packed; fractional weights; cost-balanced steps of 2)."""
    import hashlib
    import json

    lengths = np.random.default_rng(7).integers(5, 120, size=157)
    weights = np.where(np.arange(157) % 3 == 0, 1.5, 0.5) if weighted else None
    split = {"costs": lengths**2 + 30 * lengths, "step_batches": 2} if balanced else {}
    runs = []
    for world_size, rank in ((1, 0), (2, 0), (2, 1), (3, 2)):
        if kind == "packed":
            s = PackedBatchSampler(lengths, tokens_per_batch=250, world_size=world_size, rank=rank, seed=11,
                                   weights=weights, **split, **extra)
        else:
            s = DistributedBatchSampler(lengths, micro_batch_size=3, world_size=world_size, rank=rank, seed=11,
                                        group_by_length=kind == "length", weights=weights, **split, **extra)
        n = s.batches_per_epoch
        for position, count in ((0, 3 * n + 1), (n + 3, 5)):
            runs.append([[int(i) for i in b] for b in take(s, count, position)])
    return hashlib.sha256(json.dumps(runs).encode()).hexdigest()[:16]


@pytest.mark.parametrize("key", sorted(OFF_DIGESTS))
def test_grouping_off_keeps_the_order_of_before(key):
    assert _off_digest(*key) == OFF_DIGESTS[key]
    assert _off_digest(*key, modalities=None) == OFF_DIGESTS[key]


N = 240


def modalities(n: int = N) -> np.ndarray:
    """Image about half, text a quarter, video and audio the rest, shuffled."""
    names = np.array(["image"] * (n // 2) + ["text"] * (n // 4) + ["video"] * (n // 6) + ["audio"] * (n - n // 2 - n // 4 - n // 6))
    return names[np.random.default_rng(3).permutation(n)]


def grouped(kind: str, rank: int = 0, world_size: int = 2, step_batches: int = 3, weights=None, balanced=False,
            mods=None, seed: int = 4) -> BatchSampler:
    lengths = np.random.default_rng(1).integers(5, 90, size=N)
    split = {"costs": lengths**2 + 40 * lengths} if balanced else {}
    mods = modalities() if mods is None else mods
    if kind == "padded":
        return DistributedBatchSampler(lengths, micro_batch_size=2, world_size=world_size, rank=rank, seed=seed,
                                       group_by_length=True, weights=weights, step_batches=step_batches, modalities=mods,
                                       **split)
    return PackedBatchSampler(lengths, tokens_per_batch=200, world_size=world_size, rank=rank, seed=seed, weights=weights,
                              step_batches=step_batches, modalities=mods, **split)


def steps_of(kind: str, steps: int, world_size: int = 2, step_batches: int = 3, **kw) -> list[list[int]]:
    """The samples of each of `steps` optimizer steps over all ranks and accumulation steps."""
    runs = [take(grouped(kind, rank=r, world_size=world_size, step_batches=step_batches, **kw), steps * step_batches)
            for r in range(world_size)]
    return [[i for run in runs for batch in run[s * step_batches:(s + 1) * step_batches] for i in batch]
            for s in range(steps)]


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
def test_every_step_holds_one_modality_on_every_rank_and_accumulation_step(kind, weighted, balanced):
    weights = np.where(np.arange(N) % 2 == 0, 2.0, 0.5) if weighted else None
    sampler = grouped(kind, weights=weights, balanced=balanced)
    assert sampler.grouping and sampler.balancing == balanced
    assert sampler.batches_per_epoch % 3 == 0  # whole steps: every epoch starts a step
    n_steps = 3 * sampler.batches_per_epoch // 3 + 2  # over three epochs
    mods = modalities()
    seen = []
    for step in steps_of(kind, n_steps, weights=weights, balanced=balanced):
        groups = set(mods[step].tolist())
        assert len(groups) == 1 and len(step) >= 6, (groups, step)
        seen.append(groups.pop())
    assert set(seen) == {"image", "text", "video", "audio"}
    if balanced:  # a balanced step holds the same samples as the unbalanced one: still one modality
        plain = steps_of(kind, n_steps, weights=weights)
        assert [sorted(s) for s in steps_of(kind, n_steps, weights=weights, balanced=True)] == [sorted(s) for s in plain]


def test_every_sample_appears_once_per_epoch():
    # padded, 2 ranks x 2 samples x 3 accumulated: every group's count is a multiple of 12 samples, so none is dropped
    mods = np.array(["image"] * 120 + ["text"] * 60 + ["video"] * 36 + ["audio"] * 24)[np.random.default_rng(5).permutation(N)]
    sampler = grouped("padded", mods=mods)
    n = sampler.batches_per_epoch
    assert n == N // 4 and sampler.grouped(0)[1] == {"image": (120, 10), "video": (36, 3), "audio": (24, 2), "text": (60, 5)}
    steps = steps_of("padded", 2 * n // 3, mods=mods)
    for epoch in range(2):
        assert sorted(i for step in steps[epoch * n // 3:(epoch + 1) * n // 3] for i in step) == list(range(N)), epoch
    # packed, one rank, one bin a step: nothing to drop either
    single = grouped("packed", world_size=1, step_batches=1)
    bins = take(single, single.batches_per_epoch)
    assert sorted(i for b in bins for i in b) == list(range(N))
    # 2 ranks x 3 accumulated bins: the same bins (they do not depend on the world size), each group's last
    # incomplete step of 6 bins left out
    per_rank = [take(grouped("packed", rank=r), grouped("packed").batches_per_epoch) for r in range(2)]
    drawn = [tuple(b) for run in per_rank for b in run]
    assert set(drawn) <= {tuple(b) for b in bins} and len(drawn) == len(set(drawn))
    mods = modalities()
    for name in ("image", "text", "video", "audio"):
        formed = sum(mods[b[0]] == name for b in bins)
        assert sum(mods[b[0]] == name for b in drawn) == formed - formed % 6, name
    assert len(drawn) < len(bins)  # some were left out


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
def test_grouped_positions_resume_at_the_next_micro_batch(kind, weighted, balanced):
    weights = np.where(np.arange(N) % 2 == 0, 2.0, 0.5) if weighted else None
    n = grouped(kind, weights=weights).batches_per_epoch
    for rank in range(2):
        run = take(grouped(kind, rank=rank, weights=weights, balanced=balanced), 3 * n + 2)
        for position in (0, 1, 2, 4, n - 1, n, n + 1, 2 * n + 3):  # inside steps, across epoch ends
            resumed = grouped(kind, rank=rank, weights=weights, balanced=balanced)
            assert take(resumed, 5, position) == run[position:position + 5], (rank, position)


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_grouped_ranks_agree_and_steps_interleave_in_proportion(kind):
    ranks = [grouped(kind, rank=r) for r in range(2)]
    assert ranks[0].batches_per_epoch == ranks[1].batches_per_epoch
    for epoch in range(3):
        assert ranks[0].epoch_batches(epoch) == ranks[1].epoch_batches(epoch)
        plan_a, plan_b = ranks[0].global_batches(epoch), ranks[1].global_batches(epoch)
        assert [ranks[0].ranks_of(g) for g in plan_a] == [ranks[1].ranks_of(g) for g in plan_b]
    mods = modalities()
    sequence = [mods[step[0]] for step in steps_of(kind, ranks[0].batches_per_epoch // 3)]
    counts = {name: sequence.count(name) for name in set(sequence)}
    half = sequence[:len(sequence) // 2]
    for name, count in counts.items():  # spread over the epoch, not one group after the other
        assert abs(half.count(name) - count / 2) <= 1, (name, sequence)
    assert take(grouped(kind, seed=5), 6) != take(ranks[0], 6)  # the seed drives it


def test_interleave_spreads_each_stream_evenly():
    from vlmctl.data.samplers import interleave_steps

    picks = interleave_steps([6, 0, 3, 1], np.random.default_rng(0)).tolist()
    assert sorted(picks) == [0] * 6 + [2] * 3 + [3]
    for k, n in ((0, 6), (2, 3)):
        where = [j for j, p in enumerate(picks) if p == k]
        assert max(b - a for a, b in zip(where, where[1:])) <= 2 * len(picks) / n, (k, picks)
    assert interleave_steps([0, 0], np.random.default_rng(0)).tolist() == []


def test_modality_of_prefers_video_then_audio_then_image():
    from vlmctl.data.samplers import modality_groups, modality_of

    assert modality_of({"image": 2, "video": 1, "audio": 1}) == "video"
    assert modality_of({"image": 1, "audio": 1}) == "audio" and modality_of({"image": 3}) == "image"
    assert modality_of({}) == modality_of({"image": 0}) == "text"
    counts = {"image": np.array([1, 0, 1, 0, 2]), "video": np.array([0, 0, 1, 0, 0]), "audio": np.array([0, 0, 0, 1, 1])}
    assert modality_groups(counts).tolist() == ["image", "text", "video", "audio", "audio"]


def test_grouping_refuses_bad_modalities_and_groups_too_small_for_a_step():
    from vlmctl.errors import DataError

    lengths = np.full(12, 10)
    with pytest.raises(DataError, match="12 names"):
        DistributedBatchSampler(lengths, micro_batch_size=2, modalities=["image"] * 11)
    with pytest.raises(DataError, match="'sound'"):
        DistributedBatchSampler(lengths, micro_batch_size=2, modalities=["image"] * 11 + ["sound"])
    # 6 of each: a step of 2 ranks x 2 samples x 2 accumulated needs 8 of one modality
    mods = ["image", "text"] * 6
    with pytest.raises(DataError, match="group_by_modality"):
        DistributedBatchSampler(lengths, micro_batch_size=2, world_size=2, step_batches=2, modalities=mods)
    with pytest.raises(DataError, match="group_by_modality"):
        PackedBatchSampler(lengths, tokens_per_batch=20, world_size=2, step_batches=2, modalities=mods)
    ok = DistributedBatchSampler(lengths, micro_batch_size=2, world_size=2, step_batches=1, modalities=mods)
    assert ok.batches_per_epoch == 2 and ok.grouped(0)[1]["text"] == (6, 1)  # 2 of each group left out
