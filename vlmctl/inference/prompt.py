"""What generation reads and returns: a request (a conversation plus its images, video clips or audio clips) and its
rendered prompt.

    request = GenerationRequest(
        messages=[{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What color?"}]}],
        images=[png_bytes],                  # encoded bytes or PIL images, indexed by the image parts
    )
    text, images = render_prompt(request, processor)   # chat template + generation prompt, PIL images in order
    spoken = GenerationRequest(messages=[{"role": "user", "content": [{"type": "audio", "index": 0},
                                                                      {"type": "text", "text": "Transcribe."}]}],
                               audios=[wav_bytes])     # encoded clips, indexed by the audio parts
    text, images, audios = render_inputs(spoken, processor, family)   # the family's audio prompt in the text
    check_requests([spoken], family)     # UsageError when the family takes no audio (or no images)
    watched = GenerationRequest(messages=[{"role": "user", "content": [{"type": "video", "index": 0},
                                                                       {"type": "text", "text": "What moves?"}]}],
                                videos=["clip.mp4"])    # encoded videos or paths, indexed by the video parts
    text, images, audios, videos = render_request(watched, processor, family)   # the family's video prompt

Messages use the canonical sample's shape (`vlmctl.data.sample`): roles `system|user|assistant`, content parts
`{"type": "text", "text": str}`, `{"type": "image", "index": int}`, `{"type": "video", "index": int}` or
`{"type": "audio", "index": int}`. The model continues after the last message. Media parts are written as training
writes them (`vlmctl.data.collate.template_media`): an image as the chat template's image part, a video as the
family's video prompt (`FamilySpec.prompt("video")`, Qwen's `<|vision_start|><|video_pad|><|vision_end|>`) and an
audio clip as its audio prompt (Qwen2-Audio's `<|audio_bos|><|AUDIO|><|audio_eos|>`) in the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from vlmctl.data.collate import template_media
from vlmctl.data.images import open_image
from vlmctl.data.modalities import get_unit
from vlmctl.data.sample import Sample
from vlmctl.data.tokens import check_rendered, render_limits
from vlmctl.errors import ModelError, UsageError
from vlmctl.families import detect_family, get_family
from vlmctl.families.registry import FAMILIES


@dataclass
class GenerationRequest:
    """One prompt to answer: `messages` (the conversation so far, ending with the user's turn), `images` (encoded
    bytes or PIL images that the image parts index), `audios` (encoded clips that the audio parts index: bytes of
    any format libsndfile reads, e.g. the 16-bit mono FLAC of prepared shards), `videos` (what the video parts
    index: encoded bytes or paths of video files FFmpeg reads, or stored clips of prepared shards; generation
    samples them as `vlmctl.inference.generation.video_inputs` says), and an `id` used in error messages."""

    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)
    id: str = ""
    audios: list[bytes] = field(default_factory=list)
    videos: list[bytes | str | Path] = field(default_factory=list)


class RenderedPrompt(NamedTuple):
    """A request as the processor takes it: the prompt text (chat template applied, generation prompt appended),
    PIL RGB images and encoded audio clips, each in order of their parts."""

    text: str
    images: list
    audios: list[bytes]


class RenderedRequest(NamedTuple):
    """`RenderedPrompt` plus the request's videos (encoded bytes or paths, in order of their video parts)."""

    text: str
    images: list
    audios: list[bytes]
    videos: list


class Generation(NamedTuple):
    """The answer to one request: the rendered prompt text (chat template applied, generation prompt appended) and
    the generated text (decoded without special tokens, stripped). Unpacks as `(prompt, text)`."""

    prompt: str
    text: str


def request_from_sample(sample: "Sample") -> GenerationRequest:
    """The request that asks for a sample's last assistant turn: its messages up to (not including) that turn, and
    its images, video clips and audio clips. A sample without an assistant turn is asked as it is."""
    messages = sample.messages
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return GenerationRequest(messages=list(messages[:last]), images=list(sample.images), id=sample.id,
                             audios=list(sample.media.get("audio", [])), videos=list(sample.media.get("video", [])))


