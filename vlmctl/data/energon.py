"""Export prepared samples as a Megatron-Energon dataset (`data prepare --export energon DIR`).

Energon's dataset format: https://nvidia.github.io/Megatron-Energon/basic/data_prep.html (tars in the WebDataset
convention, `.nv-meta/` with the index and `dataset.yaml`). Three shapes, chosen by `data.export.energon_format`::

    vqa         {key}.jpg|png|webp  the image, as prepared (no re-encoding)
                {key}.txt           the answer (UTF-8)
                {key}.json          {"question", "id", "source", "num_tokens", "meta"}
                dataset.yaml        sample_type VQASample, field_map image: jpg[,png,webp], context: json[question],
                                    answers: txt
    captioning  {key}.jpg|png|webp, {key}.txt (the caption), {key}.json {"prompt", "id", "source", "num_tokens", "meta"}
                dataset.yaml        sample_type CaptioningSample, field_map image: ..., caption: txt
    crude       {key}.json          {"id", "source", "messages", "meta", "num_tokens"}: the canonical messages of
                                    `vlmctl.data.sample` (image parts point at `img{index}`)
                {key}.img0.jpg, {key}.img1.png, ...   (extension: the image's own encoding)
                dataset.yaml        CrudeWebdataset: samples are cooked in the task encoder (`cook_conversation`)

    DIR/train/shard-00000.tar, DIR/val/shard-00000.tar   keys `train_000000000`, `val_000000000`, ...
    DIR/.nv-meta/   .info.json, split.yaml, index.sqlite (`BaseWebdatasetFactory.prepare_dataset`, energon's
                    programmatic `energon prepare`) and dataset.yaml

`auto` picks captioning when every sample is single-image single-turn (`single_turn`) and every prompt is empty or a
generic caption instruction (`is_caption_prompt`), else vqa when every sample is single-image single-turn, else
crude. vqa and captioning read with stock energon (`get_train_dataset(DIR, ...)` yields `VQASample` /
`CaptioningSample`); crude needs a task encoder with the cooker::

    from megatron.energon import Cooker, DefaultTaskEncoder, get_train_dataset
    from vlmctl.data.energon import cook_conversation

    class MyEncoder(DefaultTaskEncoder):
        cookers = [Cooker(cook_conversation)]

Every shape also reads back through vlmctl's own `webdataset` format.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.energon import Sample as EnergonSample
from megatron.energon import basic_sample_keys, stateless

from vlmctl.data.sample import Sample
from vlmctl.errors import DataError, UsageError

SPLITS = ("train", "val")
FORMATS = ("auto", "vqa", "captioning", "crude")
CRUDE_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
IMAGE_ORDER = ("jpg", "png", "webp")
"""Extensions of exported images (prepared images are JPEG, PNG or WebP), in the order the field_map lists them."""

# Generic caption instructions: LLaVA's brief-description prompts (its pretraining set, LLaVA-Pretrain) and the
# plain forms. Compared after `_normalize` (case, whitespace and final punctuation do not matter).
CAPTION_PROMPTS = frozenset(
    re.sub(r"\s+", " ", p).strip().rstrip(".?!:").lower()
    for p in (
        "Describe the image concisely.",
        "Provide a brief description of the given image.",
        "Offer a succinct explanation of the picture presented.",
        "Summarize the visual content of the image.",
        "Give a short and clear explanation of the subsequent image.",
        "Share a concise interpretation of the image provided.",
        "Present a compact description of the photo's key features.",
        "Relay a brief, clear account of the picture shown.",
        "Render a clear and concise summary of the photo.",
        "Write a terse but informative summary of the picture.",
        "Create a compact narrative representing the image presented.",
        "Describe the image.", "Describe this image.", "Describe the picture.", "Describe this picture.",
        "Describe the photo.", "Describe this photo.", "Briefly describe the image.", "Briefly describe this image.",
        "Describe the image briefly.", "Caption the image.", "Caption this image.", "Write a caption.",
        "Write a caption for the image.", "Write a caption for this image.", "Generate a caption.",
        "Generate a caption for the image.", "Generate a caption for this image.", "Caption:",
    )
)


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().rstrip(".?!:").lower()


def is_caption_prompt(text: str) -> bool:
    """True when `text` is empty or one of `CAPTION_PROMPTS` (ignoring case, whitespace and final punctuation)."""
    return _normalize(text) in CAPTION_PROMPTS or not _normalize(text)


def single_turn(sample: Sample) -> tuple[str, str] | str:
    """`(question, answer)` when `sample` is one user turn holding one image and at most one text part, then one
    assistant turn of one text part (the question is "" when the user turn is the image alone); else a phrase saying
    why not ("has 2 images", ...), for messages."""
    others = [m for m, parts in sample.media.items() if m != "image" and parts]
    if others:
        return f"has {' and '.join(others)} parts"
    roles = [m["role"] for m in sample.messages]
    if "system" in roles:
        return "has a system turn"
    if roles != ["user", "assistant"]:
        return f"has {roles.count('user')} user turns"
    if len(sample.images) != 1:
        return f"has {len(sample.images)} images" if sample.images else "has no image"
    user, answer = (m["content"] for m in sample.messages)
    shown = sum(p["type"] == "image" for p in user)
    if shown != 1:
        return "shows its image more than once" if shown else "has its image outside the user turn"
    texts = [p["text"] for p in user if p["type"] == "text"]
    if len(texts) > 1:
        return "has text on both sides of its image"
    if len(answer) != 1 or answer[0]["type"] != "text":
        return "has an answer that is not one text part"
    return (texts[0] if texts else ""), answer[0]["text"]


@dataclass
class ConversationSample(EnergonSample):
    """An energon sample holding one canonical vlmctl conversation (the crude export, cooked)."""

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


def dataset_yaml(shape: str, image_extensions: Iterable[str] = ("jpg",)) -> str:
    """The `.nv-meta/dataset.yaml` of a shape: the `sample_type` + `field_map` form of energon's docs for vqa and
    captioning (image alternatives as `jpg,png`), `CrudeWebdataset` for crude."""
    if shape == "crude":
        return CRUDE_YAML
    exts = sorted(set(image_extensions), key=lambda e: (IMAGE_ORDER + (e,)).index(e)) or ["jpg"]
    image = ",".join(exts)
    if shape == "vqa":
        cls, fields = "VQASample", {"image": image, "context": "json[question]", "answers": "txt"}
    elif shape == "captioning":
        cls, fields = "CaptioningSample", {"image": image, "caption": "txt"}
    else:
        raise UsageError(f"unknown energon shape {shape!r}", hint=f"use one of: {', '.join(FORMATS)}")
    return (
        f"sample_type:\n  __module__: megatron.energon\n  __class__: {cls}\nfield_map:\n"
        + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in fields.items())
    )


def read_shards(files: Iterable[Path]) -> Iterator[Sample]:
    """The samples of prepared Parquet shards (`vlmctl.data.sample.arrow_schema`), in file and row order, a few
    rows in memory at a time."""
    import pyarrow.parquet as pq

    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=16):
            for row in batch.to_pylist():
                yield Sample.from_row(row)


class EnergonWriter:
    """Writes an energon dataset in two steps: `add(split, sample)` for every prepared sample as it comes (checks
    its shape, writes nothing), then `finish(shards)` resolves the shape (`auto` needs every sample first) and
    writes the tars in one pass over the same samples, read back from the prepared Parquet shards.

    `energon_format`: auto | vqa | captioning | crude (`data.export.energon_format`). `add` raises DataError for a
    sample that does not fit an explicit vqa or captioning (naming it and the fix); `finish` raises DataError when
    no sample was added. Shards are about `shard_bytes` each.
    """

    def __init__(self, root: Path, shard_bytes: int, energon_format: str = "auto"):
        if energon_format not in FORMATS:
            raise UsageError(f"unknown data.export.energon_format {energon_format!r}", hint=f"use one of: {', '.join(FORMATS)}")
        self.root = Path(root)
        self.shard_bytes = shard_bytes
        self.requested = energon_format
        self._count: dict[str, int] = {s: 0 for s in SPLITS}
        self._not_single: str | None = None  # why the first sample that is not single-turn single-image is not
        self._not_caption: str | None = None  # the first single-turn sample whose prompt is not a caption prompt
        self._extensions: set[str] = set()
        self._writers: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._shard_no: dict[str, int] = {}
        self.shards: list[str] = []

    def add(self, split: str, sample: Sample) -> None:
        where = f"sample {sample.id!r}" + (f" ({sample.location})" if sample.location else "")
        parts = single_turn(sample)
        if isinstance(parts, str):
            if self.requested in ("vqa", "captioning"):
                raise DataError(
                    f"{where} cannot be exported with data.export.energon_format={self.requested}: it {parts}; "
                    f"{self.requested} samples are one user turn with one image and one answer",
                    hint="set data.export.energon_format to auto or crude (a crude export holds any conversation), "
                    "or leave such samples out of data.sources",
                )
            if self._not_single is None:
                self._not_single = f"{where} {parts}"
        else:
            if self._not_caption is None and not is_caption_prompt(parts[0]):
                self._not_caption = f"{where} asks {parts[0][:80]!r}, not a generic caption instruction"
            self._extensions.add(_extension(sample.images[0]))
        self._count[split] += 1

    @property
    def shape(self) -> str:
        """The shape `finish` writes: the requested one, or what `auto` resolves to for the samples added so far."""
        return self._resolve()[0]

    def _resolve(self) -> tuple[str, str | None]:
        if self.requested != "auto":
            return self.requested, None
        if self._not_single is not None:
            return "crude", f"auto: crude, since {self._not_single}"
        if self._not_caption is not None:
            return "vqa", f"auto: vqa, since {self._not_caption}"
        return "captioning", "auto: captioning, since every sample is one image with a generic caption prompt and one answer"

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

    def _members(self, shape: str, sample: Sample) -> dict[str, bytes]:
        if shape == "crude":
            record = {"id": sample.id, "source": sample.source, "messages": sample.messages, "meta": sample.meta, "num_tokens": sample.num_tokens}
            obj = {"json": json.dumps(record, ensure_ascii=False).encode()}
            for i, img in enumerate(sample.images):
                obj[f"img{i}.{_extension(img)}"] = img
            return obj
        question, answer = single_turn(sample)  # add() checked the shape
        image = sample.images[0]
        # captioning has no question: the prompt is kept under another name, so that readers that take a json
        # `question` as VQA (vlmctl's webdataset reader does) read the sample as a caption.
        record = {"question" if shape == "vqa" else "prompt": question, "id": sample.id, "source": sample.source,
                  "num_tokens": sample.num_tokens, "meta": sample.meta}
        return {_extension(image): image, "txt": answer.encode(), "json": json.dumps(record, ensure_ascii=False).encode()}

    def finish(self, shards: dict[str, list[Path]], workers: int = 1) -> dict[str, Any]:
        """Write the tars from `shards` ({split: prepared Parquet files} holding the added samples, in the same
        order), then `.nv-meta` through energon. Returns {path, format, format_note, samples: {split: n}, shards}."""
        from megatron.energon.flavors import BaseWebdatasetFactory

        if not any(self._count.values()):
            raise DataError("no samples to export: every sample was rejected", hint="see rejected.jsonl of the prepared data")
        shape, note = self._resolve()
        for split in SPLITS:
            n = 0
            for sample in read_shards(shards.get(split, [])):
                # Keys must be unique over the whole dataset (energon refuses duplicates): split + running number.
                obj = {"__key__": f"{split}_{n:09d}", **self._members(shape, sample)}
                self._sizes[split] = self._sizes.get(split, 0) + self._writer(split).write(obj)
                n += 1
            if n != self._count[split]:
                raise RuntimeError(f"energon export: {n} samples in the {split} shards, {self._count[split]} added")
        for w in self._writers.values():
            w.close()
        # An empty split has no shard (energon refuses empty tars); its split part is an empty list. The empty
        # `test` part lets `energon lint DIR` run with its default --split-parts train,val,test.
        # energon prints progress to stdout; keep our stdout clean (it may be --json).
        with contextlib.redirect_stdout(io.StringIO()):
            BaseWebdatasetFactory.prepare_dataset(
                self.root,
                self.shards,
                split_parts_patterns=[(split, f"^{split}/.*") for split in (*SPLITS, "test")],
                shuffle_seed=None,
                workers=1 if workers is None else max(1, min(workers, len(self.shards))),
            )
        (self.root / ".nv-meta" / "dataset.yaml").write_text(dataset_yaml(shape, self._extensions))
        return {"path": str(self.root), "format": shape, "format_note": note, "samples": dict(self._count),
                "shards": list(self.shards)}
