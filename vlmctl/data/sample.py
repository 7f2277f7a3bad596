"""The canonical sample every reader produces and every consumer (prepare, train, eval) reads.

A sample is a conversation plus its images::

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

Roles are `system|user|assistant`; content parts are `{"type": "text", "text": str}` or
`{"type": "image", "index": int}` (an index into `images`). This is the same shape as transformers' chat
templates' content parts, so `processor.apply_chat_template` can render it after images are attached.

Prepared shards store one row per sample with the Arrow schema of `arrow_schema()`: `images` uses the layout of
`datasets.Image` (`{bytes, path}`) so `datasets.load_dataset("parquet", ...)` decodes images to PIL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1


@dataclass
class Sample:
    id: str
    messages: list[dict[str, Any]]
    images: list[bytes] = field(default_factory=list)
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    num_tokens: int | None = None  # text + visual tokens under the project's processor, when known
    location: str = field(default="", compare=False)  # where it was read (file:line, shard:key); not stored in shards

    def text_parts(self) -> list[str]:
        return [p["text"] for m in self.messages for p in m["content"] if p["type"] == "text"]

    def to_row(self) -> dict[str, Any]:
        """One Parquet row (see `arrow_schema`)."""
        return {
            "id": self.id,
            "source": self.source,
            "messages": [
                {
                    "role": m["role"],
                    "content": [
                        {"type": p["type"], "text": p.get("text"), "index": p.get("index")} for p in m["content"]
                    ],
                }
                for m in self.messages
            ],
            "images": [{"bytes": b, "path": None} for b in self.images],
            "num_tokens": self.num_tokens,
            "meta": json.dumps(self.meta, sort_keys=True) if self.meta else None,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Sample":
        """Inverse of `to_row`; accepts rows read by pyarrow or by datasets with `decode=False` images."""
        messages = []
        for m in row["messages"]:
            parts = []
            for p in m["content"]:
                if p["type"] == "image":
                    parts.append({"type": "image", "index": int(p["index"])})
                else:
                    parts.append({"type": "text", "text": p["text"] or ""})
            messages.append({"role": m["role"], "content": parts})
        images = [img["bytes"] if isinstance(img, dict) else img for img in row.get("images") or []]
        meta = row.get("meta")
        return cls(
            id=row["id"],
            messages=messages,
            images=images,
            source=row.get("source") or "",
            meta=json.loads(meta) if meta else {},
            num_tokens=row.get("num_tokens"),
        )


def arrow_schema():
    """The pyarrow schema of prepared shards, with `datasets` feature metadata so images decode as `Image`."""
    import pyarrow as pa

    part = pa.struct([("type", pa.string()), ("text", pa.string()), ("index", pa.int32())])
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([
        ("id", pa.string()),
        ("source", pa.string()),
        ("messages", pa.list_(message)),
        ("images", pa.list_(image)),
        ("num_tokens", pa.int32()),
        ("meta", pa.string()),
    ])
    return schema.with_metadata({"huggingface": json.dumps({"info": {"features": _hf_features()}})})


def _hf_features() -> dict[str, Any]:
    # The JSON form of datasets.Features for the schema above (datasets.Features.to_dict()).
    text = {"dtype": "string", "_type": "Value"}
    return {
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
        "meta": text,
    }
