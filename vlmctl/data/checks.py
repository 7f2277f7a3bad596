"""Reason-coded checks shared by `data validate`, `data prepare` and `vlmctl eval --data`.

Every rejected sample gets exactly one reason code. The codes are public output (rejected.jsonl, manifest.json,
`data validate --json`); when a sample has several defects the first in this order wins:

| code | meaning | where it is found |
|---|---|---|
| `parse_error` | malformed JSON line or record, a key repeated in one JSON object, invalid UTF-8 (location = file:line, or file:line[#index] for an element of a one-line array) | reader |
| `too_deep` | a record nested deeper than 100 levels (`formats._json.MAX_DEPTH`) | reader |
| `too_large` | a record over 64 MiB (`formats._json.MAX_RECORD_BYTES`), or a tar member over the image file limit | reader |
| `bad_roles` | roles must be an optional system turn, then user/assistant alternating, ending with assistant | `build_sample` |
| `empty_turn` | a turn with blank text and no image or video | `build_sample` |
| `placeholder_mismatch` | number of `<image>` placeholders != number of images, of `<video>` placeholders != number of videos, or of `<audio>` placeholders != number of audio clips; a placeholder or media part in a system or assistant turn | `build_sample` |
| `invalid_text` | the id, a turn's text or a meta value holds a lone surrogate (`\\ud800` in JSON), which is not Unicode text | `build_sample` |
| `missing_response` | a preference pair whose chosen or rejected answer is missing or blank (the detail names which), or, with `data.kind: preference`, a sample that is not a pair | `build_preference_sample` / prepare / validate |
| `same_response` | a preference pair whose chosen and rejected answers are the same text (after collapsing whitespace): it teaches nothing | `build_preference_sample` |
| `link_member` | a WebDataset tar member of the sample is a symbolic or hard link (GNU tar stores the second path of a hard-linked file so), a device or a FIFO: links are not followed | reader |
| `duplicate_key` | two WebDataset tar members in a row with the same key and extension (the second would replace the first) | reader |
| `outside_root` | an image path resolves (symlinks included) outside the source's folder, its `image_root` and `data.media_roots` | reader |
| `missing_image` | the image file does not exist, is a folder, or is a remote URL | `check_images` |
| `not_a_file` | the image path is a device, FIFO or socket (refused before reading) | `check_images` |
| `corrupt_image` | the image does not fully decode (truncated file, not an image) | `check_images` |
| `image_too_large` | over `data.max_image_pixels` (from the header, before decoding) or a file over 512 MiB | `check_images` |
| `image_too_small` | the shorter side is below `data.min_image_side` pixels | `check_images` |
| `missing_video` | the video file does not exist, is a folder, or is a remote URL | `check_images` |
| `corrupt_video` | not a video container, truncated, a packet that does not decode, no frames, a still image | `check_images` |
| `unsupported_codec` | FFmpeg (PyAV) has no decoder for the video stream's codec | `check_images` |
| `video_too_short` | fewer decodable frames than `data.video.min_frames` | `check_images` |
| `video_too_long` | longer than `data.video.max_seconds` (from the header, before decoding), or a file over 2 GiB | `check_images` |
| `missing_audio` | the audio file does not exist, is a folder, or is a remote URL | `check_images` |
| `corrupt_audio` | not an audio file libsndfile reads, truncated (fewer samples than the header lists), samples that do not decode | `check_images` |
| `unsupported_audio` | a container libsndfile has no decoder for (MP4/M4A/AAC, WebM, WMA, AMR): convert to FLAC or WAV | `check_images` |
| `audio_too_short` | no samples, or shorter than `data.audio.min_seconds` | `check_images` |
| `audio_too_long` | longer than `data.audio.max_seconds` (from the header, before decoding), or a file over 1 GiB | `check_images` |
| `duplicate` | same normalized text and image bytes as an earlier sample (the detail names it) | prepare / validate |
| `duplicate_id` | the same `id` as an earlier sample of the same source (the detail names it); with `data.duplicate_ids: keep` only counted | prepare / validate |
| `too_long` | text + visual tokens over `data.max_length`, or over one packed training row (`train.tokens_per_batch x train.sequence_parallel`, when packing and a number) when that is smaller: the detail names the GPUs it needs (only when a processor is known) | prepare / validate |

A sample with images (or videos, or audio clips) and no placeholder of that modality at all is kept: its images, then
its videos, then its audio clips are put at the start of the first user turn (the LLaVA convention).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from vlmctl.data.images import ImageError, normalize_image, read_ref
from vlmctl.data.sample import Sample

# numpy is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.

REASONS = (
    "parse_error",
    "too_deep",
    "too_large",
    "bad_roles",
    "empty_turn",
    "placeholder_mismatch",
    "invalid_text",
    "missing_response",
    "same_response",
    "link_member",
    "duplicate_key",
    "outside_root",
    "missing_image",
    "not_a_file",
    "corrupt_image",
    "image_too_large",
    "image_too_small",
    "missing_video",
    "corrupt_video",
    "unsupported_codec",
    "video_too_short",
    "video_too_long",
    "missing_audio",
    "corrupt_audio",
    "unsupported_audio",
    "audio_too_short",
    "audio_too_long",
    "duplicate",
    "duplicate_id",
    "too_long",
)
FILTERS = ("duplicate", "duplicate_id", "image_too_small", "image_too_large", "video_too_short", "video_too_long",
           "audio_too_short", "audio_too_long", "too_long")
"""Reasons that apply a limit the project sets (dedup, duplicate_ids, min_image_side, max_image_pixels,
data.video.min_frames / max_seconds, data.audio.min_seconds / max_seconds, max_length) rather than a defect of the
data. The limits count toward `data.min_kept_fraction` as every defect does; the repeats (duplicate,
duplicate_id) do not (`prepare.check_kept`)."""
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER, "audio": AUDIO_PLACEHOLDER}
"""Text placeholder of each modality a reader accepts (LLaMA-Factory's ShareGPT: `<image>`, `<video>`, `<audio>`)."""
PART_TYPES = {"image": "image", "image_url": "image", "input_image": "image",
              "video": "video", "video_url": "video", "input_video": "video",
              "audio": "audio", "audio_url": "audio", "input_audio": "audio"}
"""Content-part `type` -> modality (transformers' chat templates: image / video / audio; OpenAI: image_url,
input_image, input_audio; vLLM's OpenAI-compatible server: video_url, audio_url)."""
MEDIA_KEYS = {"video": ("video", "video_url"), "audio": ("audio", "audio_url", "input_audio")}
"""Keys that mark an untyped content part as a video or audio part (any other untyped media part is an image)."""

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}


