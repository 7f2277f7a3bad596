"""`messages`: OpenAI-style content parts (the chat-completions `messages` layout, also LLaMA-Factory's
`v1_multimodal_demo.jsonl`).

    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///data/1.jpg"}},
                                              {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": "A cat."}]}

`content` is a string or a list of parts. A text part holds `text` or `value`; an image part (`type` image,
image_url or input_image) holds `image`, `image_url` (a string or `{"url": ...}`), `value` or `path`; a video part
(`type` video, video_url as vLLM's OpenAI-compatible server takes it, or input_video) holds `video`, `video_url` (a
string or `{"url": ...}`), `url`, `value` or `path`:

    {"type": "video_url", "video_url": {"url": "clips/1.mp4"}}      {"type": "video", "video": "clips/1.mp4"}

an audio part (`type` input_audio as OpenAI's chat completions take it, audio, or audio_url) holds `input_audio` (an
object `{"data": <base64>, "format": "wav"}`), `audio`, `audio_url` (a string or `{"url": ...}`), `url`, `value` or
`path`:

    {"type": "input_audio", "input_audio": {"data": "UklGR...", "format": "wav"}}      {"type": "audio", "audio": "a/1.flac"}

Media references are paths (relative to `image_root`, default the file's folder), `file://` URLs or base64 `data:`
URLs (RFC 2397). String contents may also use `<image>` / `<video>` / `<audio>` placeholders with top-level `images` /
`videos` / `audios` lists, and a part without a reference (`{"type": "video"}`, the transformers chat-template style)
takes the next listed one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import Rejection
from vlmctl.data.formats._common import read_conversation_json
from vlmctl.data.sample import Sample


def read_messages(source: DataSource, *, media_roots: Iterable[Path | str] = ()) -> Iterator[Sample | Rejection]:
    """Stream unchecked samples and parse errors of an OpenAI-messages source."""
    return read_conversation_json(source, turn_keys=("messages",), image_keys=("images",), video_keys=("videos",),
                                  audio_keys=("audios",), system_key="system", extra_roots=media_roots)
