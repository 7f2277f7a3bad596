"""A chat with a model: the conversation so far, the images, videos or audio clips in it, and one streamed reply per
user turn.

    model, processor = load_for_generation("outputs/runs/run1/final", device="auto")
    session = ChatSession(model, processor, system="Answer briefly.")
    for piece in session.stream("What is unusual here?", images=["photo.jpg"]):
        print(piece, end="", flush=True)           # the reply as it is generated
    session.ask("And the color of the car?")       # the next turn sees the first one (and its image)
    session.reset()                                # a new conversation
    session.ask("Transcribe it.", audios=["talk.wav"])   # an audio family (qwen2_audio): clips instead of images
    session.ask("What moves?", videos=["clip.mp4"])      # a video family (Qwen2-VL, LLaVA-OneVision)

Terminal input is read by `parse_input`: a line is a message (image, video and audio paths written in it are
attached, e.g. `photo.jpg what is this?`, `clip.mp4 what moves?`, `talk.wav transcribe it`) or a command:
`/image PATH [question]`, `/video PATH [question]`, `/audio PATH [question]`, `/reset`, `/help`, `/exit` (also
`/quit`).

Images are read and checked when they are attached (`vlmctl.data.images`: decoded fully, converted to 8-bit RGB)
and kept as encoded bytes; videos and audio clips as the data pipeline stores them (videos: `read_video`, frames
sampled by the session's `data.video` settings, as Motion JPEG; audio: `read_audio`, decoded fully, mono, 16 kHz,
16-bit FLAC). A modality the model's family does not take (audio or video for an image-only model, images for
Qwen2-Audio) is refused when it is attached, with a UsageError. Every turn's request carries the whole history and
all its media, rendered by the model's chat template (`render_inputs`).
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from vlmctl.config.data import DataAudio
from vlmctl.data.images import IMAGE_EXTENSIONS, ImageError, normalize_image, read_ref
from vlmctl.data.modalities.audio import AUDIO_EXTENSIONS, MAX_AUDIO_FILE_BYTES, AudioError, normalize_audio, probe
from vlmctl.data.modalities.video import VIDEO_EXTENSIONS
from vlmctl.errors import DataError, UsageError
from vlmctl.inference.generation import _check_sampling, read_video, stream_generate
from vlmctl.inference.prompt import GenerationRequest, check_modality, model_family

COMMANDS = {
    "/image PATH [question]": "attach an image to the next question (quote a path with spaces)",
    "/video PATH [question]": "attach a video to the next question (video models, e.g. qwen2_5_vl, llava_onevision)",
    "/audio PATH [question]": "attach an audio clip to the next question (audio models, e.g. qwen2_audio)",
    "/reset": "forget the conversation and its images and clips",
    "/help": "show these commands",
    "/exit": "quit (also /quit, or end of input)",
}
"""The chat commands and what they do, for help screens."""

InputKind = Literal["message", "image", "video", "audio", "reset", "help", "exit", "empty", "unknown"]
MediaKind = Literal["image", "video", "audio"]

# A path-like word ending in an image, video or audio extension, optionally quoted; trailing punctuation is not part
# of it.
_EXT = "|".join((*IMAGE_EXTENSIONS, *VIDEO_EXTENSIONS, *AUDIO_EXTENSIONS))
_MEDIA_WORD = re.compile(
    rf"""(?:"(?P<dq>[^"]+\.(?:{_EXT}))"|'(?P<sq>[^']+\.(?:{_EXT}))'|(?P<bare>[^\s"']+\.(?:{_EXT})))(?=$|[\s,;:!?.)])""",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class ChatInput:
    """One parsed line: `kind`, the message text (media paths removed) and the image, audio and video paths named
    in it."""

    kind: InputKind
    text: str = ""
    images: tuple[Path, ...] = ()
    command: str = ""  # the command word as typed, for `unknown`
    audios: tuple[Path, ...] = ()
    videos: tuple[Path, ...] = ()