@dataclass
class Rejection:
    """One rejected sample: where it came from, the reason code and a human-readable detail."""

    reason: str
    source: str
    location: str
    detail: str
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "location": self.location, "reason": self.reason, "detail": self.detail, "id": self.id}


class RecordError(Exception):
    """Raised by readers for a record of the wrong shape (reported as parse_error at the record's location)."""


@dataclass(frozen=True)
class VideoFacts:
    """One checked video: `frames` sampled and stored, frame `width` x `height` (pixels), `seconds` of the original,
    `converted` (False when a stored clip was kept byte for byte)."""

    frames: int
    width: int
    height: int
    seconds: float
    converted: bool = True
    retimed: bool = False  # the header's duration contradicted the frames' timestamps, which were used


@dataclass(frozen=True)
class AudioFacts:
    """One checked audio clip: `seconds` of audio, the original `sampling_rate` (Hz) and `channels`, `converted`
    (False when a stored FLAC was kept byte for byte)."""

    seconds: float
    sampling_rate: int
    channels: int
    converted: bool = True


@dataclass
class SampleInfo:
    """What the check stage learned about a kept sample (for dedup, split and statistics)."""

    digest: bytes  # 16-byte blake2b of normalized text + image bytes
    widths: list[int] = field(default_factory=list)
    heights: list[int] = field(default_factory=list)
    conversions: list[str] = field(default_factory=list)
    text_chars: int = 0
    num_turns: int = 0
    flags: list[str] = field(default_factory=list)  # findings that did not reject it (duplicate_id with `keep`)
    videos: list[VideoFacts] = field(default_factory=list)  # one per video, in order
    audios: list[AudioFacts] = field(default_factory=list)  # one per audio clip, in order


