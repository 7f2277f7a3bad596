"""A chat with a model: the conversation so far, the images in it, and one streamed reply per user turn.

    model, processor = load_for_generation("outputs/runs/run1/final", device="auto")
    session = ChatSession(model, processor, system="Answer briefly.")
    for piece in session.stream("What is unusual here?", images=["photo.jpg"]):
        print(piece, end="", flush=True)           # the reply as it is generated
    session.ask("And the color of the car?")       # the next turn sees the first one (and its image)
    session.reset()                                # a new conversation

Terminal input is read by `parse_input`: a line is a message (image paths written in it are attached, e.g.
`photo.jpg what is this?`) or a command: `/image PATH [question]`, `/reset`, `/help`, `/exit` (also `/quit`).

Images are read and checked when they are attached (`vlmctl.data.images`: decoded fully, converted to 8-bit RGB)
and kept as encoded bytes; every turn's request carries the whole history and all its images, rendered by the
model's chat template (`render_prompt`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from vlmctl.data.images import IMAGE_EXTENSIONS
from vlmctl.errors import DataError, UsageError
from vlmctl.inference.generation import _check_sampling, stream_generate
from vlmctl.inference.prompt import GenerationRequest

COMMANDS = {
    "/image PATH [question]": "attach an image to the next question (quote a path with spaces)",
    "/reset": "forget the conversation and its images",
    "/help": "show these commands",
    "/exit": "quit (also /quit, or end of input)",
}
"""The chat commands and what they do, for help screens."""

InputKind = Literal["message", "image", "reset", "help", "exit", "empty", "unknown"]

# A path-like word ending in an image extension, optionally quoted; trailing punctuation is not part of it.
_EXT = "|".join(IMAGE_EXTENSIONS)
_IMAGE_WORD = re.compile(
    rf"""(?:"(?P<dq>[^"]+\.(?:{_EXT}))"|'(?P<sq>[^']+\.(?:{_EXT}))'|(?P<bare>[^\s"']+\.(?:{_EXT})))(?=$|[\s,;:!?.)])""",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class ChatInput:
    """One parsed line: `kind`, the message text (image paths removed) and the image paths named in it."""

    kind: InputKind
    text: str = ""
    images: tuple[Path, ...] = ()
    command: str = ""  # the command word as typed, for `unknown`


def parse_input(line: str, cwd: Path | None = None) -> ChatInput:
    """Read one line of chat input.

    `/image PATH [question]`, `/reset`, `/help`, `/exit` and `/quit` are commands (`/image` paths may be quoted);
    another `/word` that is not an existing path is `unknown`. In a message, a word ending in an image extension
    (`IMAGE_EXTENSIONS`, quoted when it has spaces) is an image when that file exists (relative paths from `cwd`,
    default the current folder) and is then removed from the text. Raises DataError for such a word that names a
    folder (it has a `/`) but no file, and for a `/image` path that does not exist.
    """
    text = line.strip()
    if not text:
        return ChatInput("empty")
    word = text.split(maxsplit=1)[0]
    if re.fullmatch(r"/[A-Za-z]+", word) and not _resolve(word, cwd).exists():
        name = word.lower()
        rest = text[len(word):].strip()
        if name in ("/exit", "/quit"):
            return ChatInput("exit")
        if name == "/reset":
            return ChatInput("reset")
        if name == "/help":
            return ChatInput("help")
        if name == "/image":
            return _image_command(rest, cwd)
        return ChatInput("unknown", text=rest, command=word)
    message, images = _split_image_paths(text, cwd)
    return ChatInput("message", text=message, images=images)


