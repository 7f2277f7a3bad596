"""Resumable distributed batch samplers: one base, and one subclass per way of forming micro-batches.

    sampler = DistributedBatchSampler(lengths, micro_batch_size=4, world_size=2, rank=0, seed=0,
                                      group_by_length=True, weights=weights)
    sampler.set_position(120)        # resume: the next unseen micro-batch of this rank
    for indices in sampler: ...      # this rank's micro-batches (lists of sample indices), forever

Every sampler works the same way (`BatchSampler`): an epoch is a list of *global* micro-batches, a pure function
of (seed, epoch, lengths, weights), the same on every rank; each global micro-batch is dealt to the ranks, one
micro-batch each. So every rank makes the same number of steps per epoch (no collective is needed to end one),
and the position to resume from is one integer: micro-batches consumed on each rank. Subclasses only say how an
epoch's global micro-batches are formed (`global_batches`) and dealt (`deal`).

Epochs and weights (`epoch_indices`): an epoch draws `round(weight * n)` samples from a source of `n` samples
(weight 2 = twice per epoch, 0.5 = a random half), shuffled together with a seed of (seed, epoch).

Length grouping (`DistributedBatchSampler`) follows transformers' `LengthGroupedSampler`: shuffled indices are cut
into mega-batches of 50 global micro-batches, each sorted by length, so a global micro-batch holds samples of
similar length (less padding). A global micro-batch (world_size * micro_batch_size samples) is dealt to ranks with
a stride, so every rank gets a similar number of tokens.

Packing (`PackedBatchSampler`, with `PackedCollator`): an epoch's shuffled samples are grouped into bins of at most
`tokens_per_batch` tokens by streaming first-fit decreasing (`vlmctl.data.packing.first_fit_decreasing`, bounded
look-ahead) over their known lengths; the bins are shuffled and dealt to ranks in whole global micro-batches
(`world_size` bins), bin `g * world_size + r` to rank r. The bin list does not depend on the world size: 2 ranks x
1 bin per step see the same samples as 1 rank x 2 accumulated bins.

Compute balancing (`costs=`, `step_batches=`): ranks that get equal tokens can still get unequal work (visual
tokens through the vision tower, attention's quadratic term, labelled tokens through the LM head), and every step
waits for the busiest rank. With per-sample costs (training FLOPs, `vlmctl.train.flops.CostModel.sample_costs`)
the sampler takes each optimizer step's `step_batches` global micro-batches (those of one optimizer step: steps
start at multiples of `step_batches` micro-batches from the start of training) and splits the same samples again
into `step_batches x world_size` micro-batches of as equal cost as possible (`vlmctl.data.packing.balance_bins`),
each within `tokens_per_batch` tokens (packed) or of `micro_batch_size` samples (padded); the micro-batches of
similar cost form one global micro-batch, dealt one per rank. A step holds the same samples with or without
balancing, so its loss (a mean over the global batch's labelled tokens) is the same; the order stays a pure function
of (seed, epoch, lengths, weights, costs) and resumes from the same one integer.

Modality grouping (`modalities=`, `train.group_by_modality`): each sample has one modality group (`modality_of`:
video if it has a video part, else audio if it has an audio part, else image if it has an image, else text). The
epoch's shuffled (weighted) order is split into one stream per group, in that order; each stream forms its global
micro-batches as above (length grouping, packing) and is cut into whole optimizer steps of `step_batches` global
micro-batches (a stream's last incomplete step is dropped, as an incomplete global micro-batch is: a group with
fewer samples than one step is never drawn, and `vlmctl.train.data.build_sampler` warns of it). The steps of
the streams are interleaved in proportion to their counts (`interleave_steps`), so every optimizer step, on every
rank and accumulation step, holds samples of one group. Every epoch is then a whole number of steps (steps keep
starting at multiples of `step_batches`), the order stays a pure function of (seed, epoch, lengths, weights,
modalities, costs), and compute balancing re-splits a step's samples among themselves, within the group.
`batches_per_epoch` is epoch 0's count (with fractional weights a later epoch's group sizes, and so its count, may
differ by a step or so).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from vlmctl.data.packing import balance_bins, first_fit_decreasing
from vlmctl.errors import DataError

MEGA_BATCH_MULT = 50
PACKING_LOOKAHEAD = 1024  # samples in the first-fit-decreasing buffer: bounded memory, near-optimal bins

MODALITY_GROUPS = ("image", "video", "audio", "text")
"""The modality groups of `train.group_by_modality` (`modality_of`), in the order of the sampler's streams."""

