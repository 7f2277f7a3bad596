"""Training data over prepared Parquet shards: a map-style Dataset, resumable distributed batch samplers (padded
micro-batches or packed token-budget bins), and the DataLoader that applies the processor in its worker processes.

    ds = ShardDataset.from_dir(prepared_dir / "train")            # rows -> Sample
    sampler = DistributedBatchSampler(ds.lengths, micro_batch_size=4, world_size=2, rank=0, seed=0,
                                      group_by_length=True, weights=ds.sample_weights({"a.json": 2.0}))
    sampler.set_position(consumed=120)                             # resume: the next unseen micro-batch
    loader = build_loader(ds, sampler, Collator(processor), num_workers=2)

Epochs and weights: an epoch draws `round(weight * n)` samples from a source of `n` samples (weight 2 = twice
per epoch, 0.5 = a random half), shuffled together with a seed of (seed, epoch). The order is a pure function of
(seed, epoch, data), so the position to resume from is one integer: micro-batches consumed on each rank.

Length grouping follows transformers' `LengthGroupedSampler`: shuffled indices are cut into mega-batches of 50
global micro-batches, each sorted by length, so a global micro-batch holds samples of similar length (less
padding). A global micro-batch (world_size * micro_batch_size samples) is dealt to ranks with a stride, so every
rank gets a similar number of tokens.

Packing (`PackedBatchSampler`, with `PackedCollator`): an epoch's shuffled samples are grouped into bins of at most
`tokens_per_batch` tokens by streaming first-fit decreasing (`vlmctl.data.packing.first_fit_decreasing`, bounded
look-ahead) over their known lengths; the bins are shuffled and dealt to ranks in whole global micro-batches
(`world_size` bins), bin `g * world_size + r` to rank r. Every rank derives the same bin list from (seed, epoch,
lengths), so every rank has exactly the same number of micro-batches per epoch (no rank runs out before another:
no collective is needed to end an epoch) and the resume position is still one integer. The bin list does not
depend on the world size: 2 ranks x 1 bin per step see the same samples as 1 rank x 2 accumulated bins.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

MEGA_BATCH_MULT = 50
PACKING_LOOKAHEAD = 1024  # samples in the first-fit-decreasing buffer: bounded memory, near-optimal bins


class ShardDataset:
    """Map-style dataset of `Sample`s over Parquet shards (memory-mapped through `datasets`' Arrow cache).

    Raises DataError when the folder has no shards or a shard lacks the prepared schema's columns.
    """

    def __init__(self, files: list[Path]):
        import datasets

        if not files:
            raise DataError("no Parquet shards given", hint="run `vlmctl data prepare` first")
        self.files = [Path(f) for f in files]
        datasets.disable_progress_bars()
        try:
            self._ds = datasets.Dataset.from_parquet([str(f) for f in self.files], split="train")
        except Exception as exc:  # noqa: BLE001 - any read failure is reported with the folder and the fix
            raise DataError(f"cannot read the prepared shards in {self.files[0].parent}: {exc}",
                            hint="re-run `vlmctl data prepare` to rewrite them") from exc
        missing = {"id", "messages", "images"} - set(self._ds.column_names)
        if missing:
            raise DataError(f"shards in {self.files[0].parent} lack the columns {sorted(missing)}",
                            hint="these are not prepared shards: run `vlmctl data prepare`")
        table = self._ds.data
        self.sources: list[str] = table.column("source").to_pylist() if "source" in self._ds.column_names else [""] * len(self)
        self.lengths = self._lengths(table)

    @classmethod
    def from_dir(cls, folder: Path) -> "ShardDataset":
        folder = Path(folder)
        files = sorted(folder.glob("*.parquet"))
        if not files:
            raise DataError(f"no prepared shards (*.parquet) in {folder}",
                            hint="run `vlmctl data prepare` (it writes data.prepared_dir/train and /val)")
        return cls(files)

    def _lengths(self, table) -> np.ndarray:
        """Tokens per sample when prepare recorded them (`exact_lengths` is then True), else characters / 4 + 64
        per image (a rough proxy for ordering only; packing replaces it with `count_tokens`)."""
        n = len(self)
        self.exact_lengths = False
        if "num_tokens" in self._ds.column_names:
            known = table.column("num_tokens").to_pylist()
            if all(v is not None for v in known):
                self.exact_lengths = True
                return np.asarray(known, dtype=np.int64)
        out = np.zeros(n, dtype=np.int64)
        messages = table.column("messages").to_pylist()
        for i, conv in enumerate(messages):
            chars = sum(len(p.get("text") or "") for m in conv for p in m["content"])
            images = sum(1 for m in conv for p in m["content"] if p["type"] == "image")
            out[i] = chars // 4 + 64 * images
        return out

    def __len__(self) -> int:
        return self._ds.num_rows

    def __getitem__(self, index: int) -> Sample:
        row = self._ds.data.slice(int(index), 1).to_pylist()[0]
        return Sample.from_row(row)

    def count_tokens(self, processor, family_name: str | None) -> np.ndarray:
        """Exact tokens per sample (text + visual, what `encode_sample` produces) with `vlmctl.data.tokens.
        TokenCounter`, for shards prepared without a built model (no `num_tokens` column). Reads image headers only.
        """
        import io

        from PIL import Image

        from vlmctl.data.tokens import TokenCounter

        counter = TokenCounter(processor, family_name, self.files[0].parent)
        out = np.zeros(len(self), dtype=np.int64)
        for i in range(len(self)):
            sample = self[i]
            sizes = [Image.open(io.BytesIO(b)).size for b in sample.images]
            out[i] = counter.count(sample, sizes)
        return out

    def sample_weights(self, weight_by_source: dict[str, float]) -> np.ndarray:
        """Per-sample weight from each sample's `source` (unknown sources weigh 1)."""
        return np.asarray([weight_by_source.get(s, 1.0) for s in self.sources], dtype=np.float64)


def epoch_indices(num_samples: int, weights: np.ndarray | None, seed: int, epoch: int) -> np.ndarray:
    """The shuffled sample indices of one epoch, honouring per-sample weights (see module docstring)."""
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


class DistributedBatchSampler:
    """Yields this rank's micro-batches (lists of sample indices) forever, epoch after epoch, from a position.

    `global_micro_batch = world_size * micro_batch_size`; incomplete global micro-batches at the end of an epoch
    are dropped so every rank makes the same number of steps.
    """

    def __init__(self, lengths: np.ndarray, *, micro_batch_size: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 group_by_length: bool = False, weights: np.ndarray | None = None):
        self.lengths = np.asarray(lengths)
        self.micro_batch_size = micro_batch_size
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.group_by_length = group_by_length
        self.weights = weights
        self.consumed = 0
        per_epoch = len(epoch_indices(len(self.lengths), weights, seed, 0)) // self.global_micro_batch
        if per_epoch == 0:
            raise DataError(f"{len(self.lengths)} samples are fewer than one global micro-batch "
                            f"({world_size} ranks x {micro_batch_size} samples)",
                            hint="lower train.micro_batch_size or the number of processes, or add data")
        self.batches_per_epoch = per_epoch

    @property
    def global_micro_batch(self) -> int:
        return self.world_size * self.micro_batch_size

    def set_position(self, consumed: int) -> None:
        """Continue after `consumed` micro-batches (per rank) counted from the start of training."""
        self.consumed = int(consumed)

    def global_batches(self, epoch: int) -> np.ndarray:
        """[batches_per_epoch, global_micro_batch] sample indices of one epoch, for all ranks."""
        order = epoch_indices(len(self.lengths), self.weights, self.seed, epoch)
        g = self.global_micro_batch
        if self.group_by_length:
            mega = g * MEGA_BATCH_MULT
            chunks = []
            for start in range(0, len(order), mega):
                part = order[start:start + mega]
                chunks.append(part[np.argsort(-self.lengths[part], kind="stable")])
            order = np.concatenate(chunks)
        usable = self.batches_per_epoch * g
        batches = order[:usable].reshape(self.batches_per_epoch, g)
        if self.group_by_length:
            rng = np.random.default_rng([self.seed, epoch, 1])
            batches = batches[rng.permutation(len(batches))]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        consumed = self.consumed
        while True:
            epoch, offset = divmod(consumed, self.batches_per_epoch)
            batches = self.global_batches(epoch)
            for b in batches[offset:]:
                # Strided deal: with length grouping each rank gets a similar share of long and short samples.
                yield b[self.rank::self.world_size].tolist()
                consumed += 1


class PackedBatchSampler:
    """Yields this rank's packed micro-batches (lists of sample indices, at most `tokens_per_batch` tokens by
    `lengths`) forever, epoch after epoch, from a position (see the module docstring).

    Samples longer than `tokens_per_batch` are never drawn; `too_long` counts them (`data prepare` normally drops
    them as too_long). `batches_per_epoch` is epoch 0's count of micro-batches per rank (later epochs pack their own
    shuffle and may differ by a few bins). Raises DataError when an epoch makes fewer bins than ranks.
    """

    def __init__(self, lengths: np.ndarray, *, tokens_per_batch: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 weights: np.ndarray | None = None, lookahead: int = PACKING_LOOKAHEAD):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.tokens_per_batch = tokens_per_batch
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.weights = weights
        self.lookahead = lookahead
        self.consumed = 0
        self.too_long = int((self.lengths > tokens_per_batch).sum())
        self._plans: dict[int, list[list[int]]] = {}
        self.batches_per_epoch = self.epoch_batches(0)

    def set_position(self, consumed: int) -> None:
        """Continue after `consumed` micro-batches (per rank) counted from the start of training."""
        self.consumed = int(consumed)

    def bins(self, epoch: int) -> list[list[int]]:
        """All bins of `epoch` (sample indices), shuffled, for all ranks; the same list for any world size."""
        from vlmctl.data.packing import first_fit_decreasing

        if epoch not in self._plans:
            order = epoch_indices(len(self.lengths), self.weights, self.seed, epoch)
            order = order[self.lengths[order] <= self.tokens_per_batch]
            # keys are positions in the epoch's order: a weighted sample may be drawn twice
            items = ((pos, int(self.lengths[i])) for pos, i in enumerate(order))
            bins = [[int(order[pos]) for pos in b] for b in first_fit_decreasing(items, self.tokens_per_batch, self.lookahead)]
            # first-fit decreasing emits a buffer's bins from longest to shortest samples: shuffle them
            perm = np.random.default_rng([self.seed, epoch, 2]).permutation(len(bins))
            if len(self._plans) > 1:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = [bins[j] for j in perm]
        return self._plans[epoch]

    def epoch_batches(self, epoch: int) -> int:
        """Micro-batches per rank in `epoch` (incomplete global micro-batches at its end are dropped)."""
        n = len(self.bins(epoch)) // self.world_size
        if n == 0:
            raise DataError(f"{len(self.lengths) - self.too_long} samples pack into {len(self.bins(epoch))} bins of "
                            f"train.tokens_per_batch={self.tokens_per_batch} tokens, fewer than the {self.world_size} ranks",
                            hint="lower train.tokens_per_batch or the number of processes, or add data")
        return n

    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset = 0, self.consumed
        while offset >= self.epoch_batches(epoch):
            offset -= self.epoch_batches(epoch)
            epoch += 1
        while True:
            bins = self.bins(epoch)
            for g in range(offset, self.epoch_batches(epoch)):
                yield bins[g * self.world_size + self.rank]
            epoch, offset = epoch + 1, 0


def build_loader(dataset: Any, sampler: DistributedBatchSampler | PackedBatchSampler, collate_fn: Any, num_workers: int = 0, seed: int = 0):
    """A DataLoader running `collate_fn` (the processor) in `num_workers` worker processes."""
    import torch

    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        persistent_workers=False,
        prefetch_factor=2 if num_workers else None,
        generator=torch.Generator().manual_seed(seed),
    )