def parse_input(line: str, cwd: Path | None = None) -> ChatInput:
    """Read one line of chat input.

    `/image PATH [question]`, `/video PATH [question]`, `/audio PATH [question]`, `/reset`, `/help`, `/exit` and
    `/quit` are commands (their paths may be quoted); another `/word` that is not an existing path is `unknown`. In
    a message, a word ending in an image extension (`IMAGE_EXTENSIONS`), a video one (`VIDEO_EXTENSIONS`) or an
    audio one (`AUDIO_EXTENSIONS`), quoted when it has spaces, is an image, a video or a clip when that file exists
    (relative paths from `cwd`, default the current folder) and is then removed from the text. Raises DataError for
    such a word that names a folder (it has a `/`) but no file, and for a `/image`, `/video` or `/audio` path that
    does not exist; UsageError for `/image`, `/video` or `/audio` without a path.
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
        if name in ("/image", "/video", "/audio"):
            return _media_command(name[1:], rest, cwd)
        return ChatInput("unknown", text=rest, command=word)
    message, found = _split_media_paths(text, cwd)
    return ChatInput("message", text=message, images=found["image"], audios=found["audio"], videos=found["video"])


def _resolve(path: str, cwd: Path | None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() or cwd is None else cwd / p


_EXAMPLES = {"image": '/image photo.jpg What is this?', "video": "/video clip.mp4 What moves?",
             "audio": "/audio talk.wav Transcribe it."}
_QUOTED = {"image": '/image "my photo.jpg"', "video": '/video "my clip.mp4"', "audio": '/audio "my talk.wav"'}


def _media_command(kind: MediaKind, rest: str, cwd: Path | None) -> ChatInput:
    """`/image`, `/video` or `/audio` (`kind`) with the rest of its line."""
    try:
        words = shlex.split(rest)
    except ValueError as exc:  # an unclosed quote
        raise UsageError(f"cannot read /{kind} {rest}: {exc}",
                         hint=f"/{kind} PATH [question]; quote paths with spaces: {_QUOTED[kind]}") from exc
    if not words:
        raise UsageError(f"/{kind} needs a path", hint=f"/{kind} PATH [question], e.g. {_EXAMPLES[kind]}")
    path = _resolve(words[0], cwd)
    if not path.is_file():
        raise DataError(f"{words[0]}: no such {kind} file", hint="check the path (relative to the folder vlmctl chat started in)")
    question = " ".join(words[1:])
    more, found = _split_media_paths(question, cwd)
    found[kind] = (path, *found[kind])
    return ChatInput(kind, text=more, images=found["image"], audios=found["audio"], videos=found["video"])


def _split_media_paths(text: str, cwd: Path | None) -> tuple[str, dict[MediaKind, tuple[Path, ...]]]:
    """(text without the media paths, {"image" | "video" | "audio": the paths of existing files of that kind named
    in it}); the kind is the file's extension's."""
    found: dict[str, list[Path]] = {"image": [], "video": [], "audio": []}

    def take(match: re.Match) -> str:
        raw = match.group("dq") or match.group("sq") or match.group("bare")
        ext = raw.rsplit(".", 1)[-1].lower()
        kind = "audio" if ext in AUDIO_EXTENSIONS else "video" if ext in VIDEO_EXTENSIONS else "image"
        path = _resolve(raw, cwd)
        if path.is_file():
            found[kind].append(path)
            return ""
        if "/" in raw or raw.startswith("~"):
            raise DataError(f"{raw}: no such {kind} file", hint="check the path, or quote the word if it is not a file name")
        return match.group(0)  # a word such as `logo.png` that is no file here stays text

    message = _MEDIA_WORD.sub(take, text) if text else ""
    return re.sub(r"\s{2,}", " ", message).strip(), {k: tuple(v) for k, v in found.items()}


def read_image(path: Path) -> bytes:
    """The image file at `path` as 8-bit RGB encoded bytes (`vlmctl.data.images.normalize_image`). Raises DataError
    naming the file when it is missing or not a decodable image."""
    try:
        return normalize_image(read_ref(Path(path))).data
    except ImageError as exc:
        raise DataError(f"{path}: {exc.detail}", hint="attach a JPEG, PNG or WebP file") from None


def audio_window(processor: Any) -> float | None:
    """Seconds of audio the processor's feature extractor takes per clip (Whisper-style extractors pad or cut every
    clip to `n_samples` at `sampling_rate`: 30 s, 2 s for the tiny preset); None when it says nothing (no feature
    extractor)."""
    extractor = getattr(processor, "feature_extractor", None)
    samples, rate = getattr(extractor, "n_samples", None), getattr(extractor, "sampling_rate", None)
    return samples / rate if isinstance(samples, int) and isinstance(rate, int) and samples > 0 and rate > 0 else None


def read_audio(path: Path | bytes, max_seconds: float | None = None) -> bytes:
    """The audio file at `path` (or encoded bytes) as the data pipeline stores a clip
    (`vlmctl.data.modalities.audio.normalize_audio`: every sample decoded with soundfile, down-mixed to mono,
    resampled with soxr to 16 kHz, written as 16-bit FLAC); generation resamples it to the feature extractor's rate
    as training does. `max_seconds`: the longest clip taken (the model's window, `audio_window`; None: any length).

    Raises DataError naming the file (or "an audio clip" for bytes) when it is missing, not audio libsndfile decodes
    (MP4/M4A, WebM, WMA and AMR are not), truncated or empty, or longer than `max_seconds` (the feature extractor
    would cut the rest).
    """
    hint = "attach a WAV, FLAC, MP3 or OGG file (pip install 'vlmctl[audio]' for the decoders)"
    if isinstance(path, (bytes, bytearray)):
        data, path = bytes(path), "an audio clip"
        if len(data) > MAX_AUDIO_FILE_BYTES:
            raise DataError(f"{path}: {len(data) / 2**20:,.0f} MiB, over the limit of {MAX_AUDIO_FILE_BYTES >> 20} MiB per audio file",
                            hint="cut the recording into shorter clips")
    else:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: no such audio file", hint="check the path (relative to the folder vlmctl chat started in)")
        if path.stat().st_size > MAX_AUDIO_FILE_BYTES:
            raise DataError(f"{path}: {path.stat().st_size / 2**20:,.0f} MiB, over the limit of {MAX_AUDIO_FILE_BYTES >> 20} MiB per audio file",
                            hint="cut the recording into shorter clips")
        data = path.read_bytes()
    try:
        seconds = probe(data).seconds
        if max_seconds is not None and seconds > max_seconds:
            raise DataError(f"{path}: {seconds:,.2f} s, longer than the {max_seconds:g} s the model's feature extractor takes "
                            "per clip (it would cut the rest)", hint=f"cut the clip into parts of at most {max_seconds:g} s and attach them in turn")
        # not the data pipeline's length limits: the model's window (above) is the one that matters here
        return normalize_audio(data, DataAudio(min_seconds=0.0, max_seconds=math.inf)).data
    except AudioError as exc:
        raise DataError(f"{path}: {exc.detail} ({exc.reason})", hint=hint) from None


@dataclass
class ChatSession:
    """A conversation with a loaded model (`load_for_generation`).

    `history` holds the turns so far in the canonical message shape (`vlmctl.data.sample`), `images` the encoded
    images their image parts index, `pending` the images attached for the next user turn; `audios` and
    `pending_audios` the same for audio clips, `videos` and `pending_videos` for videos (stored clips, `read_video`).
    `system` is sent first in every request when given. `family`: the model's `FamilySpec` (default: from its
    config), which decides the modalities taken. `video`: the `data.video` settings (`DataVideo`) attached videos
    are sampled by (defaults when None; `vlmctl.inference.video_settings`). Sampling as in `generate`
    (`temperature` 0: greedy). Raises UsageError for bad sampling values.
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
    audios: list[bytes] = field(default_factory=list)
    pending_audios: list[bytes] = field(default_factory=list)
    family: Any = None
    videos: list[bytes] = field(default_factory=list)
    pending_videos: list[bytes] = field(default_factory=list)
    video: Any = None

    def __post_init__(self) -> None:
        _check_sampling(None, self.max_new_tokens, self.temperature, self.top_p)
        if self.family is None:
            self.family = model_family(self.model)

    @property
    def turns(self) -> int:
        """Completed user turns in the history."""
        return sum(m["role"] == "user" for m in self.history)

    def attach(self, image: Path | str | bytes) -> None:
        """Queue an image (a path, or encoded bytes) for the next user turn. Raises UsageError when the model's
        family takes no images, DataError for a file that is not a readable image (nothing is queued then)."""
        self.pending.extend(self._images([image]))

    def attach_audio(self, clip: Path | str | bytes) -> None:
        """Queue an audio clip (a path, or encoded bytes) for the next user turn. Raises UsageError when the model's
        family takes no audio, DataError for a file that is not a readable clip or is longer than the model's
        window (`read_audio`; nothing is queued then)."""
        self.pending_audios.extend(self._audios([clip]))

    def attach_video(self, video: Path | str | bytes) -> None:
        """Queue a video (a path, or encoded bytes) for the next user turn, its frames sampled now (`read_video`
        with the session's `video` settings). Raises UsageError when the model's family takes no video, DataError
        for a file that is not a readable video or breaks the settings' frame and length bounds (nothing is
        queued then)."""
        self.pending_videos.extend(self._videos([video]))

    def _images(self, images: Sequence[Path | str | bytes]) -> list[bytes]:
        if images:
            check_modality("image", self.family)
        return [bytes(i) if isinstance(i, (bytes, bytearray)) else read_image(Path(i)) for i in images]

    def _audios(self, clips: Sequence[Path | str | bytes]) -> list[bytes]:
        if clips:
            check_modality("audio", self.family)
        window = audio_window(self.processor)
        return [bytes(c) if isinstance(c, (bytes, bytearray)) else read_audio(Path(c), window) for c in clips]

    def _videos(self, videos: Sequence[Path | str | bytes]) -> list[bytes]:
        if videos:
            check_modality("video", self.family)
        return [read_video(v, self.video) for v in videos]

    def reset(self) -> None:
        """Forget the conversation, its images, videos and clips, and any pending ones (the system prompt stays)."""
        for media in (self.history, self.images, self.pending, self.audios, self.pending_audios, self.videos, self.pending_videos):
            media.clear()

    def request(self, text: str, images: Sequence[Path | str | bytes] = (), audios: Sequence[Path | str | bytes] = (),
                videos: Sequence[Path | str | bytes] = ()) -> GenerationRequest:
        """The request for a new user turn: the system prompt, the history, then the user's message with the
        pending clips and `audios`, the pending videos and `videos`, then the pending images and `images` (paths or
        encoded bytes), placed before `text`. Changes nothing; raises UsageError for a modality the family does not
        take, DataError for an unreadable image, video or clip."""
        new = [*self.pending, *self._images(images)]
        new_audios = [*self.pending_audios, *self._audios(audios)]
        new_videos = [*self.pending_videos, *self._videos(videos)]
        content = [{"type": "audio", "index": len(self.audios) + k} for k in range(len(new_audios))]
        content += [{"type": "video", "index": len(self.videos) + k} for k in range(len(new_videos))]
        content += [{"type": "image", "index": len(self.images) + k} for k in range(len(new))]
        if text:
            content.append({"type": "text", "text": text})
        system = [{"role": "system", "content": [{"type": "text", "text": self.system}]}] if self.system else []
        return GenerationRequest(messages=[*system, *self.history, {"role": "user", "content": content}],
                                 images=[*self.images, *new], id=f"turn-{self.turns + 1}", audios=[*self.audios, *new_audios],
                                 videos=[*self.videos, *new_videos])

    def stream(self, text: str, images: Sequence[Path | str | bytes] = (), audios: Sequence[Path | str | bytes] = (),
               videos: Sequence[Path | str | bytes] = ()) -> Iterator[str]:
        """Generate the reply to `text` (with `images`, `audios`, `videos` and the pending ones) piece by piece
        (`stream_generate`), leading whitespace dropped. When the reply is complete, the user turn and the reply
        join the history; a stream closed early (an interrupted reply) leaves the history and the pending media as
        they were. Raises DataError for an unreadable image, video or clip, UsageError for an empty message
        without media or a modality the family does not take."""
        if not (text or images or audios or videos or self.pending or self.pending_audios or self.pending_videos):
            raise UsageError("nothing to send", hint="type a question, or attach an image with /image PATH (a video with /video "
                             "PATH, a clip with /audio PATH)")
        request = self.request(text, images, audios, videos)
        pieces: list[str] = []
        for piece in stream_generate(self.model, self.processor, request, max_new_tokens=self.max_new_tokens,
                                     temperature=self.temperature, top_p=self.top_p, family=self.family, video=self.video):
            if not pieces:
                piece = piece.lstrip()
                if not piece:
                    continue
            pieces.append(piece)
            yield piece
        self._commit(request, "".join(pieces).strip())

    def ask(self, text: str, images: Sequence[Path | str | bytes] = (), audios: Sequence[Path | str | bytes] = (),
            videos: Sequence[Path | str | bytes] = ()) -> str:
        """The whole reply to `text` (see `stream`), stripped."""
        return "".join(self.stream(text, images, audios, videos)).strip()

    def _commit(self, request: GenerationRequest, reply: str) -> None:
        self.images[:] = request.images
        self.audios[:] = request.audios
        self.videos[:] = request.videos
        self.pending.clear()
        self.pending_audios.clear()
        self.pending_videos.clear()
        self.history[:] = [m for m in request.messages if m["role"] != "system"]
        self.history.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})


__all__ = ["COMMANDS", "ChatInput", "ChatSession", "audio_window", "parse_input", "read_audio", "read_image", "read_video"]
