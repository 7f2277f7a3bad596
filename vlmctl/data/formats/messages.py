"""`messages`: OpenAI-style content parts (the chat-completions `messages` layout, also LLaMA-Factory's
`v1_multimodal_demo.jsonl`).

    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///data/1.jpg"}},
                                              {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": "A cat."}]}

`content` is a string or a list of parts. A text part holds `text` or `value`; an image part (`type` image or
image_url) holds `image`, `image_url` (a string or `{"url": ...}`), `value` or `path`. Image references are paths
(relative to `image_root`, default the file's folder), `file://` URLs or base64 `data:` URLs (RFC 2397).
String contents may also use `<image>` placeholders with a top-level `images` list.
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
    return read_conversation_json(source, turn_keys=("messages",), image_keys=("images",), system_key="system", extra_roots=media_roots)
