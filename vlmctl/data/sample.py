"""The canonical sample every reader produces and every consumer (prepare, train, eval) reads.

A sample is a conversation plus its media parts, by modality::

    Sample(
        id="llava-000012",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "You are helpful."}]},
            {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ],
        images=[b"\\xff\\xd8..."],          # encoded bytes, 8-bit RGB JPEG/PNG/WebP, in order of first use
        source="llava_format.json",
        meta={"answers": ["cat", "a cat"]},  # optional: eval references, options, question type...
    )
    sample.media == {"image": [b"\\xff\\xd8..."]}   # the same parts, by modality

Roles are `system|user|assistant`; content parts are `{"type": "text", "text": str}` or
`{"type": <modality>, "index": int}` with a modality of `MODALITIES` (an index into `media[<modality>]`; readers
produce `image`, `video` and `audio` parts). This is the same shape as transformers' chat templates' content parts, so
`processor.apply_chat_template` can render it after the media are attached. `Sample(images=...)`,
`Sample(videos=...)`, `Sample(audios=...)` and `Sample(media={...})` build the same thing; `sample.images` is
`sample.media["image"]`.

Prepared shards store one row per sample with the Arrow schema of `arrow_schema()`: each modality has a column
(`MEDIA_COLUMNS`: `images`, `videos`, `audios`) of `{bytes, path}` structs. `images` is always there and uses the
layout of `datasets.Image`, so `datasets.load_dataset("parquet", ...)` decodes images to PIL; the `videos` and
`audios` columns are optional (shards without them read as having none) and are written only when asked for.
Video parts are stored clips after the checks (`vlmctl.data.modalities.video.normalize_video`: the sampled frames as
Motion JPEG in Matroska), audio parts 16-bit mono FLAC (`vlmctl.data.modalities.audio.normalize_audio`), references
before. The `audios` column is plain `{bytes, path}` structs rather than `datasets.Audio` (decoding that needs
torchcodec); `datasets.Audio(decode=False)` reads the same layout.

A preference sample (DPO pairs) is the same conversation whose last turn is the chosen assistant answer, plus the
rejected answer to the same prompt in `rejected`, an assistant message of text parts::

    Sample(id="pair-7", messages=[system?, user..., assistant (chosen)], images=[...],
           rejected={"role": "assistant", "content": [{"type": "text", "text": "A dog."}]})
    sample.prompt_messages()    # messages[:-1]: shared by both answers (and their media)
    sample.chosen_messages()    # messages
    sample.rejected_messages()  # messages[:-1] + [rejected]

Its shards have a `rejected` column (a message struct, null for samples without one), written only when a sample
has a rejected answer; shards without the column read as having none. Read without it, a preference shard is SFT
data on the chosen answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vlmctl.errors import DataError

# pyarrow is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

SCHEMA_VERSION = 1

MODALITIES = ("image", "video", "audio")
"""Media a sample can carry, in the order their parts are stored and hashed; the `type` of their content parts."""

MEDIA_COLUMNS = {"image": "images", "video": "videos", "audio": "audios"}
"""Modality -> its column in prepared shards (and its keyword of `Sample`)."""

REJECTED_COLUMN = "rejected"
"""Column of prepared shards holding a preference sample's rejected assistant message (see the module docstring)."""


