"""The OpenAI chat-completions protocol as `vlmctl serve` speaks it: the request schema, its conversion into a
`GenerationRequest`, and the error shape.

Source of the format: OpenAI's API reference, "Create chat completion" (https://platform.openai.com/docs/api-reference/chat)
and its streaming chunk object. Supported request fields: `model`, `messages` (roles `system`/`developer`, `user`,
`assistant`; content a string or a list of `text`, `image_url`, `input_audio` and `video_url` parts), `max_tokens` (or
`max_completion_tokens`), `temperature`, `top_p`, `stop`, `seed`, `n`, `stream`, `stream_options.include_usage`,
`logprobs` and `top_logprobs` (non-streaming only). Fields that do not change an answer (`user`, `metadata`, `store`,
`service_tier`, ...: `IGNORED_FIELDS`) are accepted and ignored, and so are the fields of `NO_OP_VALUES` at their
no-op value (`frequency_penalty: 0`, `tools: []`, `response_format: {"type": "text"}`, ...); any other value of
those, and any other field, is refused with 400 (`unsupported_parameter`, `unknown_parameter`), as OpenAI refuses a
parameter a model does not take: this server cannot call tools, constrain the output to a format or penalize
repeats, and an answer that silently ignored them would look like one that honoured them.

An `image_url` part's `url` is a base64 `data:` URL (RFC 2397), or a local path / `file://` URL inside one of the
allowed media roots (`MediaRoots`); remote http(s) URLs are refused (the server downloads nothing). Images are
decoded fully and converted to 8-bit RGB as the data pipeline does (`vlmctl.data.images.normalize_image`), and
refused over `max_image_pixels` (the project's `data.max_image_pixels`) before decoding. A request holds at most
`max_media` images, clips and videos together, and its images at most `max_total_pixels` pixels together: both are
checked before any of them is decoded (the count), and each image's header before it is decoded (the pixels). An `input_audio` part
(OpenAI's: base64 `data` and its `format`) is decoded as `vlmctl chat` decodes a clip (`read_audio`: 16 kHz mono,
at most the model's window of seconds); a `video_url` part (vLLM's name for it; a data: URL or a local path as for
images) is sampled as training samples videos (`read_video` with the `data.video` settings). A modality the model's
family does not take is refused (400).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vlmctl.data.images import ImageError, MissingRef, normalize_image, open_image, read_ref, resolve_ref
from vlmctl.data.modalities.video import MAX_VIDEO_FILE_BYTES
from vlmctl.errors import DataError
from vlmctl.inference.chat import read_audio
from vlmctl.inference.generation import read_video
from vlmctl.inference.prompt import GenerationRequest


class OpenAIError(Exception):
    """A request that cannot be answered, sent back as OpenAI's error object with HTTP `status`:
    `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                            "prompt_cache_retention", "parallel_tool_calls"})
"""Request fields that do not change an answer: accepted and ignored."""

NO_OP_VALUES: dict[str, tuple] = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,),
    "verbosity": (None,),
}
"""OpenAI request fields this server cannot honour, with the values that ask for nothing (accepted); any other value
is a 400 `unsupported_parameter`."""


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageURL(_Part):
    url: str
    detail: Optional[str] = None


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: Union[ImageURL, str]


class InputAudio(_Part):
    data: str
    format: Optional[str] = None


class AudioPart(_Part):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoPart(_Part):
    type: Literal["video_url"]
    video_url: Union[ImageURL, str]


class Message(_Part):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[Union[TextPart, ImagePart, AudioPart, VideoPart]], None] = None
    tool_calls: Optional[list[Any]] = None  # refused when given (`parse_request`): this server calls no tools
    function_call: Optional[Any] = None


class StreamOptions(_Part):
    include_usage: bool = False


class ChatCompletionRequest(_Part):
    """The body of `POST /v1/chat/completions` (fields as in OpenAI's reference; the others are kept as extra fields
    for `parse_request` to refuse or ignore, module docstring)."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 1)  # OpenAI's int64; torch.manual_seed takes these
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    def stops(self) -> list[str]:
        """The stop strings (at most 4, none empty)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise OpenAIError(400, "stop: give at most 4 non-empty strings", param="stop")
        return stops


def parse_request(body: Any) -> ChatCompletionRequest:
    """The validated request of a decoded JSON body. Raises OpenAIError(400) naming the first bad field, a field
    this server cannot honour (`unsupported_parameter`: a value other than the no-op one of `NO_OP_VALUES`, a tool
    call in a message) or one it does not know (`unknown_parameter`)."""
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise OpenAIError(400, f"{where}: {err['msg']}", param=where) from None
    for name, value in (req.model_extra or {}).items():
        if name in IGNORED_FIELDS or value in NO_OP_VALUES.get(name, ()):
            continue
        if name in NO_OP_VALUES:
            raise OpenAIError(400, f"{name} is not supported by this server (it generates plain text with temperature, "
                              "top_p, stop, seed and n only); leave it out", param=name, code="unsupported_parameter")
        raise OpenAIError(400, f"unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
    for i, message in enumerate(req.messages):
        if message.tool_calls or message.function_call:
            raise OpenAIError(400, f"messages.{i}: tool calls are not supported by this server", param=f"messages.{i}.tool_calls",
                              code="unsupported_parameter")
    return req


def media_parts(req: ChatCompletionRequest) -> int:
    """The images, audio clips and videos of a request, counted without reading any."""
    return sum(not isinstance(part, TextPart) for m in req.messages if isinstance(m.content, list) for part in m.content)


def text_chars(req: ChatCompletionRequest) -> int:
    """Characters of the request's text (every message's string or text parts), counted without tokenizing."""
    return sum(len(m.content) if isinstance(m.content, str) else
               sum(len(p.text) for p in (m.content or []) if isinstance(p, TextPart)) for m in req.messages)


def to_generation_request(req: ChatCompletionRequest, roots, max_image_pixels: int, *, audio_seconds: float | None = None,
                          video: Any = None, max_media: int | None = None,
                          max_total_pixels: int | None = None) -> GenerationRequest:
    """The `GenerationRequest` of an OpenAI request: messages in the canonical shape (`vlmctl.data.sample`; a
    `developer` message is a system message, an image, audio or video part becomes a part indexing the request's
    images, clips or videos, in order), media read as the module docstring says. `roots`: the `MediaRoots` local
    paths must lie in; `audio_seconds`: the longest clip (the model's window; None: any); `video`: the `data.video`
    settings (`DataVideo`; None: the defaults); `max_media`: images, clips and videos per request (checked before
    any is read); `max_total_pixels`: the pixels of all its images (each image's header checked before decoding).

    Raises OpenAIError(400) for an assistant message with media, the last message not a user's, too many media
    parts (`too_many_media`), or media that is remote, outside the roots, unreadable, or over the limits (code
    `image_too_large` for pixels, of one image or all of them).
    """
    count = media_parts(req)
    if max_media is not None and count > max_media:
        raise OpenAIError(400, f"the request holds {count} images, audio clips and videos; this server takes at most "
                          f"{max_media} per request", param="messages", code="too_many_media")
    budget = [max_total_pixels]  # pixels the request's images may still take
    messages: list[dict[str, Any]] = []
    media: dict[str, list] = {"image": [], "audio": [], "video": []}
    for i, message in enumerate(req.messages):
        role = "system" if message.role == "developer" else message.role
        parts = [TextPart(type="text", text=message.content)] if isinstance(message.content, str) else (message.content or [])
        content: list[dict[str, Any]] = []
        for j, part in enumerate(parts):
            if isinstance(part, TextPart):
                content.append({"type": "text", "text": part.text})
                continue
            param = f"messages.{i}.content.{j}"
            if role != "user":
                raise OpenAIError(400, f"messages.{i}: only user messages may hold images, audio or video", param=param)
            if isinstance(part, ImagePart):
                kind, item = "image", read_image_url(_url(part.image_url), roots, max_image_pixels, param, budget=budget)
            elif isinstance(part, AudioPart):
                kind, item = "audio", _read_audio(part.input_audio.data, audio_seconds, param)
            else:
                kind, item = "video", _read_video(_url(part.video_url), roots, video, param)
            media[kind].append(item)
            content.append({"type": kind, "index": len(media[kind]) - 1})
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "user":
        raise OpenAIError(400, "the last message must be the user's (the model answers it)", param="messages")
    return GenerationRequest(messages=messages, images=media["image"], audios=media["audio"], videos=media["video"])


def _url(value: "ImageURL | str") -> str:
    return value if isinstance(value, str) else value.url


def _read_audio(data: str, max_seconds: float | None, param: str) -> bytes:
    """An `input_audio` part's base64 clip as a stored clip (`read_audio`). Raises OpenAIError(400)."""
    try:
        clip = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise OpenAIError(400, f"{param}: input_audio.data is not base64", param=param, code="invalid_audio") from None
    try:
        return read_audio(clip, max_seconds)
    except DataError as exc:
        raise OpenAIError(400, f"{param}: {exc.message}", param=param, code="invalid_audio") from None


def _read_video(url: str, roots, settings: Any, param: str) -> bytes:
    """A `video_url` as a stored clip (`read_video`, sampled by `settings`). Raises OpenAIError(400)."""
    if url.startswith(("http://", "https://")):
        raise OpenAIError(400, f"{param}: remote video URLs are not downloaded by this server", param=param, code="invalid_video_url")
    ref = resolve_ref(url, roots)
    if isinstance(ref, MissingRef):
        raise OpenAIError(400, f"{param}: {url} is outside the folders this server reads media from; send the video as a "
                          "data: URL, or start the server with --media-root FOLDER", param=param, code="invalid_video_url")
    if isinstance(ref, bytes) and len(ref) > MAX_VIDEO_FILE_BYTES:
        raise OpenAIError(400, f"{param}: the video is over {MAX_VIDEO_FILE_BYTES >> 30} GiB", param=param, code="invalid_video")
    try:
        return read_video(ref, settings)
    except DataError as exc:
        raise OpenAIError(400, f"{param}: {exc.message}", param=param, code="invalid_video") from None


def _header_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an image's header, without decoding it; (0, 0) for bytes `normalize_image` will refuse."""
    import warnings  # beside PIL: only a request with images pays for them

    from PIL import Image  # PIL loads its plugins on first use: only requests with images need it

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return open_image(data).size
        except Exception:  # noqa: BLE001 - not an image, or a bomb: normalize_image names the reason
            return 0, 0


def read_image_url(url: str, roots, max_pixels: int, param: str, *, budget: list | None = None) -> bytes:
    """An `image_url` as 8-bit RGB encoded bytes. `budget`: [pixels the request's images may still take] (None in
    it: no limit), lowered by this image's, checked from its header before it is decoded. Raises OpenAIError(400)
    as `to_generation_request` says."""
    if url.startswith(("http://", "https://")):
        raise OpenAIError(400, f"{param}: remote image URLs are not downloaded by this server",
                          param=param, code="invalid_image_url")
    ref = resolve_ref(url, roots)
    if isinstance(ref, MissingRef) and ref.reason == "outside_root":
        raise OpenAIError(400, f"{param}: {url} is outside the folders this server reads images from; send the image as a "
                          "data: URL, or start the server with --media-root FOLDER", param=param, code="invalid_image_url")
    try:
        data = read_ref(ref)
        if budget is not None and budget[0] is not None:
            width, height = _header_size(data)
            if width * height > budget[0]:
                raise OpenAIError(400, f"{param}: the request's images are over this server's limit of {budget[0] + width * height:,} "
                                  f"pixels together ({width}x{height} more did not fit)", param=param, code="image_too_large")
            budget[0] -= width * height
        return normalize_image(data, max_pixels=max_pixels).data
    except ImageError as exc:
        code = "image_too_large" if exc.reason == "image_too_large" else "invalid_image"
        raise OpenAIError(400, f"{param}: {exc.detail}", param=param, code=code) from None


__all__ = ["ChatCompletionRequest", "Message", "OpenAIError", "parse_request", "read_image_url", "to_generation_request"]
