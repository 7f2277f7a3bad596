"""The OpenAI chat-completions protocol as `vlmctl serve` speaks it: the request schema, its conversion into a
`GenerationRequest`, and the error shape.

Source of the format: OpenAI's API reference, "Create chat completion" (https://platform.openai.com/docs/api-reference/chat)
and its streaming chunk object. Supported request fields: `model`, `messages` (roles `system`/`developer`, `user`,
`assistant`; content a string or a list of `text`, `image_url`, `input_audio` and `video_url` parts), `max_tokens` (or
`max_completion_tokens`), `temperature`, `top_p`, `stop`, `seed`, `n`, `stream`, `stream_options.include_usage`,
`logprobs` and `top_logprobs` (non-streaming only). Other fields are ignored, as OpenAI-compatible servers do.

An `image_url` part's `url` is a base64 `data:` URL (RFC 2397), or a local path / `file://` URL inside one of the
allowed media roots (`MediaRoots`); remote http(s) URLs are refused (the server downloads nothing). Images are
decoded fully and converted to 8-bit RGB as the data pipeline does (`vlmctl.data.images.normalize_image`), and
refused over `max_image_pixels` (the project's `data.max_image_pixels`) before decoding. An `input_audio` part
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

from vlmctl.data.images import ImageError, MissingRef, normalize_image, read_ref, resolve_ref
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


class StreamOptions(_Part):
    include_usage: bool = False


class ChatCompletionRequest(_Part):
    """The body of `POST /v1/chat/completions` (fields as in OpenAI's reference; unknown fields are ignored)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
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
    """The validated request of a decoded JSON body. Raises OpenAIError(400) naming the first bad field."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise OpenAIError(400, f"{where}: {err['msg']}", param=where) from None


def to_generation_request(req: ChatCompletionRequest, roots, max_image_pixels: int, *, audio_seconds: float | None = None,
                          video: Any = None) -> GenerationRequest:
    """The `GenerationRequest` of an OpenAI request: messages in the canonical shape (`vlmctl.data.sample`; a
    `developer` message is a system message, an image, audio or video part becomes a part indexing the request's
    images, clips or videos, in order), media read as the module docstring says. `roots`: the `MediaRoots` local
    paths must lie in; `audio_seconds`: the longest clip (the model's window; None: any); `video`: the `data.video`
    settings (`DataVideo`; None: the defaults).

    Raises OpenAIError(400) for an assistant message with media, the last message not a user's, or media that is
    remote, outside the roots, unreadable, or over the limits (code `image_too_large` for pixels).
    """
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
                kind, item = "image", read_image_url(_url(part.image_url), roots, max_image_pixels, param)
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


def read_image_url(url: str, roots, max_pixels: int, param: str) -> bytes:
    """An `image_url` as 8-bit RGB encoded bytes. Raises OpenAIError(400) as `to_generation_request` says."""
    if url.startswith(("http://", "https://")):
        raise OpenAIError(400, f"{param}: remote image URLs are not downloaded by this server",
                          param=param, code="invalid_image_url")
    ref = resolve_ref(url, roots)
    if isinstance(ref, MissingRef) and ref.reason == "outside_root":
        raise OpenAIError(400, f"{param}: {url} is outside the folders this server reads images from; send the image as a "
                          "data: URL, or start the server with --media-root FOLDER", param=param, code="invalid_image_url")
    try:
        return normalize_image(read_ref(ref), max_pixels=max_pixels).data
    except ImageError as exc:
        code = "image_too_large" if exc.reason == "image_too_large" else "invalid_image"
        raise OpenAIError(400, f"{param}: {exc.detail}", param=param, code=code) from None


__all__ = ["ChatCompletionRequest", "Message", "OpenAIError", "parse_request", "read_image_url", "to_generation_request"]