# --------------------------------------------------------------------------------------------------- assembly


def build_sample(
    turns: Iterable[tuple[Any, Any]],
    *,
    images: list[Any] | None = None,
    videos: list[Any] | None = None,
    audios: list[Any] | None = None,
    id: str,
    source: str,
    location: str,
    meta: dict[str, Any] | None = None,
    resolve_part: Callable[[dict[str, Any]], Any] | None = None,
    image_placeholder_for_video: bool = False,
) -> Sample | Rejection:
    """Assemble a canonical Sample from raw turns, running the text checks (bad_roles, empty_turn,
    placeholder_mismatch) in that order.

    `turns` are (role, content) pairs; content is a string (with optional `<image>` / `<video>` / `<audio>`
    placeholders) or a list of content parts (`{"type": "text", "text"|"value": ...}`, `{"type": "image"|"image_url",
    ...}`, `{"type": "video"|"video_url", ...}`, `{"type": "audio"|"input_audio"|"audio_url", ...}`: `PART_TYPES`).
    `images` / `videos` / `audios` are the record-level references that placeholders of their modality consume in
    order. `resolve_part(part)` turns an explicit media part into a
    reference (bytes, Path or MissingRef), or None when the part carries no reference (it then consumes the next
    record-level part of its modality, like a placeholder). `image_placeholder_for_video`: `<image>` placeholders
    stand for the videos when the record has videos and no images (LLaVA-Video's layout). The returned Sample's
    media still hold references; `check_images` reads and normalizes them.
    """
    record = {"image": list(images or []), "video": list(videos or []), "audio": list(audios or [])}
    reject = lambda reason, detail: Rejection(reason, source, location, detail, id)  # noqa: E731

    # 1. roles
    roles: list[str] = []
    contents: list[Any] = []
    for raw_role, content in turns:
        role = ROLE_ALIASES.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            return reject("bad_roles", f"unknown role {raw_role!r} (expected system, user/human or assistant/gpt)")
        roles.append(role)
        contents.append(content)
    problem = _role_problem(roles)
    if problem:
        return reject("bad_roles", problem)

    # 2. parts + empty turns
    messages: list[dict[str, Any]] = []
    explicit: dict[str, list[Any]] = {kind: [] for kind in PLACEHOLDERS}  # references of explicit media parts, in order
    for i, (role, content) in enumerate(zip(roles, contents)):
        try:
            parts = _parts(content, resolve_part, explicit)
        except RecordError as exc:
            return Rejection("parse_error", source, location, f"turn {i}: {exc}", id)
        if all(p["type"] == "text" for p in parts) and not "".join(p["text"] for p in parts).strip():
            return reject("empty_turn", f"turn {i} ({role}) has no text")
        media = next((p["type"] for p in parts if p["type"] != "text"), None)
        if media is not None and role != "user":  # a chat template shows media only in user turns
            return reject("placeholder_mismatch", f"turn {i} ({role}) holds {PLACEHOLDERS[media]}: images, videos and audio go in user turns")
        messages.append({"role": role, "content": parts})
    bad_text = _invalid_text(id, messages, meta)
    if bad_text:
        return reject("invalid_text", bad_text)
    if image_placeholder_for_video and record["video"] and not record["image"] and not explicit["image"]:
        _retype_placeholders(messages, "image", "video")

    # 3. placeholders, per modality
    refs: dict[str, list[Any]] = {}
    for kind in PLACEHOLDERS:
        listed, parts_given = record[kind], explicit[kind]
        n_placeholders = sum(1 for m in messages for p in m["content"] if p["type"] == kind and p.get("placeholder"))
        token = PLACEHOLDERS[kind]
        if parts_given and (n_placeholders or listed):
            what = f"{n_placeholders} {token} placeholder(s) in text" if n_placeholders else f"{len(listed)} listed {kind}(s)"
            return reject("placeholder_mismatch", f"{len(parts_given)} {kind} part(s) and also {what}")
        if n_placeholders == 0 and listed:
            first_user = next(m for m in messages if m["role"] == "user")
            at = sum(1 for p in first_user["content"] if p.get("prepended"))  # after the parts prepended before
            first_user["content"][at:at] = [{"type": kind, "placeholder": True, "prepended": True} for _ in listed]
            n_placeholders = len(listed)
        if n_placeholders != len(listed) and not parts_given:
            return reject("placeholder_mismatch", f"{n_placeholders} {token} placeholder(s) for {len(listed)} {kind}(s)")
        refs[kind] = parts_given or listed
    index = {kind: 0 for kind in PLACEHOLDERS}
    for m in messages:
        for p in m["content"]:
            if p["type"] in index:
                for key in ("placeholder", "ref", "prepended"):
                    p.pop(key, None)
                p["index"] = index[p["type"]]
                index[p["type"]] += 1
    sample = Sample(id=str(id), messages=messages, images=refs["image"], videos=refs["video"] or None,
                    audios=refs["audio"] or None, source=source, meta=dict(meta or {}))
    sample.location = location
    return sample


