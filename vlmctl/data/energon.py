"""Export prepared samples as a Megatron-Energon dataset (`data prepare --export energon DIR`).

Energon's dataset format: https://nvidia.github.io/Megatron-Energon/basic/data_prep.html (tars in the WebDataset
convention, `.nv-meta/` with the index and `dataset.yaml`). Three shapes, chosen by `data.export.energon_format`::

    vqa         {key}.jpg|png|webp  the image, as prepared (no re-encoding)
                {key}.txt           the answer (UTF-8)
                {key}.json          {"question", "id", "source", "num_tokens", "meta"}
                dataset.yaml        sample_type VQASample, field_map image: jpg[,png,webp], context: json[question],
                                    answers: txt
                or, when every sample's one medium is a video:
                {key}.mkv|mp4|webm|mov|avi   the clip, as prepared, {key}.txt, {key}.json as above
                dataset.yaml        sample_type VidQASample, field_map video: mkv[,...], context: json[question],
                                    answers: txt
    captioning  {key}.jpg|png|webp, {key}.txt (the caption), {key}.json {"prompt", "id", "source", "num_tokens", "meta"}
                dataset.yaml        sample_type CaptioningSample, field_map image: ..., caption: txt
    crude       {key}.json          {"id", "source", "messages", "meta", "num_tokens"}: the canonical messages of
                                    `vlmctl.data.sample` (image parts point at `img{index}`, video parts at
                                    `vid{index}`, audio parts at `aud{index}`)
                {key}.img0.jpg, {key}.img1.png, ...   (extension: the image's own encoding)
                {key}.vid0.mkv, ..., {key}.aud0.flac, ...   (the clips; extension: the container the bytes are)
                dataset.yaml        CrudeWebdataset: samples are cooked in the task encoder (`cook_conversation`)

    DIR/train/shard-00000.tar, DIR/val/shard-00000.tar   keys `train_000000000`, `val_000000000`, ...
    DIR/.nv-meta/   .info.json, split.yaml, index.sqlite (`BaseWebdatasetFactory.prepare_dataset`, energon's
                    programmatic `energon prepare`) and dataset.yaml

Video and audio members are the prepared clips byte for byte (`vlmctl.data.sample`: video as stored after the
checks, Motion JPEG in Matroska, so `.mkv`; audio 16-bit mono FLAC, `.flac`). Energon's default decoder turns a
member ending in `.mp4`, `.mkv`, `.webm`, `.mov`, `.avi`, `.flac`, `.wav` or `.mp3` into an `AVDecoder` (decoded on
demand: `get_video()`, `get_audio()`, `get_clips(...)`; "AV Decoder" of
https://nvidia.github.io/Megatron-Energon/basic/data_decoding.html, energon >= 7, needs its `av_decode` extra:
PyAV, filetype). The typed sample energon's docs list for video is `VidQASample(video, context, answers)` (the
sample types of data_prep.html), used for single-turn single-video data; energon has no typed sample for audio, nor
for a sample mixing media or interleaving several, so those go to crude, as multi-image samples do.

`auto` picks captioning when every sample is single-image single-turn (`single_turn`) and every prompt is empty or a
generic caption instruction (`is_caption_prompt`), else vqa when every sample is single-turn with one image, or every
sample single-turn with one video, else crude. vqa and captioning read with stock energon (`get_train_dataset(DIR,
...)` yields `VQASample` / `VidQASample` / `CaptioningSample`); crude needs a task encoder with the cooker::

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron.energon import Sample as EnergonSample
from megatron.energon import basic_sample_keys, stateless

from vlmctl.data.sample import Sample
from vlmctl.errors import DataError, UsageError

# pyarrow is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# megatron and webdataset (optional dependencies) are imported only where used, so the rest works without them.
# Light vlmctl modules are imported next to their use as well.

SPLITS = ("train", "val")
FORMATS = ("auto", "vqa", "captioning", "crude")
CRUDE_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
IMAGE_ORDER = ("jpg", "png", "webp")
"""Extensions of exported images (prepared images are JPEG, PNG or WebP), in the order the field_map lists them."""
VIDEO_ORDER = ("mkv", "mp4", "webm", "mov", "avi")
"""Extensions of exported videos (prepared clips are Matroska; the others are containers energon's AV decoder takes by
member name), in the order the field_map lists them."""
AUDIO_ORDER = ("flac", "wav", "mp3")
"""Extensions of exported audio clips (prepared audio is FLAC; the others are energon's AV decoder's audio names)."""
MEMBER_PREFIX = {"image": "img", "video": "vid", "audio": "aud"}
"""Modality -> the stem of its numbered crude members (`img0.png`, `vid0.mkv`, `aud0.flac`)."""

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


def medium(sample: Sample) -> str:
    """The modality a single-turn sample's one medium is: "video" when it has video parts, else "image"."""
    return "video" if sample.videos else "image"


