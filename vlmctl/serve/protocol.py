"""The OpenAI chat-completions protocol as `vlmctl serve` speaks it: the request schema, its conversion into a
`GenerationRequest`, and the error shape.

Source of the format: OpenAI's API reference, "Create chat completion" (https://platform.openai.com/docs/api-reference/chat)
and its streaming chunk object. Supported request fields: `model`, `messages` (roles `system`/`developer`, `user`,
`assistant`; content a string or a list of `text` and `image_url` parts), `max_tokens` (or
`max_completion_tokens`), `temperature`, `top_p`, `stop`, `seed`, `n`, `stream`, `stream_options.include_usage`,
`logprobs` and `top_logprobs` (non-streaming only). Other fields are ignored, as OpenAI-compatible servers do.

An `image_url` part's `url` is a base64 `data:` URL (RFC 2397), or a local path / `file://` URL inside one of the
allowed media roots (`MediaRoots`); remote http(s) URLs are refused (the server downloads nothing). Images are
decoded fully and converted to 8-bit RGB as the data pipeline does (`vlmctl.data.images.normalize_image`), and
refused over `max_image_pixels` (the project's `data.max_image_pixels`) before decoding.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class Message(_Part):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[Union[TextPart, ImagePart]], None] = None


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


def to_generation_request(req: ChatCompletionRequest, roots, max_image_pixels: int) -> GenerationRequest:
    """The `GenerationRequest` of an OpenAI request: messages in the canonical shape (`vlmctl.data.sample`; a
    `developer` message is a system message, an image part becomes an image part indexing the request's images, in
    order), images read as the module docstring says. `roots`: the `MediaRoots` local paths must lie in.

    Raises OpenAIError(400) for an assistant message with images, an empty conversation, the last message not a
    user's, or an image that is remote, outside the roots, unreadable, or over `max_image_pixels`
    (code `image_too_large`).
    """
    messages: list[dict[str, Any]] = []
    images: list[bytes] = []
    for i, message in enumerate(req.messages):
        role = "system" if message.role == "developer" else message.role
        parts = [TextPart(type="text", text=message.content)] if isinstance(message.content, str) else (message.content or [])
        content: list[dict[str, Any]] = []
        for j, part in enumerate(parts):
            if isinstance(part, TextPart):
                content.append({"type": "text", "text": part.text})
                continue
            if role != "user":
                raise OpenAIError(400, f"messages.{i}: only user messages may hold images", param=f"messages.{i}.content.{j}")
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            images.append(read_image_url(url, roots, max_image_pixels, f"messages.{i}.content.{j}"))
            content.append({"type": "image", "index": len(images) - 1})
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "user":
        raise OpenAIError(400, "the last message must be the user's (the model answers it)", param="messages")
    return GenerationRequest(messages=messages, images=images)


def read_image_url(url: str, roots, max_pixels: int, param: str) -> bytes:
    """An `image_url` as 8-bit RGB encoded bytes. Raises OpenAIError(400) as `to_generation_request` says."""
    from vlmctl.data.images import ImageError, MissingRef, normalize_image, read_ref, resolve_ref

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
