"""`llava`: LLaVA's instruction-tuning layout (haotian-liu/LLaVA, `llava/train/train.py` `LazySupervisedDataset`).

A JSON list or JSONL of::

    {"id": "000001", "image": "coco/1.jpg" | ["a.jpg", "b.jpg"],
     "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"}, {"from": "gpt", "value": "A cat."}]}

`<image>` placeholders may sit anywhere in a turn; image paths are relative to `image_root` (default: the JSON
file's folder). Text-only samples have no `image` key. Keys `answers`, `options`, `question_type` go to meta.

Video records (LLaVA-Video-178K, LLaVA-NeXT's `LazySupervisedDataset`) name the clip in a `video` key (a path, or a
list) and mark it with the same `<image>` placeholder; `<video>` placeholders work too::

    {"id": "v_0001", "video": "academic/clip.mp4", "data_source": "...",
     "conversations": [{"from": "human", "value": "<image>\\nWhat happens?"}, {"from": "gpt", "value": "..."}]}
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import Rejection
from vlmctl.data.formats._common import read_conversation_json
from vlmctl.data.sample import Sample


def read_llava(source: DataSource, *, media_roots: Iterable[Path | str] = ()) -> Iterator[Sample | Rejection]:
    """Stream unchecked samples (image references not yet read) and parse errors of a LLaVA source."""
    return read_conversation_json(source, turn_keys=("conversations",), image_keys=("image", "images"),
                                  video_keys=("video", "videos"), extra_roots=media_roots, image_placeholder_for_video=True)
