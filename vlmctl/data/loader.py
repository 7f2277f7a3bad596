"""Training data over prepared Parquet shards: a map-style Dataset, and the DataLoader that applies the processor in
its worker processes. The resumable distributed batch samplers live in `vlmctl.data.samplers` (re-exported here).

    ds = ShardDataset.from_dir(prepared_dir / "train")            # rows -> Sample
    sampler = DistributedBatchSampler(ds.lengths, micro_batch_size=4, world_size=2, rank=0, seed=0,
                                      group_by_length=True, weights=ds.sample_weights({"a.json": 2.0}))
    sampler.set_position(consumed=120)                             # resume: the next unseen micro-batch
    loader = build_loader(ds, sampler, Collator(processor), num_workers=2)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vlmctl.data.sample import MEDIA_COLUMNS, MODALITIES, Sample
from vlmctl.data.samplers import (
    MEGA_BATCH_MULT,
    PACKING_LOOKAHEAD,
    BatchSampler,
    DistributedBatchSampler,
    PackedBatchSampler,
    epoch_indices,
    modality_groups,
)
from vlmctl.errors import DataError

# datasets, pyarrow and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up)
# must not pay for them.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

TEST_DATA_DELAY = "VLMCTL_TEST_DATA_DELAY"

__all__ = [
    "MEGA_BATCH_MULT", "PACKING_LOOKAHEAD", "BatchSampler", "DistributedBatchSampler", "PackedBatchSampler",
    "ShardDataset", "build_loader", "epoch_indices",
]


class ShardDataset:
    """Map-style dataset of `Sample`s over Parquet shards (memory-mapped through `datasets`' Arrow cache).

    `sample_costs`: estimated training FLOPs per sample (float64 [N]) for compute-balanced batching, set by the
    trainer (`vlmctl.train.data.load_data`); None when batches are not balanced.

    Raises DataError when the folder has no shards or a shard lacks the prepared schema's columns.
    """

    sample_costs: np.ndarray | None = None

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
        per media part (a rough proxy for ordering only; packing replaces it with `count_tokens`)."""
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
            parts = sum(1 for m in conv for p in m["content"] if p["type"] in MODALITIES)
            out[i] = chars // 4 + 64 * parts
        return out

    @property
    def column_names(self) -> list[str]:
        """The shards' columns (`id`, `messages`, `images`, and `rejected` for preference pairs, `num_tokens`, ...)."""
        return list(self._ds.column_names)

    def __len__(self) -> int:
        return self._ds.num_rows

    def __getitem__(self, index: int) -> Sample:
        row = self._ds.data.slice(int(index), 1).to_pylist()[0]
        return Sample.from_row(row)

    def count_tokens(self, processor, family_name: str | None) -> np.ndarray:
        """Exact tokens per sample (text + visual, what `encode_sample` produces) with `vlmctl.data.tokens.
        TokenCounter`, for shards prepared without a built model (no `num_tokens` column); a preference pair counts
        both its conversations, as they are packed (`checks.count_tokens`). Reads image headers only.
        """
        from vlmctl.data.checks import count_tokens
        from vlmctl.data.modalities.image import image_size
        from vlmctl.data.tokens import TokenCounter

        counter = TokenCounter(processor, family_name, self.files[0].parent)
        out = np.zeros(len(self), dtype=np.int64)
        for i in range(len(self)):
            sample = self[i]
            sizes = [image_size(b) for b in sample.images]
            out[i] = count_tokens(counter, sample, sizes)
        return out

    def text_counts(self) -> dict[str, np.ndarray]:
        """Per sample, read from the `messages` column without decoding media (vectorized with pyarrow): `chars`
        (characters of all text parts), `label_chars` (of the assistant turns' text), `images` (image parts),
        `media` (image, video and audio parts: the items a vision or audio tower encodes) and `<modality>_parts`
        per modality of `MODALITIES`. int64 arrays [N]."""
        import pyarrow as pa
        import pyarrow.compute as pc

        msgs = self._ds.data.column("messages").combine_chunks()
        turns = pc.list_flatten(msgs)
        content = pc.struct_field(turns, "content")
        parts = pc.list_flatten(content)
        part_turn = np.asarray(pc.list_parent_indices(content))
        sample_of_part = np.asarray(pc.list_parent_indices(msgs))[part_turn]
        chars = np.asarray(pc.fill_null(pc.utf8_length(pc.struct_field(parts, "text")), 0), dtype=np.float64)
        assistant = np.asarray(pc.fill_null(pc.equal(pc.struct_field(turns, "role"), "assistant"), False))
        kinds = pc.struct_field(parts, "type")
        is_image = np.asarray(pc.fill_null(pc.equal(kinds, "image"), False))
        is_media = np.asarray(pc.fill_null(pc.is_in(kinds, value_set=pa.array(list(MODALITIES))), False))
        n = len(self)
        count = lambda weights: np.bincount(sample_of_part, weights=weights, minlength=n).astype(np.int64)  # noqa: E731
        parts = {f"{name}_parts": count(np.asarray(pc.fill_null(pc.equal(kinds, name), False), dtype=np.float64))
                 for name in MODALITIES}
        return {"chars": count(chars), "label_chars": count(chars * assistant[part_turn]),
                "images": count(is_image.astype(np.float64)), "media": count(is_media.astype(np.float64)), **parts}

    def modalities(self) -> np.ndarray:
        """Each sample's modality group for `train.group_by_modality` (`vlmctl.data.samplers.modality_of`: video,
        audio, image or text) from the types of its messages' content parts, read from the `messages` column without
        decoding media (vectorized with pyarrow). Returns a str array [N]."""
        import pyarrow.compute as pc

        msgs = self._ds.data.column("messages").combine_chunks()
        content = pc.struct_field(pc.list_flatten(msgs), "content")
        kinds = pc.struct_field(pc.list_flatten(content), "type")
        sample_of_part = np.asarray(pc.list_parent_indices(msgs))[np.asarray(pc.list_parent_indices(content))]
        n = len(self)
        counts = {name: np.bincount(sample_of_part[np.asarray(pc.fill_null(pc.equal(kinds, name), False))], minlength=n)
                  for name in MODALITIES}
        return modality_groups(counts)

    def count_estimates(self, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """Visual and labelled tokens per sample for `vlmctl.train.flops.CostModel.sample_costs`, estimated from
        `lengths` (tokens per sample, text + visual: the prepared `num_tokens`) and `text_counts`, since prepared
        shards record only the total. Returns int64 arrays [N]: `visual_tokens` (image, video and audio tokens),
        `labelled_tokens`, `images` (media items: images, videos and audio clips, each one item of
        `CostModel.sample_costs`); and `media`, the same per modality, {modality: {"tokens": [N], "items": [N]}} for
        each of `MODALITIES` (`CostModel.sample_costs(media=...)` charges each encoder its own modalities).

        Approximation: text tokens = a * chars + b, with a (tokens per character) and b (chat-template tokens per
        sample) fitted by least squares on this data set: on its samples without media (all their tokens are
        text) when there are at least 8, else on all samples as tokens ~ a * chars + c * media (+ b when some
        samples have none; c: mean tokens per media item). A fit outside 0 < a < 2 falls back to a = 1/4,
        b = 0 (about four characters per token, the usual figure for English BPE tokenizers). A sample without
        media is all text; one with images, videos or audio clips has visual tokens = tokens - text tokens (at
        least 0). Labelled tokens
        = text tokens x the assistant turns' share of the characters. Where prepare recorded each media item's tokens
        (the `media_tokens` column, `media_token_sums`), a sample's visual tokens are their sum, exactly, and its
        text tokens the rest; samples without the record (older shards, samples prepared without a processor) are
        estimated as above, their visual tokens split evenly over their media items. The estimate only ranks and
        weighs samples for balancing.
        """
        counts = self.text_counts()
        tokens = np.asarray(lengths, dtype=np.float64)
        chars, media = counts["chars"].astype(np.float64), counts["media"].astype(np.float64)
        a, b = _text_fit(tokens, chars, media)
        text = np.where(media > 0, np.clip(a * chars + b, 0, tokens), tokens)
        known, counted = self.media_token_sums(media)
        text = np.where(known, np.clip(tokens - counted, 0, None), text)
        share = np.divide(counts["label_chars"], chars, out=np.zeros_like(chars), where=chars > 0)
        visual = tokens - text
        per_item = np.divide(visual, media, out=np.zeros_like(visual), where=media > 0)
        split_known, by_modality = self.media_token_split()
        exact = known & split_known
        out_media = {}
        for name in MODALITIES:
            items = counts[f"{name}_parts"].astype(np.float64)
            split = np.where(exact, by_modality[name], per_item * items)
            out_media[name] = {"tokens": np.rint(split).astype(np.int64), "items": counts[f"{name}_parts"]}
        return {"visual_tokens": np.rint(visual).astype(np.int64),
                "labelled_tokens": np.rint(text * share).astype(np.int64), "images": counts["media"], "media": out_media}

    def media_token_sums(self, media: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(known, tokens): per sample, whether prepare recorded the placeholder tokens of every media item it uses
        (the `media_tokens` column holds one count per stored item and the sample uses each item once: `media`
        [N], its media parts, equals the record's length) and their sum. bool and float64 arrays [N]; all False
        for shards without the column."""
        n = len(self)
        known, total = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.float64)
        if "media_tokens" not in self._ds.column_names:
            return known, total
        for i, row in enumerate(self._ds.data.column("media_tokens").to_pylist()):
            if row is not None and len(row) == int(media[i]):
                known[i], total[i] = True, float(sum(row))
        return known, total

    def media_token_split(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(known, tokens): per sample, whether the `media_tokens` column records one count per stored media item
        (items in `MODALITIES` order, the stored items of each modality: the `images`, `videos`, `audios` columns),
        and per modality the sum of its items' counts. bool [N] and float64 arrays [N] (zeros where not known)."""
        n = len(self)
        known, out = np.zeros(n, dtype=bool), {name: np.zeros(n, dtype=np.float64) for name in MODALITIES}
        if "media_tokens" not in self._ds.column_names:
            return known, out
        import pyarrow.compute as pc

        table = self._ds.data
        # the item counts only: the media bytes stay unread
        stored = {name: np.asarray(pc.fill_null(pc.list_value_length(table.column(MEDIA_COLUMNS[name])), 0))
                  if MEDIA_COLUMNS[name] in self._ds.column_names else np.zeros(n, dtype=np.int64) for name in MODALITIES}
        for i, row in enumerate(table.column("media_tokens").to_pylist()):
            sizes = [int(stored[name][i]) for name in MODALITIES]
            if row is None or len(row) != sum(sizes):
                continue
            known[i], start = True, 0
            for name, size in zip(MODALITIES, sizes):
                out[name][i] = float(sum(row[start:start + size]))
                start += size
        return known, out

    def sample_weights(self, weight_by_source: dict[str, float]) -> np.ndarray:
        """Per-sample weight from each sample's `source` (unknown sources weigh 1)."""
        return np.asarray([weight_by_source.get(s, 1.0) for s in self.sources], dtype=np.float64)


def _text_fit(tokens: np.ndarray, chars: np.ndarray, images: np.ndarray) -> tuple[float, float]:
    """(tokens per character, tokens per sample) of the text (`ShardDataset.count_estimates`)."""
    plain = images == 0
    if plain.sum() >= 8 and np.ptp(chars[plain]) > 0:
        columns, target = [chars[plain], np.ones(int(plain.sum()))], tokens[plain]
    else:  # with images in every sample a per-sample constant cannot be told from the visual tokens: no intercept
        columns, target = [chars, np.ones_like(chars) if plain.any() else np.zeros_like(chars), images], tokens
    if len(target) < len(columns):
        return 0.25, 0.0
    coef = np.linalg.lstsq(np.stack(columns, axis=1), target, rcond=None)[0]
    return (float(coef[0]), float(coef[1])) if 0 < coef[0] < 2 else (0.25, 0.0)


class DelayedCollate:
    """`collate_fn` that sleeps `seconds` first: a slow data loader on one rank, for tests of the straggler
    metrics (`data_wait`)."""

    def __init__(self, collate_fn: Any, seconds: float):
        self.collate_fn = collate_fn
        self.seconds = seconds

    def __call__(self, samples):
        import time

        time.sleep(self.seconds)
        return self.collate_fn(samples)


def injected_data_delay(rank: int) -> float:
    """Seconds each micro-batch of global `rank` is delayed by, from VLMCTL_TEST_DATA_DELAY=rank:seconds (tests
    only; 0 when unset or naming another rank). Raises DataError when the value is malformed."""
    import os

    value = os.environ.get(TEST_DATA_DELAY, "").strip()
    if not value:
        return 0.0
    try:
        who, seconds = value.split(":")
        return float(seconds) if int(who) == rank else 0.0
    except ValueError:
        raise DataError(f"{TEST_DATA_DELAY}={value!r} is not rank:seconds",
                        hint=f"unset {TEST_DATA_DELAY} (a test hook), or give e.g. 1:0.5") from None


def build_loader(dataset: Any, sampler: BatchSampler, collate_fn: Any, num_workers: int = 0, seed: int = 0):
    """A DataLoader running `collate_fn` (the processor) in `num_workers` worker processes. Under the test hook
    VLMCTL_TEST_DATA_DELAY (`injected_data_delay`) the named rank's micro-batches are each delayed."""
    import os

    import torch

    delay = injected_data_delay(int(os.environ.get("RANK", "0")))
    if delay > 0:
        collate_fn = DelayedCollate(collate_fn, delay)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        persistent_workers=False,
        prefetch_factor=2 if num_workers else None,
        generator=torch.Generator().manual_seed(seed),
    )