@dataclass(init=False)
class Sample:
    """One conversation and its media parts.

    `media` maps a modality of `MODALITIES` to its parts: encoded bytes (before `vlmctl.data.checks.check_images`,
    readers' references: paths, URLs, bytes). `media["image"]` is always present (possibly empty); the other
    modalities appear only when the sample has parts of them. Raises DataError for an unknown modality.
    """

    id: str
    messages: list[dict[str, Any]]
    media: dict[str, list[Any]]
    source: str
    meta: dict[str, Any]
    num_tokens: int | None  # text + media tokens under the project's processor, when known
    location: str = field(compare=False)  # where it was read (file:line, shard:key); not stored in shards
    # placeholder tokens per part, by modality, when counted; stored as the `media_tokens` column (parts in
    # `MODALITIES` order) so that training reads them instead of estimating them
    media_tokens: dict[str, list[int]] = field(compare=False)
    rejected: dict[str, Any] | None  # preference samples: the rejected assistant message (the chosen one is messages[-1])

    def __init__(self, id: str, messages: list[dict[str, Any]], images: list[Any] | None = None, source: str = "",
                 meta: dict[str, Any] | None = None, num_tokens: int | None = None, location: str = "", *,
                 videos: list[Any] | None = None, audios: list[Any] | None = None,
                 media: dict[str, list[Any]] | None = None, rejected: dict[str, Any] | None = None):
        self.id = id
        self.rejected = rejected
        self.messages = messages
        self.source = source
        self.meta = {} if meta is None else meta
        self.num_tokens = num_tokens
        self.location = location
        self.media_tokens = {}
        parts = dict(media or {})
        for name, given in (("image", images), ("video", videos), ("audio", audios)):
            if given is not None:
                if parts.get(name):
                    raise DataError(f"sample {id!r}: {name} parts given twice (as media[{name!r}] and as {MEDIA_COLUMNS[name]}=)")
                parts[name] = given
        unknown = set(parts) - set(MODALITIES)
        if unknown:
            raise DataError(f"sample {id!r}: unknown media modalities {sorted(unknown)}", hint=f"use one of {list(MODALITIES)}")
        self.media = {name: list(parts.get(name) or []) for name in MODALITIES if name == "image" or parts.get(name)}

    @property
    def images(self) -> list[Any]:
        """The image parts (`media["image"]`), in order of first use."""
        return self.media.setdefault("image", [])

    @images.setter
    def images(self, value: list[Any]) -> None:
        self.media["image"] = list(value)

    @property
    def videos(self) -> list[Any]:
        return self.media.get("video", [])

    @property
    def audios(self) -> list[Any]:
        return self.media.get("audio", [])

    def text_parts(self) -> list[str]:
        """The text of every part of every turn, in order (a preference sample's rejected answer last)."""
        rejected = [p["text"] for p in self.rejected["content"] if p["type"] == "text"] if self.rejected else []
        return [p["text"] for m in self.messages for p in m["content"] if p["type"] == "text"] + rejected

    @property
    def is_preference(self) -> bool:
        """True for a preference pair (a sample with a rejected answer)."""
        return self.rejected is not None

    def prompt_messages(self) -> list[dict[str, Any]]:
        """The turns both answers of a pair answer: every turn but the last (the chosen answer)."""
        return self.messages[:-1]

    def chosen_messages(self) -> list[dict[str, Any]]:
        """The prompt and the chosen answer (for an SFT sample: its conversation)."""
        return self.messages

    def rejected_messages(self) -> list[dict[str, Any]]:
        """The prompt and the rejected answer. Raises DataError for a sample that is not a preference pair."""
        if self.rejected is None:
            raise DataError(f"sample {self.id!r} has no rejected answer: it is not a preference pair",
                            hint="prepare preference data (docs/formats.md, Preference data)")
        return self.messages[:-1] + [self.rejected]

    def rejected_sample(self) -> "Sample":
        """The rejected conversation as a Sample of its own (same media, id, source and meta), e.g. to count its
        tokens or render it. Raises DataError for a sample that is not a preference pair."""
        out = Sample(id=self.id, messages=self.rejected_messages(), media={k: list(v) for k, v in self.media.items()},
                     source=self.source, meta=self.meta)
        out.location = self.location
        return out

    def to_row(self) -> dict[str, Any]:
        """One Parquet row (see `arrow_schema`): `images` always, `videos`/`audios` when the sample has such parts,
        `media_tokens` when its parts were counted."""
        row = {
            "id": self.id,
            "source": self.source,
            "messages": [_message_row(m) for m in self.messages],
            "images": [{"bytes": b, "path": None} for b in self.images],
            "num_tokens": self.num_tokens,
            "meta": json.dumps(self.meta, sort_keys=True) if self.meta else None,
        }
        flat = self._flat_media_tokens()
        if flat is not None:  # counted samples only: a row without counts reads as before the column existed
            row["media_tokens"] = flat
        for name, parts in self.media.items():
            if name != "image":
                row[MEDIA_COLUMNS[name]] = [{"bytes": b, "path": None} for b in parts]
        if self.rejected is not None:
            row[REJECTED_COLUMN] = _message_row(self.rejected)
        return row

    def _flat_media_tokens(self) -> list[int] | None:
        """`media_tokens` as one list, parts in `MODALITIES` order; None unless every part was counted."""
        counts = [list(self.media_tokens.get(name, [])) for name in MODALITIES]
        if not self.media_tokens or any(len(c) != len(self.media.get(name, [])) for c, name in zip(counts, MODALITIES)):
            return None
        return [int(n) for c in counts for n in c]

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Sample":
        """Inverse of `to_row`; accepts rows read by pyarrow or by datasets with `decode=False` media, and rows
        of shards written before the `videos`/`audios` columns existed."""
        messages = [_message_of_row(m) for m in row["messages"]]
        rejected = row.get(REJECTED_COLUMN)
        media = {name: [v["bytes"] if isinstance(v, dict) else v for v in row.get(column) or []]
                 for name, column in MEDIA_COLUMNS.items()}
        meta = row.get("meta")
        sample = cls(
            id=row["id"],
            messages=messages,
            media=media,
            source=row.get("source") or "",
            meta=json.loads(meta) if meta else {},
            num_tokens=row.get("num_tokens"),
            rejected=_message_of_row(rejected) if rejected else None,
        )
        flat = row.get("media_tokens")  # absent in shards written before the column existed
        if flat is not None and len(flat) == sum(len(parts) for parts in sample.media.values()):
            start = 0
            for name in MODALITIES:
                n = len(sample.media.get(name, []))
                if n or name == "image":
                    sample.media_tokens[name] = [int(x) for x in flat[start:start + n]]
                start += n
        return sample


