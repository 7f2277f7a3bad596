"""Export prepared samples as a Megatron-Energon dataset (`data prepare --export energon DIR`).

Layout (https://nvidia.github.io/Megatron-Energon/basic/data_prep.html)::

    DIR/train/shard-00000.tar   {key}.json + {key}.img0.jpg, {key}.img1.png, ...   (WebDataset convention)
    DIR/val/shard-00000.tar
    DIR/.nv-meta/               .info.json, split.yaml, index.sqlite (written by
                                `BaseWebdatasetFactory.prepare_dataset`, energon's programmatic `energon prepare`)
    DIR/.nv-meta/dataset.yaml   CrudeWebdataset: samples are cooked in the task encoder

`{key}.json` holds `{"id", "source", "messages", "meta", "num_tokens"}` with the canonical messages of
`vlmctl.data.sample` (image parts point at `img{index}`). Load it with a task encoder that uses
`cook_conversation`::

    from megatron.energon import Cooker, DefaultTaskEncoder, get_train_dataset
    from vlmctl.data.energon import cook_conversation

    class MyEncoder(DefaultTaskEncoder):
        cookers = [Cooker(cook_conversation)]

The tars also read back through vlmctl's own `webdataset` format.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.energon import Sample as EnergonSample
from megatron.energon import basic_sample_keys, stateless

from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

DATASET_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
SPLITS = ("train", "val")


@dataclass
class ConversationSample(EnergonSample):
    """An energon sample holding one canonical vlmctl conversation."""

    id: str
    messages: list[dict[str, Any]]
    images: list[Any]  # decoded by energon's decoder (torch tensors, C x H x W, float in [0, 1], by default)
    meta: dict[str, Any]
    num_tokens: int | None


@stateless
def cook_conversation(sample: dict) -> ConversationSample:
    """Energon cooker: a crude sample of the vlmctl export -> ConversationSample (images in index order)."""
    record = sample["json"]
    if isinstance(record, (bytes, str)):
        record = json.loads(record)
    images = [sample[k] for k in sorted((k for k in sample if k.startswith("img")), key=lambda k: int(k[3:].split(".")[0]))]
    return ConversationSample(
        **basic_sample_keys(sample),
        id=record["id"],
        messages=record["messages"],
        images=images,
        meta=record.get("meta") or {},
        num_tokens=record.get("num_tokens"),
    )


def _extension(data: bytes) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return (im.format or "png").lower()


class EnergonWriter:
    """Writes samples into per-split tar shards, then indexes them with energon (`finish`)."""

    def __init__(self, root: Path, shard_bytes: int):
        self.root = Path(root)
        self.shard_bytes = shard_bytes
        self._writers: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._shard_no: dict[str, int] = {}
        self._count: dict[str, int] = {s: 0 for s in SPLITS}
        self.shards: list[str] = []

    def _writer(self, split: str):
        import webdataset as wds

        w = self._writers.get(split)
        if w is not None and self._sizes[split] < self.shard_bytes:
            return w
        if w is not None:
            w.close()
        n = self._shard_no.get(split, -1) + 1
        self._shard_no[split] = n
        rel = f"{split}/shard-{n:05d}.tar"
        (self.root / split).mkdir(parents=True, exist_ok=True)
        # mtime=0 and a fixed owner keep the tars identical for identical inputs.
        w = wds.TarWriter(str(self.root / rel), encoder=False, mtime=0, user="vlmctl", group="vlmctl")
        self._writers[split], self._sizes[split] = w, 0
        self.shards.append(rel)
        return w

    def add(self, split: str, sample: Sample) -> None:
        record = {"id": sample.id, "source": sample.source, "messages": sample.messages, "meta": sample.meta, "num_tokens": sample.num_tokens}
        # Keys must be unique over the whole dataset (energon refuses duplicates): split + running number.
        obj: dict[str, Any] = {"__key__": f"{split}_{self._count[split]:09d}", "json": json.dumps(record, ensure_ascii=False).encode()}
        for i, img in enumerate(sample.images):
            obj[f"img{i}.{_extension(img)}"] = img
        self._count[split] += 1
        self._sizes[split] = self._sizes.get(split, 0) + self._writer(split).write(obj)

    def finish(self, workers: int = 1) -> dict[str, Any]:
        """Close the shards, write `.nv-meta` through energon, and return {split: samples}."""
        from megatron.energon.flavors import BaseWebdatasetFactory

        for w in self._writers.values():
            w.close()
        if not self.shards:
            raise DataError("no samples to export: every sample was rejected", hint="see rejected.jsonl of the prepared data")
        # An empty split has no shard (energon refuses empty tars); its split part is an empty list.
        # energon prints progress to stdout; keep our stdout clean (it may be --json).
        with contextlib.redirect_stdout(io.StringIO()):
            BaseWebdatasetFactory.prepare_dataset(
                self.root,
                self.shards,
                split_parts_patterns=[(split, f"^{split}/.*") for split in SPLITS],
                shuffle_seed=None,
                workers=1 if workers is None else max(1, min(workers, len(self.shards))),
            )
        (self.root / ".nv-meta" / "dataset.yaml").write_text(DATASET_YAML)
        return {"path": str(self.root), "samples": dict(self._count), "shards": list(self.shards)}
