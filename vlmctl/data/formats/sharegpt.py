"""`sharegpt`: LLaMA-Factory's multimodal ShareGPT layout (hiyouga/LLaMA-Factory, `data/README.md`, `mllm_demo.json`).

A JSON list or JSONL of::

    {"messages": [{"role": "user", "content": "<image>Who are they?"}, {"role": "assistant", "content": "..."}],
     "images": ["mllm_demo_data/1.jpg"], "system": "optional system prompt"}
    {"messages": [{"role": "user", "content": "<video>Why is this video funny?"}, {"role": "assistant", "content": "..."}],
     "videos": ["mllm_demo_data/1.mp4"]}                              (LLaMA-Factory's mllm_video_demo.json)
    {"messages": [{"role": "user", "content": "<audio>What's that sound?"}, {"role": "assistant", "content": "..."}],
     "audios": ["mllm_demo_data/1.mp3"]}                              (LLaMA-Factory's mllm_audio_demo.json)

also spelled `conversations` / `from` / `value` (roles human/gpt). One `<image>` per listed image, one `<video>` per
listed video and one `<audio>` per listed audio clip, in order; the same file may be listed twice when two
placeholders show the same picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import Rejection
from vlmctl.data.formats._common import read_conversation_json
from vlmctl.data.sample import Sample


def read_sharegpt(source: DataSource, *, media_roots: Iterable[Path | str] = ()) -> Iterator[Sample | Rejection]:
    """Stream unchecked samples and parse errors of a ShareGPT source."""
    return read_conversation_json(
        source, turn_keys=("messages", "conversations"), image_keys=("images", "image"), video_keys=("videos", "video"),
        audio_keys=("audios", "audio"), system_key="system",
        extra_roots=media_roots,
    )