def render_request(request: GenerationRequest, processor, family: Any = None) -> RenderedRequest:
    """`request` rendered by the processor's chat template with the generation prompt appended, its media parts
    written as training writes them (module docstring; a video or audio part as `family`'s video or audio prompt,
    or the processor's video or audio token without a family), with its PIL RGB images, encoded audio clips and
    videos (bytes or paths, not read yet) in order of their parts. A part used twice appears twice (one per
    placeholder).

    Raises DataError when a media part points past the request's media (or names a modality `family` does not
    take: check with `check_requests` first for the usage error).
    """
    sample = Sample(id=request.id, messages=request.messages, images=request.images,
                    audios=request.audios or None, videos=request.videos or None)
    messages, media = template_media(sample, processor, family)
    with render_limits("the model"):
        text = check_rendered(processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), "the model")
    return RenderedRequest(text, [_to_rgb(img) for img in media.get("image", [])], list(media.get("audio", [])),
                           list(media.get("video", [])))


def render_inputs(request: GenerationRequest, processor, family: Any = None) -> RenderedPrompt:
    """(prompt text, PIL RGB images, encoded audio clips) of `render_request`, for callers that send no video.
    Raises DataError as `render_request` does."""
    text, images, audios, _ = render_request(request, processor, family)
    return RenderedPrompt(text, images, audios)


def render_prompt(request: GenerationRequest, processor, family: Any = None) -> tuple[str, list]:
    """(prompt text, PIL RGB images in order of their image parts) of `render_inputs`, for callers that send
    images only. Raises DataError when an image part points past `request.images`."""
    text, images, _ = render_inputs(request, processor, family)
    return text, images


def check_requests(requests: Sequence[GenerationRequest], family: Any) -> None:
    """Raise UsageError, before any model runs, when a request has a media part or media of a modality `family`
    (a `FamilySpec`) does not take (`check_modality`): audio for a vision-language family, a video for an
    image-only one, an image for Qwen2-Audio. Nothing is checked without a family."""
    if family is None:
        return
    for request in requests:
        kinds = {p["type"] for m in request.messages for p in m["content"] if p["type"] != "text"}
        kinds |= {"audio"} if request.audios else set()
        kinds |= {"video"} if request.videos else set()
        kinds |= {"image"} if request.images else set()
        for kind in sorted(kinds):
            check_modality(kind, family, f"request {request.id!r}" if request.id else "the request")


def check_modality(kind: str, family: Any, where: str = "the attached file") -> None:
    """Raise UsageError when `family` (a `FamilySpec`; None: anything goes) takes no `kind` input (image, video,
    audio: the keys of its `modalities`), naming `where` the input came from and the families that take it."""
    if family is None or get_unit(kind).accepted_by(family):
        return
    takes = ", ".join(getattr(family, "modalities", None) or ["image"])
    what = {"audio": "an audio clip", "image": "an image", "video": "a video"}.get(kind, f"a {kind}")
    raise UsageError(f"family {family.name} takes no {kind} input (it takes {takes}), but {where} gives it {what}",
                     hint=f"drop the {kind} inputs, or use a model of a family that takes {kind} ({_takers(kind)}; "
                          "`vlmctl model build --list` shows each family's modalities)")


def _takers(kind: str) -> str:
    """Registered families that take modality `kind`."""
    return ", ".join(name for name, spec in FAMILIES.items() if get_unit(kind).accepted_by(spec)) or "none"


def model_family(model: Any):
    """The `FamilySpec` of a loaded model, from its config's model_type; None for a model of no registered family
    (or without a config)."""
    config = getattr(model, "config", None)
    try:
        return get_family(detect_family(config)) if config is not None else None
    except ModelError:
        return None


def _to_rgb(image: Any):
    """A PIL RGB image from encoded bytes or a PIL image."""
    img = open_image(image) if isinstance(image, (bytes, bytearray)) else image
    return img if img.mode == "RGB" else img.convert("RGB")


__all__ = ["GenerationRequest", "Generation", "RenderedPrompt", "RenderedRequest", "check_modality", "check_requests", "model_family",
           "render_inputs", "render_prompt", "render_request", "request_from_sample"]