def build_preference_sample(
    prompt: Iterable[tuple[Any, Any]],
    chosen: Any,
    rejected: Any,
    *,
    keys: tuple[str, str] = ("chosen", "rejected"),
    **kwargs: Any,
) -> Sample | Rejection:
    """Assemble a preference pair: the `prompt` turns ((role, content) pairs ending with a user turn), the
    `chosen` and the `rejected` assistant answer (each a string, a list of content parts, or None when the record
    lacks it). `keys` name the two answers in details (the record's own keys, e.g. `rejected_response`); the other
    keyword arguments are those of `build_sample` (media, id, source, location, meta, resolve_part).

    Checks, in order: missing_response (an answer missing or blank), then `build_sample`'s checks on the prompt
    and the chosen answer (bad_roles, empty_turn, placeholder_mismatch, invalid_text), then the rejected answer
    (placeholder_mismatch for a placeholder or media part in it, invalid_text), then same_response. Returns a
    Sample with `rejected` set (see `vlmctl.data.sample`).
    """
    source, location, sid = kwargs["source"], kwargs["location"], kwargs["id"]
    for key, answer in zip(keys, (chosen, rejected)):
        if answer is None:
            return Rejection("missing_response", source, location, f"the {key} answer is missing", sid)
        if _blank(answer):
            return Rejection("missing_response", source, location, f"the {key} answer is empty", sid)
    sample = build_sample([*prompt, ("assistant", chosen)], **kwargs)
    if isinstance(sample, Rejection):
        return sample
    try:
        parts = _parts(rejected, None, {kind: [] for kind in PLACEHOLDERS})
    except RecordError as exc:
        return Rejection("parse_error", source, location, f"{keys[1]}: {exc}", sid)
    media = next((p["type"] for p in parts if p["type"] != "text"), None)
    if media is not None:
        return Rejection("placeholder_mismatch", source, location,
                         f"the {keys[1]} answer holds {PLACEHOLDERS[media]}: images, videos and audio go in user turns", sid)
    for p in parts:
        problem = _bad_char(p["text"])
        if problem:
            return Rejection("invalid_text", source, location, f"the {keys[1]} answer holds {problem}", sid)
    sample.rejected = {"role": "assistant", "content": parts}
    if _norm_text(sample.messages[-1]) == _norm_text(sample.rejected):
        return Rejection("same_response", source, location, f"the {keys[0]} and {keys[1]} answers are the same text", sid)
    return sample