def _message_row(m: dict[str, Any]) -> dict[str, Any]:
    return {"role": m["role"], "content": [{"type": p["type"], "text": p.get("text"), "index": p.get("index")} for p in m["content"]]}


def _message_of_row(m: dict[str, Any]) -> dict[str, Any]:
    parts = []
    for p in m["content"]:
        if p["type"] in MODALITIES:
            parts.append({"type": p["type"], "index": int(p["index"])})
        else:
            parts.append({"type": "text", "text": p["text"] or ""})
    return {"role": m["role"], "content": parts}


def arrow_schema(modalities: Iterable[str] = ("image",), preference: bool = False):
    """The pyarrow schema of prepared shards, with `datasets` feature metadata so images decode as `Image`.

    `modalities`: the media columns to hold besides `images` (always present), e.g. `("image", "video")` adds
    `videos`; `preference`: add the `rejected` column (a message struct) of preference pairs. Video and audio
    bytes are plain `{bytes, path}` structs (no `datasets` decoding: that would need
    torchcodec). Raises DataError for an unknown modality.
    """
    import pyarrow as pa

    unknown = set(modalities) - set(MODALITIES)
    if unknown:
        raise DataError(f"unknown media modalities {sorted(unknown)}", hint=f"use one of {list(MODALITIES)}")
    extra = [MEDIA_COLUMNS[m] for m in MODALITIES if m != "image" and m in set(modalities)]
    part = pa.struct([("type", pa.string()), ("text", pa.string()), ("index", pa.int32())])
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    blob = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([
        ("id", pa.string()),
        ("source", pa.string()),
        ("messages", pa.list_(message)),
        ("images", pa.list_(blob)),
        ("num_tokens", pa.int32()),
        ("media_tokens", pa.list_(pa.int32())),
        ("meta", pa.string()),
        *((column, pa.list_(blob)) for column in extra),
        *(((REJECTED_COLUMN, message),) if preference else ()),
    ])
    return schema.with_metadata({"huggingface": json.dumps({"info": {"features": _hf_features(extra, preference)}})})


def _hf_features(extra_columns: list[str], preference: bool = False) -> dict[str, Any]:
    # The JSON form of datasets.Features for the schema above (datasets.Features.to_dict()).
    text = {"dtype": "string", "_type": "Value"}
    features = {
        "id": text,
        "source": text,
        "messages": {
            "feature": {
                "role": text,
                "content": {"feature": {"type": text, "text": text, "index": {"dtype": "int32", "_type": "Value"}}, "_type": "List"},
            },
            "_type": "List",
        },
        "images": {"feature": {"_type": "Image"}, "_type": "List"},
        "num_tokens": {"dtype": "int32", "_type": "Value"},
        "media_tokens": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"},
        "meta": text,
    }
    blob = {"bytes": {"dtype": "binary", "_type": "Value"}, "path": text}
    for column in extra_columns:
        features[column] = {"feature": blob, "_type": "List"}
    if preference:
        features[REJECTED_COLUMN] = {"role": text, "content": features["messages"]["feature"]["content"]}
    return features