def single_turn(sample: Sample) -> tuple[str, str] | str:
    """`(question, answer)` when `sample` is one user turn holding one image (or one video) and at most one text
    part, then one assistant turn of one text part (the question is "" when the user turn is the medium alone); else
    a phrase saying why not ("has 2 images", "has audio parts", ...), for messages. Audio never fits: energon has no
    typed sample for it."""
    present = [m for m, parts in sample.media.items() if parts]
    if "audio" in present or len(present) > 1:
        return f"has {' and '.join(present)} parts"
    roles = [m["role"] for m in sample.messages]
    if "system" in roles:
        return "has a system turn"
    if roles != ["user", "assistant"]:
        return f"has {roles.count('user')} user turns"
    kind = medium(sample)
    parts = sample.media.get(kind, [])
    if len(parts) != 1:
        return f"has {len(parts)} {kind}s" if parts else "has no image"
    user, answer = (m["content"] for m in sample.messages)
    shown = sum(p["type"] == kind for p in user)
    if shown != 1:
        return f"shows its {kind} more than once" if shown else f"has its {kind} outside the user turn"
    texts = [p["text"] for p in user if p["type"] == "text"]
    if len(texts) > 1:
        return f"has text on both sides of its {kind}"
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
    videos: list[Any] = field(default_factory=list)  # energon AVDecoder objects by default (decoded on demand)
    audios: list[Any] = field(default_factory=list)  # likewise


@stateless
def cook_conversation(sample: dict) -> ConversationSample:
    """Energon cooker: a crude sample of the vlmctl export -> ConversationSample (images, videos and audio clips
    each in index order)."""
    record = sample["json"]
    if isinstance(record, (bytes, str)):
        record = json.loads(record)

    def numbered(modality: str) -> list[Any]:
        stem = MEMBER_PREFIX[modality]
        names = (k for k in sample if re.fullmatch(rf"{stem}\d+\..+", k))
        return [sample[k] for k in sorted(names, key=lambda k: int(k[len(stem):].split(".")[0]))]

    return ConversationSample(
        **basic_sample_keys(sample),
        id=record["id"],
        messages=record["messages"],
        images=numbered("image"),
        meta=record.get("meta") or {},
        num_tokens=record.get("num_tokens"),
        videos=numbered("video"),
        audios=numbered("audio"),
    )


def media_extension(modality: str, data: bytes) -> str | None:
    """The member extension of a medium's bytes: an image's own encoding (`_extension`); for a video the container
    (`mkv`, `webm`, `mp4`, `mov`, `avi`), for audio `flac`, `wav` or `mp3`, from the file signature; None for a
    container energon's AV decoder does not take by name. Sources: Matroska/WebM start with the EBML magic 1A 45 DF A3
    and name their DocType in the header (RFC 9559); ISO BMFF files have an `ftyp` box first, brand `qt  ` for
    QuickTime (ISO/IEC 14496-12); AVI and WAV are RIFF forms; FLAC starts with `fLaC`; MP3 with an ID3 tag or a frame
    sync."""
    if modality == "image":
        return _extension(data)
    if modality == "video":
        if data[:4] == b"\x1a\x45\xdf\xa3":
            return "webm" if b"webm" in data[:64] else "mkv"
        if data[4:8] == b"ftyp":
            return "mov" if data[8:12] == b"qt  " else "mp4"
        if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
            return "avi"
        return None
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _extension(data: bytes) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    from vlmctl.data.images import open_image

    with open_image(data) as im:
        return (im.format or "png").lower()