def _blank(content: Any) -> bool:
    """True for an answer without text: a blank string, or parts whose text parts are all blank."""
    if isinstance(content, str):
        return not content.strip()
    if isinstance(content, dict):
        content = [content]
    if isinstance(content, list):
        texts = [p if isinstance(p, str) else p.get("text", p.get("value")) for p in content if isinstance(p, (str, dict))]
        return not any(isinstance(t, str) and t.strip() for t in texts)
    return False  # another type: reported as a parse error by build_sample


def _norm_text(message: dict[str, Any]) -> str:
    return " ".join(" ".join(p["text"] for p in message["content"] if p["type"] == "text").split())


def count_tokens(counter: Any, sample: Sample, sizes: list[tuple[int, int]]) -> int:
    """Tokens `sample` takes in a packed training row under `counter` (a `vlmctl.data.tokens.TokenCounter`): its
    conversation, plus for a preference pair the rejected conversation (prompt and media again), since both are
    packed into the same row as two segments. `sizes`: its images' (width, height)."""
    n = counter.count(sample, sizes)
    if sample.rejected is not None:
        n += counter.count(sample.rejected_sample(), sizes)
    return n


def _bad_char(text: str) -> str | None:
    """Why `text` cannot be stored as UTF-8 (a lone surrogate such as `\\ud800`, which JSON's `\\uXXXX` escapes
    can produce), or None. ASCII text is accepted without encoding it."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate {ascii(text[exc.start])} at character {exc.start}, which is not Unicode text"
    return None


def _invalid_text(id: Any, messages: list[dict[str, Any]], meta: dict[str, Any] | None) -> str | None:
    """The first string of the sample (its id, the text of its turns, its meta values) that is not valid Unicode."""
    problem = _bad_char(str(id))
    if problem:
        return f"the id holds {problem}"
    for i, m in enumerate(messages):
        for p in m["content"]:
            problem = _bad_char(p["text"]) if p["type"] == "text" else None
            if problem:
                return f"turn {i} holds {problem}"
    for key, value in (meta or {}).items():
        for text in (value if isinstance(value, (list, tuple)) else [value]):
            problem = _bad_char(text) if isinstance(text, str) else None
            if problem or not isinstance(key, str) or _bad_char(key):
                return f"meta {ascii(key)} holds {problem or 'an invalid key'}"
    return None


def _retype_placeholders(messages: list[dict[str, Any]], old: str, new: str) -> None:
    for m in messages:
        for p in m["content"]:
            if p["type"] == old and p.get("placeholder"):
                p["type"] = new


def _role_problem(roles: list[str]) -> str | None:
    body = roles[1:] if roles and roles[0] == "system" else roles
    if not body:
        return "no user/assistant turns"
    for i, role in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            offset = len(roles) - len(body)
            return f"turn {i + offset} is {role}, expected {expected} (turns must alternate user/assistant after an optional system turn)"
    if body[-1] != "assistant":
        return "the conversation ends with a user turn (the last turn must be the assistant's)"
    return None


def _parts(content: Any, resolve_part, explicit: dict[str, list[Any]]) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return _split_placeholders(content)
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        raise RecordError(f"content must be a string or a list of parts, not {type(content).__name__}")
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            parts.extend(_split_placeholders(part))
            continue
        if not isinstance(part, dict):
            raise RecordError(f"content part must be an object, not {type(part).__name__}")
        kind = part.get("type")
        if kind is None:
            marked = [m for m, keys in MEDIA_KEYS.items() if any(k in part for k in keys)]
            if marked:
                kind = marked[0]
            else:
                kind = "text" if ("text" in part or "value" in part) and not any(k in part for k in ("image", "image_url", "path")) else "image"
        if kind == "text":
            text = part.get("text", part.get("value"))
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise RecordError(f"text part must hold a string, not {type(text).__name__}")
            parts.extend(_split_placeholders(text))
        elif kind in PART_TYPES:
            # A part without its own reference ({"type": "image"}, the transformers chat-template style) is a
            # placeholder for the next record-level part of its modality.
            modality = PART_TYPES[kind]
            ref = resolve_part(part) if resolve_part is not None else None
            if ref is None:
                parts.append({"type": modality, "placeholder": True})
            else:
                explicit[modality].append(ref)
                parts.append({"type": modality})
        else:
            raise RecordError(f"unsupported content part type {kind!r} (expected text, {', '.join(PART_TYPES)})")
    return parts


_PLACEHOLDER_RE = re.compile("(" + "|".join(re.escape(t) for t in PLACEHOLDERS.values()) + ")")
_PLACEHOLDER_KIND = {token: kind for kind, token in PLACEHOLDERS.items()}


def _split_placeholders(text: str) -> list[dict[str, Any]]:
    # Whitespace next to a placeholder ("<image>\nWhat is...") is layout, not content: strip it.
    pieces = _PLACEHOLDER_RE.split(text)  # text, token, text, token, ..., text
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            parts.append({"type": _PLACEHOLDER_KIND[piece], "placeholder": True})
            continue
        if len(pieces) > 1:
            piece = piece.strip()
        if piece or len(pieces) == 1:
            parts.append({"type": "text", "text": piece})
    return parts


# ----------------------------------------------------------------------------------------------- image stage


def check_images(sample: Sample, *, min_image_side: int = 28, max_image_pixels: int | None = None,
                 video: Any = None, audio: Any = None) -> tuple[Sample, SampleInfo] | Rejection:
    """Read, fully decode and normalize the sample's images, videos and audio clips; compute its dedup digest.

    Returns the sample with `images` as 8-bit RGB encoded bytes, `videos` as stored clips
    (`vlmctl.data.modalities.video.normalize_video`, sampled by `video`, a `DataVideo`) and `audios` as stored FLAC
    (`vlmctl.data.modalities.audio.normalize_audio` under `audio`, a `DataAudio`; default settings when None), or a
    Rejection with reason outside_root, missing_image, not_a_file, corrupt_image, image_too_large (over
    `max_image_pixels`, checked from the header before decoding, or a file over `images.MAX_IMAGE_FILE_BYTES`),
    image_too_small, for a video missing_video, corrupt_video, unsupported_codec, video_too_short, video_too_long,
    for an audio clip missing_audio, corrupt_audio, unsupported_audio, audio_too_short, audio_too_long (the detail
    names the image, video or audio index and file).
    """
    location = getattr(sample, "location", "")
    info = SampleInfo(digest=b"")
    data: list[bytes] = []
    for i, ref in enumerate(sample.images):
        name = f"image {i}" + (f" ({ref})" if isinstance(ref, Path) else "")
        try:
            data_i = read_ref(ref)
        except ImageError as exc:  # the detail names the file already
            return Rejection(exc.reason, sample.source, location, f"image {i}: {exc.detail}", sample.id)
        try:
            norm = normalize_image(data_i, max_pixels=max_image_pixels)
        except ImageError as exc:
            return Rejection(exc.reason, sample.source, location, f"{name}: {exc.detail}", sample.id)
        if min(norm.width, norm.height) < min_image_side:
            return Rejection(
                "image_too_small",
                sample.source,
                location,
                f"{name} is {norm.width}x{norm.height} px; the shorter side is below data.min_image_side={min_image_side}",
                sample.id,
            )
        data.append(norm.data)
        info.widths.append(norm.width)
        info.heights.append(norm.height)
        if norm.conversion:
            info.conversions.append(norm.conversion)
    sample.images = data
    for name, settings in (("video", video), ("audio", audio)):
        rejected = _check_clips(sample, info, settings, name) if sample.media.get(name) else None
        if rejected is not None:
            return rejected
    info.digest = sample_digest(sample)
    texts = sample.text_parts()
    info.text_chars = sum(len(t) for t in texts)
    info.num_turns = len(sample.messages)
    return sample, info


def _check_clips(sample: Sample, info: SampleInfo, settings: Any, name: str) -> Rejection | None:
    """Read and normalize the sample's `name` parts in place ("video": stored clips, recording `VideoFacts`;
    "audio": stored FLAC, recording `AudioFacts` in `info`); the first failure as a Rejection. A file that cannot
    be read is `missing_<name>`, one over the size limit `<name>_too_long`."""
    if name == "video":
        from vlmctl.data.modalities.video import MAX_VIDEO_FILE_BYTES as max_bytes
        from vlmctl.data.modalities.video import VideoError as ClipError
        from vlmctl.data.modalities.video import normalize_video as normalize

        def facts(clip):
            return VideoFacts(clip.frames, clip.width, clip.height, clip.seconds, clip.conversion is not None,
                              "from the frames' timestamps" in (clip.conversion or ""))
        recorded = info.videos
    else:
        from vlmctl.data.modalities.audio import MAX_AUDIO_FILE_BYTES as max_bytes
        from vlmctl.data.modalities.audio import AudioError as ClipError
        from vlmctl.data.modalities.audio import normalize_audio as normalize

        def facts(clip):
            return AudioFacts(clip.seconds, clip.sampling_rate, clip.channels, clip.conversion is not None)
        recorded = info.audios
    read_reasons = {"missing_image": f"missing_{name}", "image_too_large": f"{name}_too_long"}
    location = getattr(sample, "location", "")
    clips = []
    for i, ref in enumerate(sample.media[name]):
        label = f"{name} {i}" + (f" ({ref})" if isinstance(ref, Path) else "")
        try:
            data = read_ref(ref, max_bytes=max_bytes)
        except ImageError as exc:  # the detail names the file already
            return Rejection(read_reasons.get(exc.reason, exc.reason), sample.source, location, f"{name} {i}: {exc.detail}", sample.id)
        try:
            clip = normalize(data, settings)
        except ClipError as exc:
            return Rejection(exc.reason, sample.source, location, f"{label}: {exc.detail}", sample.id)
        except Exception as exc:  # noqa: BLE001 - any other decoder or encoder failure costs this sample only
            return Rejection(f"corrupt_{name}", sample.source, location, f"{label}: cannot decode: {type(exc).__name__}: {exc}", sample.id)
        clips.append(clip.data)
        recorded.append(facts(clip))
    sample.media[name] = clips
    return None


def sample_digest(sample: Sample) -> bytes:
    """16-byte blake2b of the normalized conversation (roles, whitespace-collapsed text, media positions) and the
    media bytes (images, then stored video clips, then stored audio clips). Equal digests = duplicate samples; the
    digest also drives the train/val split (samples without videos or audio hash as they did before those existed,
    so splits do not move)."""
    h = hashlib.blake2b(digest_size=16)
    norm = [
        [m["role"], [(" ".join(p["text"].split()) if p["type"] == "text" else [p["type"], p["index"]]) for p in m["content"]]]
        for m in sample.messages
    ]
    if sample.rejected is not None:  # a pair differs from another by its rejected answer too; SFT digests unchanged
        norm.append(["rejected", [" ".join(p["text"].split()) for p in sample.rejected["content"] if p["type"] == "text"]])
    h.update(json.dumps(norm, ensure_ascii=False, separators=(",", ":")).encode())
    for img in sample.images:
        h.update(hashlib.blake2b(img, digest_size=16).digest())
    for clip in sample.videos:
        h.update(hashlib.blake2b(clip, digest_size=16).digest())
    for clip in sample.audios:
        h.update(hashlib.blake2b(clip, digest_size=16).digest())
    return h.digest()


def is_val(digest: bytes, val_ratio: float) -> bool:
    """Deterministic split: a sample goes to val when bytes 8..16 of its digest, read as a fraction of 2**64, are
    below `val_ratio`. Independent of order and of the other samples, so adding data never moves a sample."""
    return int.from_bytes(digest[8:16], "big") / 2**64 < val_ratio


class DigestSet:
    """A set of 64-bit digest prefixes in a numpy open-addressing table: 16 bytes per sample at load factor 1/2,
    instead of ~100 bytes per entry of a Python set (so dedup of 10M samples needs 160 MB, not 1 GB); with
    `values=True` each key also holds a 64-bit value (32 bytes per sample), e.g. a `LocationTable` handle of the
    first sample that had it. The false-positive rate of 64-bit prefixes is n^2 / 2^65 (3e-6 at 10M samples)."""

    def __init__(self, capacity: int = 1 << 16, *, values: bool = False):
        import numpy as np

        self._np = np
        self._table = np.zeros(capacity, dtype=np.uint64)
        self._values = np.zeros(capacity, dtype=np.uint64) if values else None
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, digest: bytes) -> bool:
        """Insert; return False when it was already present."""
        return self.setdefault(digest, 0) is None

    def setdefault(self, digest: bytes, value: int) -> int | None:
        """Insert `digest` with `value`; return None when it is new, else the value stored with it first."""
        key = int.from_bytes(digest[:8], "big") or 1  # 0 marks an empty slot
        if 2 * (self._size + 1) > len(self._table):
            self._grow()
        return self._insert(self._table, self._values, key, value)

    def _insert(self, table, values, key: int, value: int) -> int | None:
        mask = len(table) - 1
        i = key & mask
        k = self._np.uint64(key)
        while True:
            cur = table[i]
            if cur == 0:
                table[i] = k
                if values is not None:
                    values[i] = value
                self._size += 1
                return None
            if cur == k:
                return int(values[i]) if values is not None else 0
            i = (i + 1) & mask

    def _grow(self) -> None:
        used = self._table != 0
        old_keys = self._table[used].tolist()
        old_values = self._values[used].tolist() if self._values is not None else [0] * len(old_keys)
        self._table = self._np.zeros(len(self._table) * 2, dtype=self._np.uint64)
        if self._values is not None:
            self._values = self._np.zeros(len(self._table), dtype=self._np.uint64)
        self._size = 0
        for key, value in zip(old_keys, old_values):
            self._insert(self._table, self._values, int(key), int(value))


class LocationTable:
    """Sample locations packed into 64-bit handles, so that a duplicate can name the earlier sample without keeping
    every location string: `file.json:1234` is stored as (pattern `file.json:`+`` , number 1234); the few patterns
    (one per file) are kept once. Locations without a trailing number are kept as strings."""

    _NUMBERED = re.compile(r"^(.*\D|)(\d{1,12})(\D{0,4})$", re.S)
    _SHIFT = 40  # number bits
    _STRING = 1 << 63  # handle flag: an index into `_strings`

    def __init__(self):
        self._patterns: dict[tuple[str, str, int], int] = {}
        self._pattern_list: list[tuple[str, str, int]] = []
        self._strings: list[str] = []

    def add(self, location: str) -> int:
        """The handle of `location` (pass it to `get`)."""
        m = self._NUMBERED.match(location)
        if m is not None:
            prefix, digits, suffix = m.groups()
            width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0  # keep leading zeros
            pattern = (prefix, suffix, width)
            pid = self._patterns.get(pattern)
            if pid is None and len(self._pattern_list) < (1 << (62 - self._SHIFT)):
                pid = self._patterns[pattern] = len(self._pattern_list)
                self._pattern_list.append(pattern)
            if pid is not None:
                return (pid << self._SHIFT) | int(digits)
        self._strings.append(location)
        return self._STRING | (len(self._strings) - 1)

    def get(self, handle: int) -> str:
        if handle & self._STRING:
            return self._strings[handle & ~self._STRING]
        prefix, suffix, width = self._pattern_list[handle >> self._SHIFT]
        number = handle & ((1 << self._SHIFT) - 1)
        return f"{prefix}{number:0{width}d}{suffix}" if width else f"{prefix}{number}{suffix}"
