"""What generation reads and returns: a request (a conversation plus its images) and its rendered prompt.

    request = GenerationRequest(
        messages=[{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What color?"}]}],
        images=[png_bytes],                  # encoded bytes or PIL images, indexed by the image parts
    )
    text, images = render_prompt(request, processor)   # chat template + generation prompt, PIL images in order

Messages use the canonical sample's shape (`vlmctl.data.sample`): roles `system|user|assistant`, content parts
`{"type": "text", "text": str}` or `{"type": "image", "index": int}`. The model continues after the last message.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from vlmctl.data.sample import Sample


@dataclass
class GenerationRequest:
    """One prompt to answer: `messages` (the conversation so far, ending with the user's turn), `images` (encoded
    bytes or PIL images that the image parts index), and an `id` used in error messages."""

    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)
    id: str = ""


class Generation(NamedTuple):
    """The answer to one request: the rendered prompt text (chat template applied, generation prompt appended) and
    the generated text (decoded without special tokens, stripped). Unpacks as `(prompt, text)`."""

    prompt: str
    text: str


def request_from_sample(sample: "Sample") -> GenerationRequest:
    """The request that asks for a sample's last assistant turn: its messages up to (not including) that turn, and
    its images. A sample without an assistant turn is asked as it is."""
    messages = sample.messages
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return GenerationRequest(messages=list(messages[:last]), images=list(sample.images), id=sample.id)


def render_prompt(request: GenerationRequest, processor) -> tuple[str, list]:
    """(prompt text, PIL RGB images in order of their image parts) for `request`, rendered by the processor's chat
    template with the generation prompt appended. An image used twice appears twice (one per placeholder).

    Raises DataError when an image part points past `request.images`.
    """
    from vlmctl.data.collate import template_messages
    from vlmctl.data.sample import Sample

    messages, images = template_messages(Sample(id=request.id, messages=request.messages, images=request.images))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, [_to_rgb(img) for img in images]


def _to_rgb(image: Any):
    """A PIL RGB image from encoded bytes or a PIL image."""
    from PIL import Image

    img = Image.open(io.BytesIO(image)) if isinstance(image, (bytes, bytearray)) else image
    return img if img.mode == "RGB" else img.convert("RGB")


__all__ = ["GenerationRequest", "Generation", "request_from_sample", "render_prompt"]