def dataset_yaml(shape: str, image_extensions: Iterable[str] = ("jpg",), modality: str = "image") -> str:
    """The `.nv-meta/dataset.yaml` of a shape: the `sample_type` + `field_map` form of energon's docs for vqa and
    captioning (alternatives as `jpg,png`; `image_extensions` are the video's for `modality="video"`, which makes vqa
    a `VidQASample`), `CrudeWebdataset` for crude. Raises UsageError for an unknown shape, or captioning of video."""
    if shape == "crude":
        return CRUDE_YAML
    order = VIDEO_ORDER if modality == "video" else IMAGE_ORDER
    exts = sorted(set(image_extensions), key=lambda e: (order + (e,)).index(e)) or [order[0]]
    media = ",".join(exts)
    if shape == "vqa" and modality == "video":
        cls, fields = "VidQASample", {"video": media, "context": "json[question]", "answers": "txt"}
    elif shape == "captioning" and modality == "video":
        raise UsageError("energon has no captioning sample for video", hint="use vqa (VidQASample) or crude")
    elif shape == "vqa":
        cls, fields = "VQASample", {"image": media, "context": "json[question]", "answers": "txt"}
    elif shape == "captioning":
        cls, fields = "CaptioningSample", {"image": media, "caption": "txt"}
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
    sample that does not fit an explicit vqa or captioning (naming it and the fix: a video sample in a captioning
    export, or image and video samples in one vqa export, included), and for a video or audio clip in a container
    energon's AV decoder does not take by name; `finish` raises DataError when no sample was added. Shards are about
    `shard_bytes` each.
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
        self._extensions: set[str] = set()  # of the single-turn samples' one medium
        self._first: dict[str, str] = {}  # medium of single-turn samples -> the first sample with it
        self._writers: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._shard_no: dict[str, int] = {}
        self.shards: list[str] = []

    def add(self, split: str, sample: Sample) -> None:
        where = f"sample {sample.id!r}" + (f" ({sample.location})" if sample.location else "")
        for modality in ("video", "audio"):
            for i, clip in enumerate(sample.media.get(modality, [])):
                if media_extension(modality, clip) is None:
                    names = ", ".join(VIDEO_ORDER if modality == "video" else AUDIO_ORDER)
                    raise DataError(
                        f"{where} cannot be exported to energon: its {modality} {i} is not in a container energon's "
                        f"AV decoder reads by member name ({names}; starts with {bytes(clip[:12])!r})",
                        hint=f"prepare the data again (prepared {modality} is stored as "
                        f"{'Matroska' if modality == 'video' else 'FLAC'}), or leave the sample out of data.sources",
                    )
        parts = single_turn(sample)
        if not isinstance(parts, str):
            kind = medium(sample)
            if kind == "video" and self.requested == "captioning":
                parts = "has a video (energon's CaptioningSample holds an image)"
            elif self.requested == "vqa" and self._first and kind not in self._first:
                other, a = next(iter(self._first)), {"image": "an image", "video": "a video"}
                parts = f"has {a[kind]} while {self._first[other]} has {a[other]} (one energon dataset has one sample type)"
        if isinstance(parts, str):
            if self.requested in ("vqa", "captioning"):
                media = "one image" if self.requested == "captioning" else "one image (or, for all samples, one video)"
                raise DataError(
                    f"{where} cannot be exported with data.export.energon_format={self.requested}: it {parts}; "
                    f"{self.requested} samples are one user turn with {media} and one answer",
                    hint="set data.export.energon_format to auto or crude (a crude export holds any conversation and "
                    "any media), or leave such samples out of data.sources",
                )
            if self._not_single is None:
                self._not_single = f"{where} {parts}"
        else:
            kind = medium(sample)
            self._first.setdefault(kind, where)
            if self._not_caption is None and kind == "video":
                self._not_caption = f"{where} has a video (energon's CaptioningSample holds an image)"
            if self._not_caption is None and not is_caption_prompt(parts[0]):
                self._not_caption = f"{where} asks {parts[0][:80]!r}, not a generic caption instruction"
            self._extensions.add(media_extension(kind, sample.media[kind][0]))
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
        if len(self._first) > 1:
            return "crude", (f"auto: crude, since {self._first['video']} has a video and {self._first['image']} an "
                             "image (one energon dataset has one sample type: VQASample or VidQASample)")
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
            for modality, parts in sample.media.items():
                for i, data in enumerate(parts):
                    obj[f"{MEMBER_PREFIX[modality]}{i}.{media_extension(modality, data)}"] = data
            return obj
        question, answer = single_turn(sample)  # add() checked the shape
        kind = medium(sample)
        data = sample.media[kind][0]
        # captioning has no question: the prompt is kept under another name, so that readers that take a json
        # `question` as VQA (vlmctl's webdataset reader does) read the sample as a caption.
        record = {"question" if shape == "vqa" else "prompt": question, "id": sample.id, "source": sample.source,
                  "num_tokens": sample.num_tokens, "meta": sample.meta}
        return {media_extension(kind, data): data, "txt": answer.encode(), "json": json.dumps(record, ensure_ascii=False).encode()}

    def move_split(self, source: str, target: str) -> None:
        """Count the samples added to `source` as `target`'s (empty until then): the prepared split they are in
        was renamed (`prepare._val_to_train`)."""
        self._count[target], self._count[source] = self._count[target] + self._count[source], 0

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
        modality = "video" if "video" in self._first else "image"
        (self.root / ".nv-meta" / "dataset.yaml").write_text(dataset_yaml(shape, self._extensions, modality))
        return {"path": str(self.root), "format": shape, "format_note": note, "samples": dict(self._count),
                "shards": list(self.shards)}