def _resolve(path: str, cwd: Path | None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() or cwd is None else cwd / p


def _image_command(rest: str, cwd: Path | None) -> ChatInput:
    try:
        words = shlex.split(rest)
    except ValueError as exc:  # an unclosed quote
        raise UsageError(f"cannot read /image {rest}: {exc}",
                         hint='/image PATH [question]; quote paths with spaces: /image "my photo.jpg"') from exc
    if not words:
        raise UsageError("/image needs a path", hint="/image PATH [question], e.g. /image photo.jpg What is this?")
    path = _resolve(words[0], cwd)
    if not path.is_file():
        raise DataError(f"{words[0]}: no such image file", hint="check the path (relative to the folder vlmctl chat started in)")
    question = " ".join(words[1:])
    more, images = _split_image_paths(question, cwd) if question else ("", ())
    return ChatInput("image", text=more, images=(path, *images))


def _split_image_paths(text: str, cwd: Path | None) -> tuple[str, tuple[Path, ...]]:
    """(text without the image paths, the paths of existing image files named in it)."""
    images: list[Path] = []

    def take(match: re.Match) -> str:
        raw = match.group("dq") or match.group("sq") or match.group("bare")
        path = _resolve(raw, cwd)
        if path.is_file():
            images.append(path)
            return ""
        if "/" in raw or raw.startswith("~"):
            raise DataError(f"{raw}: no such image file", hint="check the path, or quote the word if it is not a file name")
        return match.group(0)  # a word such as `logo.png` that is no file here stays text

    message = _IMAGE_WORD.sub(take, text)
    return re.sub(r"\s{2,}", " ", message).strip(), tuple(images)


def read_image(path: Path) -> bytes:
    """The image file at `path` as 8-bit RGB encoded bytes (`vlmctl.data.images.normalize_image`). Raises DataError
    naming the file when it is missing or not a decodable image."""
    from vlmctl.data.images import ImageError, normalize_image, read_ref

    try:
        return normalize_image(read_ref(Path(path))).data
    except ImageError as exc:
        raise DataError(f"{path}: {exc.detail}", hint="attach a JPEG, PNG or WebP file") from None


@dataclass
class ChatSession:
    """A conversation with a loaded model (`load_for_generation`).

    `history` holds the turns so far in the canonical message shape (`vlmctl.data.sample`), `images` the encoded
    images their image parts index, `pending` the images attached for the next user turn. `system` is sent first
    in every request when given. Sampling as in `generate` (`temperature` 0: greedy). Raises UsageError for bad
    sampling values.
    """

    model: Any
    processor: Any
    system: str | None = None
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    history: list[dict[str, Any]] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)
    pending: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_sampling(None, self.max_new_tokens, self.temperature, self.top_p)

    @property
    def turns(self) -> int:
        """Completed user turns in the history."""
        return sum(m["role"] == "user" for m in self.history)

    def attach(self, image: Path | str | bytes) -> None:
        """Queue an image (a path, or encoded bytes) for the next user turn. Raises DataError for a file that is not
        a readable image (nothing is queued then)."""
        self.pending.append(bytes(image) if isinstance(image, (bytes, bytearray)) else read_image(Path(image)))

    def reset(self) -> None:
        """Forget the conversation, its images and any pending image (the system prompt stays)."""
        self.history.clear()
        self.images.clear()
        self.pending.clear()

    def request(self, text: str, images: Sequence[Path | str | bytes] = ()) -> GenerationRequest:
        """The request for a new user turn: the system prompt, the history, then the user's message with the
        pending images and `images` (paths or encoded bytes) placed before `text`. Changes nothing; raises
        DataError for an unreadable image."""
        new = [*self.pending, *(bytes(i) if isinstance(i, (bytes, bytearray)) else read_image(Path(i)) for i in images)]
        first = len(self.images)
        content = [{"type": "image", "index": first + k} for k in range(len(new))]
        if text:
            content.append({"type": "text", "text": text})
        system = [{"role": "system", "content": [{"type": "text", "text": self.system}]}] if self.system else []
        return GenerationRequest(messages=[*system, *self.history, {"role": "user", "content": content}],
                                 images=[*self.images, *new], id=f"turn-{self.turns + 1}")

    def stream(self, text: str, images: Sequence[Path | str | bytes] = ()) -> Iterator[str]:
        """Generate the reply to `text` (with `images` and the pending ones) piece by piece (`stream_generate`),
        leading whitespace dropped. When the reply is complete, the user turn and the reply join the history; a
        stream closed early (an interrupted reply) leaves the history and the pending images as they were.
        Raises DataError for an unreadable image, UsageError for an empty message without images."""
        if not text and not images and not self.pending:
            raise UsageError("nothing to send", hint="type a question, or attach an image with /image PATH")
        request = self.request(text, images)
        pieces: list[str] = []
        for piece in stream_generate(self.model, self.processor, request, max_new_tokens=self.max_new_tokens,
                                     temperature=self.temperature, top_p=self.top_p):
            if not pieces:
                piece = piece.lstrip()
                if not piece:
                    continue
            pieces.append(piece)
            yield piece
        self._commit(request, "".join(pieces).strip())

    def ask(self, text: str, images: Sequence[Path | str | bytes] = ()) -> str:
        """The whole reply to `text` (see `stream`), stripped."""
        return "".join(self.stream(text, images)).strip()

    def _commit(self, request: GenerationRequest, reply: str) -> None:
        self.images[:] = request.images
        self.pending.clear()
        self.history[:] = [m for m in request.messages if m["role"] != "system"]
        self.history.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})


__all__ = ["COMMANDS", "ChatInput", "ChatSession", "parse_input", "read_image"]