GROUP_MEDIA = {"video": ("video", "audio", "image"), "audio": ("audio", "image"), "image": ("image",), "text": ()}
"""The media a sample of each group may carry (`modality_of`'s precedence): a video sample may also have audio or
images, an audio sample images, an image sample only images, a text sample none."""


def modality_of(counts: Mapping[str, int]) -> str:
    """The modality group of one sample with `counts` media parts per modality (`Encoded.media_counts`, or the part
    types of its messages): "video" if it has a video, else "audio" if it has audio, else "image" if it has images,
    else "text"."""
    return next((name for name in ("video", "audio", "image") if counts.get(name)), "text")


def modality_groups(counts: Mapping[str, np.ndarray]) -> np.ndarray:
    """`modality_of` of every sample: `counts` maps a modality to its parts per sample (int arrays [N]; a missing
    modality counts 0). Returns the group names (str array [N])."""
    n = len(next(iter(counts.values()))) if counts else 0
    out = np.full(n, "text", dtype="<U5")
    for name in ("image", "audio", "video"):  # the strongest last: it wins
        if name in counts:
            out[np.asarray(counts[name]) > 0] = name
    return out


def interleave_steps(counts: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """The stream of each of `sum(counts)` optimizer steps, stream k having `counts[k]`, spread in proportion: the
    j-th step of stream k sits at (j + u_k) / counts[k] of the epoch, with u_k uniform in [0, 1) from `rng` (a
    phase per epoch), ties to the lower k. Returns stream indices (int64 [sum(counts)])."""
    phase = rng.random(len(counts))
    at = [(np.arange(n) + phase[k]) / n for k, n in enumerate(counts) if n]
    who = [np.full(n, k, dtype=np.int64) for k, n in enumerate(counts) if n]
    if not who:
        return np.zeros(0, dtype=np.int64)
    who_all = np.concatenate(who)
    return who_all[np.lexsort((who_all, np.concatenate(at)))]


def epoch_indices(num_samples: int, weights: np.ndarray | None, seed: int, epoch: int) -> np.ndarray:
    """The shuffled sample indices of one epoch, honouring per-sample weights (see the module docstring)."""
    rng = np.random.default_rng([seed, epoch])
    if weights is None or np.all(weights == 1.0):
        return rng.permutation(num_samples)
    picks = []
    for w in np.unique(weights):
        members = np.flatnonzero(weights == w)
        whole, frac = divmod(float(w), 1.0)
        reps = [members] * int(whole)
        extra = int(round(frac * len(members)))
        if extra:
            reps.append(rng.choice(members, size=extra, replace=False))
        picks.extend(reps)
    order = np.concatenate(picks) if picks else np.zeros(0, dtype=np.int64)
    return order[rng.permutation(len(order))]


def balance_step(parts: Sequence[Sequence[int]], lengths: np.ndarray, costs: np.ndarray, *, world_size: int,
                 budget: int | None = None, size: int | None = None) -> list[list[list[int]]]:
    """One optimizer step's micro-batches `parts` (sample indices, `world_size` per global micro-batch) split again
    into as many micro-batches of as equal cost as possible (`vlmctl.data.packing.balance_bins`, `parts` as the
    feasible start), each within `budget` tokens (packed) or of `size` samples (padded). `lengths`, `costs`: int
    arrays over all samples (tokens; integer costs, `integer_costs`). Returns the global micro-batches, each a
    list of `world_size` micro-batches (one per rank, in rank order), heaviest first. Raises ValueError when the
    constraints admit no grouping."""
    start, items = [], []
    for part in parts:
        start.append(list(range(len(items), len(items) + len(part))))
        items.extend(part)
    order = np.asarray(items, dtype=np.int64)
    groups = balance_bins(np.asarray(lengths)[order], np.asarray(costs)[order], len(start), budget=budget, size=size,
                          start=start)
    return [[order[g].tolist() for g in groups[j:j + world_size]] for j in range(0, len(groups), world_size)]


class BatchSampler:
    """Yields this rank's micro-batches (lists of sample indices) forever, epoch after epoch, from a position.

    `lengths`: tokens per sample (int64 [N]); `weights`: per-sample draw weights [N] or None (see
    `epoch_indices`). Subclasses implement `form(order, key)` (the global micro-batches of some samples, for all
    ranks) and `deal(global_batch)` (this rank's share), and set `batches_per_epoch` (epoch 0's micro-batches per
    rank); `global_batches(epoch)` are the epoch's global micro-batches and `epoch_batches(epoch)` their count (the
    default: the same for all epochs).

    `costs`: estimated training FLOPs per sample [N] (`CostModel.sample_costs`), or None for no compute balancing;
    `step_batches`: micro-batches per rank in one optimizer step (`train.gradient_accumulation_steps`), the unit
    balanced together (module docstring). Subclasses then also implement `ranks_of` and set `budget` or `size`.
    `modalities`: each sample's modality group [N] (`modality_groups`; names of `MODALITY_GROUPS`), or None to mix
    them; given, every optimizer step holds one group (module docstring).
    Raises DataError for costs of another length than `lengths`, negative or not finite, and for modalities of
    another length or not of `MODALITY_GROUPS`.
    """

    batches_per_epoch: int

    budget: int | None = None  # tokens per micro-batch when balancing (packed)
    size: int | None = None  # samples per micro-batch when balancing (padded)

    def __init__(self, lengths: np.ndarray, *, world_size: int = 1, rank: int = 0, seed: int = 0,
                 weights: np.ndarray | None = None, costs: np.ndarray | None = None, step_batches: int = 1,
                 modalities: Sequence[str] | np.ndarray | None = None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.weights = weights
        self.step_batches = int(step_batches)
        self.costs = integer_costs(costs, len(self.lengths))
        self.groups = _group_codes(modalities, len(self.lengths))
        self._grouped: dict[int, tuple[list[Any], dict[str, tuple[int, int]]]] = {}
        self.consumed = 0

    def set_position(self, consumed: int) -> None:
        """Continue after `consumed` micro-batches (per rank) counted from the start of training."""
        self.consumed = int(consumed)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's shuffled (weighted) sample indices."""
        return epoch_indices(len(self.lengths), self.weights, self.seed, epoch)

    def form(self, order: np.ndarray, key: list[int]) -> Sequence[Any]:
        """The global micro-batches (for all ranks) of the samples `order`, in order; `key` seeds their shuffles."""
        raise NotImplementedError

    @property
    def grouping(self) -> bool:
        """Whether every optimizer step holds one modality group (`modalities` given)."""
        return self.groups is not None

    def global_batches(self, epoch: int) -> Sequence[Any]:
        """The epoch's global micro-batches, for all ranks, in order."""
        if self.grouping:
            return self.grouped(epoch)[0]
        return self.form(self.epoch_order(epoch), [self.seed, epoch])

    def grouped(self, epoch: int) -> tuple[list[Any], dict[str, tuple[int, int]]]:
        """With modality grouping: the epoch's global micro-batches (whole optimizer steps, one group each, the
        streams interleaved; module docstring) and, per group of `MODALITY_GROUPS`, (samples drawn this epoch,
        optimizer steps formed of them). The two latest epochs are kept."""
        if epoch not in self._grouped:
            order, s = self.epoch_order(epoch), self.step_batches
            steps, counts = [], {}
            for k, name in enumerate(MODALITY_GROUPS):
                stream = order[self.groups[order] == k]
                batches = self.form(stream, [self.seed, epoch, 3, k])
                steps.append([batches[j:j + s] for j in range(0, len(batches) - s + 1, s)])
                counts[name] = (len(stream), len(steps[-1]))
            picks = interleave_steps([len(x) for x in steps], np.random.default_rng([self.seed, epoch, 4]))
            streams = [iter(x) for x in steps]
            plan = [batch for k in picks for batch in next(streams[k])]
            if len(self._grouped) > 1:
                self._grouped.pop(min(self._grouped))
            self._grouped[epoch] = (plan, counts)
        return self._grouped[epoch]

    def deal(self, global_batch: Any) -> list[int]:
        """This rank's micro-batch of one global micro-batch."""
        raise NotImplementedError

    def epoch_batches(self, epoch: int) -> int:
        """Micro-batches per rank in `epoch`."""
        return self.batches_per_epoch

    def check_grouped(self, epoch: int) -> int:
        """Micro-batches per rank in `epoch` under modality grouping. Raises DataError when no group has the
        samples of one optimizer step."""
        plan, counts = self.grouped(epoch)
        if not plan:
            have = ", ".join(f"{name} {n}" for name, (n, _) in counts.items() if n)
            raise DataError(f"with train.group_by_modality no modality has the samples of one optimizer step "
                            f"({self.step_batches} x {self.world_size} micro-batches) in epoch {epoch} (samples: {have})",
                            hint="turn train.group_by_modality off, lower train.gradient_accumulation_steps, the batch "
                            "size or the number of processes, or add data")
        return len(plan)

    def locate(self, consumed: int) -> tuple[int, int]:
        """(epoch, micro-batch within it) of the `consumed`-th micro-batch of this rank."""
        epoch, offset = 0, consumed
        while offset >= self.epoch_batches(epoch):
            offset -= self.epoch_batches(epoch)
            epoch += 1
        return epoch, offset

    @property
    def balancing(self) -> bool:
        """Whether each step's samples are split again by cost (costs given, more than one micro-batch a step)."""
        return self.costs is not None and self.step_batches * self.world_size > 1

    def stream(self, consumed: int) -> Iterator[Any]:
        """The global micro-batches from the `consumed`-th on, across epochs."""
        epoch, offset = self.locate(consumed)
        while True:
            batches = self.global_batches(epoch)
            for g in range(offset, len(batches)):
                yield batches[g]
            epoch, offset = epoch + 1, 0

    def ranks_of(self, global_batch: Any) -> list[list[int]]:
        """Every rank's micro-batch of one global micro-batch, in rank order."""
        raise NotImplementedError

    def balance(self, step: list[Any]) -> list[list[list[int]]]:
        """One optimizer step's global micro-batches split again by cost (module docstring): as many global
        micro-batches, each a list of `world_size` micro-batches (sample indices), heaviest first."""
        parts = [part for global_batch in step for part in self.ranks_of(global_batch)]
        return balance_step(parts, self.lengths, self.costs, world_size=self.world_size, budget=self.budget,
                            size=self.size)

    def __iter__(self) -> Iterator[list[int]]:
        if not self.balancing:
            yield from (self.deal(global_batch) for global_batch in self.stream(self.consumed))
            return
        first = self.consumed - self.consumed % self.step_batches  # where this step began
        stream, skip = self.stream(first), self.consumed - first
        while True:
            for global_batch in self.balance([next(stream) for _ in range(self.step_batches)]):
                if skip:
                    skip -= 1
                    continue
                yield global_batch[self.rank]


class DistributedBatchSampler(BatchSampler):
    """Micro-batches of `micro_batch_size` samples, optionally grouped by length (see the module docstring).

    `global_micro_batch = world_size * micro_batch_size`; incomplete global micro-batches at the end of an epoch
    are dropped so every rank makes the same number of steps. Raises DataError when the data is smaller than one
    global micro-batch (with `modalities`: when no modality has one optimizer step of samples).
    """

    def __init__(self, lengths: np.ndarray, *, micro_batch_size: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 group_by_length: bool = False, weights: np.ndarray | None = None, costs: np.ndarray | None = None,
                 step_batches: int = 1, modalities: Sequence[str] | np.ndarray | None = None):
        super().__init__(lengths, world_size=world_size, rank=rank, seed=seed, weights=weights, costs=costs,
                         step_batches=step_batches, modalities=modalities)
        self.micro_batch_size = self.size = micro_batch_size
        self.group_by_length = group_by_length
        per_epoch = len(self.epoch_order(0)) // self.global_micro_batch
        if per_epoch == 0:
            raise DataError(f"{len(self.lengths)} samples are fewer than one global micro-batch "
                            f"({world_size} ranks x {micro_batch_size} samples)",
                            hint="lower train.micro_batch_size or the number of processes, or add data")
        self.batches_per_epoch = self.check_grouped(0) if self.grouping else per_epoch

    @property
    def global_micro_batch(self) -> int:
        return self.world_size * self.micro_batch_size

    def epoch_batches(self, epoch: int) -> int:
        return self.check_grouped(epoch) if self.grouping else self.batches_per_epoch

    def locate(self, consumed: int) -> tuple[int, int]:
        if self.grouping:  # fractional weights can change an epoch's group sizes: walk the epochs
            return super().locate(consumed)
        return divmod(consumed, self.batches_per_epoch)  # every epoch has the same number of micro-batches

    def form(self, order: np.ndarray, key: list[int]) -> np.ndarray:
        """[len(order) // global_micro_batch, global_micro_batch] sample indices of `order`, for all ranks."""
        g = self.global_micro_batch
        if self.group_by_length:
            mega = g * MEGA_BATCH_MULT
            chunks = []
            for start in range(0, len(order), mega):
                part = order[start:start + mega]
                chunks.append(part[np.argsort(-self.lengths[part], kind="stable")])
            order = np.concatenate(chunks) if chunks else order
        n = len(order) // g
        batches = order[:n * g].reshape(n, g)
        if self.group_by_length:
            rng = np.random.default_rng([*key, 1])
            batches = batches[rng.permutation(len(batches))]
        return batches

    def deal(self, global_batch: np.ndarray) -> list[int]:
        # Strided deal: with length grouping each rank gets a similar share of long and short samples.
        return global_batch[self.rank::self.world_size].tolist()

    def ranks_of(self, global_batch: np.ndarray) -> list[list[int]]:
        return [global_batch[r::self.world_size].tolist() for r in range(self.world_size)]


class PackedBatchSampler(BatchSampler):
    """Packed micro-batches: bins of at most `tokens_per_batch` tokens by `lengths` (see the module docstring).

    Samples longer than `tokens_per_batch` are never drawn; `too_long` counts them (`data prepare` normally drops
    them as too_long). `batches_per_epoch` is epoch 0's count of micro-batches per rank (later epochs pack their own
    shuffle and may differ by a few bins). Raises DataError when an epoch makes fewer bins than ranks (with
    `modalities`: when no modality has one optimizer step of bins).
    """

    def __init__(self, lengths: np.ndarray, *, tokens_per_batch: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 weights: np.ndarray | None = None, lookahead: int = PACKING_LOOKAHEAD, costs: np.ndarray | None = None,
                 step_batches: int = 1, modalities: Sequence[str] | np.ndarray | None = None):
        super().__init__(lengths, world_size=world_size, rank=rank, seed=seed, weights=weights, costs=costs,
                         step_batches=step_batches, modalities=modalities)
        self.tokens_per_batch = self.budget = tokens_per_batch
        self.lookahead = lookahead
        self.too_long = int((self.lengths > tokens_per_batch).sum())
        self._plans: dict[int, list[list[int]]] = {}
        self.batches_per_epoch = self.epoch_batches(0)

    def pack(self, order: np.ndarray, key: list[int]) -> list[list[int]]:
        """The bins of the samples `order` (sample indices), shuffled with `key`; the same for any world size."""
        order = order[self.lengths[order] <= self.tokens_per_batch]
        # keys are positions in the epoch's order: a weighted sample may be drawn twice
        items = ((pos, int(self.lengths[i])) for pos, i in enumerate(order))
        bins = [[int(order[pos]) for pos in b] for b in first_fit_decreasing(items, self.tokens_per_batch, self.lookahead)]
        # first-fit decreasing emits a buffer's bins from longest to shortest samples: shuffle them
        perm = np.random.default_rng([*key, 2]).permutation(len(bins))
        return [bins[j] for j in perm]

    def bins(self, epoch: int) -> list[list[int]]:
        """All bins of `epoch` (sample indices), shuffled, for all ranks, without modality grouping; the same list
        for any world size. The two latest epochs are kept."""
        if epoch not in self._plans:
            if len(self._plans) > 1:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = self.pack(self.epoch_order(epoch), [self.seed, epoch])
        return self._plans[epoch]

    def epoch_batches(self, epoch: int) -> int:
        """Micro-batches per rank in `epoch` (incomplete global micro-batches at its end are dropped)."""
        if self.grouping:
            return self.check_grouped(epoch)
        n = len(self.bins(epoch)) // self.world_size
        if n == 0:
            raise DataError(f"{len(self.lengths) - self.too_long} samples pack into {len(self.bins(epoch))} bins of "
                            f"train.tokens_per_batch={self.tokens_per_batch} tokens, fewer than the {self.world_size} ranks",
                            hint="lower train.tokens_per_batch or the number of processes, or add data")
        return n

    def form(self, order: np.ndarray, key: list[int]) -> list[list[list[int]]]:
        """[len(bins) // world_size, world_size] bins of `order`: global micro-batch g holds bins g * world_size to
        (g + 1) * world_size - 1."""
        return _cut(self.pack(order, key), self.world_size)

    def global_batches(self, epoch: int) -> list[list[list[int]]]:
        """[epoch_batches(epoch), world_size] bins of one epoch (`form` of its order; its bins are kept)."""
        return super().global_batches(epoch) if self.grouping else _cut(self.bins(epoch), self.world_size)

    def deal(self, global_batch: list[list[int]]) -> list[int]:
        return global_batch[self.rank]

    def ranks_of(self, global_batch: list[list[int]]) -> list[list[int]]:
        return [list(b) for b in global_batch]


def _cut(bins: list[list[int]], world_size: int) -> list[list[list[int]]]:
    """Consecutive bins in global micro-batches of `world_size` (an incomplete last one dropped)."""
    return [bins[g * world_size:(g + 1) * world_size] for g in range(len(bins) // world_size)]


def _group_codes(modalities: Sequence[str] | np.ndarray | None, n: int) -> np.ndarray | None:
    """Each sample's index in `MODALITY_GROUPS` (int64 [n]), or None for None. Raises DataError for another length
    or a name not of `MODALITY_GROUPS`."""
    if modalities is None:
        return None
    names = np.asarray(modalities).astype(str)
    codes = np.full(len(names), -1, dtype=np.int64)
    for k, name in enumerate(MODALITY_GROUPS):
        codes[names == name] = k
    if names.shape != (n,) or (codes < 0).any():
        odd = sorted(set(names[codes < 0].tolist()))[:3]
        raise DataError(f"sample modalities must be {n} names of {list(MODALITY_GROUPS)}, got {len(names)}"
                        + (f" with {odd}" if odd else ""), hint="pass ShardDataset.modalities() of the sampler's samples")
    return codes


def integer_costs(costs: np.ndarray | None, n: int) -> np.ndarray | None:
    """`costs` [n] scaled to integers (the largest 2^40) so every rank sums and compares them exactly the same
    way; None stays None. Raises DataError for a wrong length or negative or non-finite costs."""
    if costs is None:
        return None
    costs = np.asarray(costs, dtype=np.float64)
    if costs.shape != (n,) or not np.isfinite(costs).all() or (costs < 0).any():
        raise DataError(f"sample costs must be {n} finite non-negative numbers, got shape {costs.shape}",
                        hint="pass CostModel.sample_costs of the sampler's samples")
    top = costs.max() if n else 0.0
    return np.rint(costs / top * 2.0**40).astype(np.int64) if top > 0 else np.zeros(n, dtype=np.int64)
