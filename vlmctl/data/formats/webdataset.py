"""`webdataset`: tar shards (a file, a folder of `*.tar`, or a glob) in the WebDataset layout
(https://github.com/webdataset/webdataset: files with the same key up to the first dot form one sample).

Per sample `{key}`:
- images: `{key}.jpg|jpeg|png|webp|...` or several numbered ones (`{key}.0.jpg`, `{key}.img1.png`), in natural
  order of their extensions; videos likewise: `{key}.mp4|mkv|webm|mov|avi|...` (`video.VIDEO_EXTENSIONS`), and audio
  clips: `{key}.wav|flac|mp3|ogg|...` (`audio.AUDIO_EXTENSIONS`);
- text, one of:
  - `{key}.json` with `messages` / `conversations` (as in the messages and sharegpt formats; image parts and
    `<image>` placeholders take the tar's images in order, video parts and `<video>` placeholders its videos, audio
    parts and `<audio>` placeholders its audio clips;
    vlmctl's energon export writes this);
  - the energon VQA layout: `{key}.json` = `{"question": ...}` (optionally `answers`) + `{key}.txt` answer (an
    empty question leaves the media alone as the user turn);
  - captioning: `{key}.txt` alone (the user turn is the media, the assistant turn the caption or transcript: a
    `{key}.flac` + `{key}.txt` pair is a speech-recognition sample).

Shards are read as tar streams (`tarfile` mode `r|*`), one sample in memory at a time.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import Rejection, RecordError, build_sample
from vlmctl.data.formats._common import display, expand_paths, extract_meta, source_name, turns_of
from vlmctl.data.formats._json import JsonParseError, decode_record, open_regular
from vlmctl.data.images import IMAGE_EXTENSIONS, MAX_IMAGE_FILE_BYTES
from vlmctl.data.modalities.audio import AUDIO_EXTENSIONS
from vlmctl.data.modalities.video import VIDEO_EXTENSIONS
from vlmctl.data.sample import Sample

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
MAX_MEMBER_BYTES = MAX_IMAGE_FILE_BYTES
"""A tar member larger than this is not read: its sample is rejected as too_large."""


class Oversized(int):
    """The size in bytes of a tar member that was not read (over MAX_MEMBER_BYTES)."""


class Unread(str):
    """A tar member of a sample that was not read, with why: a symbolic or hard link (`link_member`: GNU tar stores
    the second path of a hard-linked file so), a device or FIFO entry, or a second member with the same key and
    extension (`duplicate_key`). `reason` is the rejection's reason code."""

    reason = "link_member"


class Duplicate(Unread):
    reason = "duplicate_key"


def _natural(text: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def iter_tar_groups(file: Path) -> Iterator[tuple[str, dict[str, bytes]] | str]:
    """(key, {extension: bytes}) for each sample of a tar stream; a string (error message) when the tar breaks.
    A member over MAX_MEMBER_BYTES is not read: its value is `Oversized(size)`."""
    key, parts = None, {}
    try:
        with open_regular(file) as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
            for member in tar:
                if member.isdir():
                    continue
                folder, _, base = member.name.rpartition("/")
                if base.startswith(".") or "." not in base:
                    continue
                stem, ext = base.split(".", 1)
                k = f"{folder}/{stem}" if folder else stem
                if k != key:
                    if key is not None:
                        yield key, parts
                    key, parts = k, {}
                ext = ext.lower()
                if ext in parts:  # the same key and extension again: keep neither silently
                    parts[ext] = Duplicate(f"{member.name} appears twice in a row (the second member would replace the first)")
                    continue
                if member.issym() or member.islnk():
                    kind = "symbolic" if member.issym() else "hard"
                    parts[ext] = Unread(f"{member.name} is a {kind} link to {member.linkname} (links are not followed)")
                    continue
                if not member.isfile():
                    parts[ext] = Unread(f"{member.name} is not a regular file (a device or FIFO entry)")
                    continue
                if member.size > MAX_MEMBER_BYTES:
                    parts[ext] = Oversized(member.size)
                    continue
                data = tar.extractfile(member)
                parts[ext] = data.read() if data is not None else b""
    except (tarfile.TarError, OSError, EOFError) as exc:
        # The sample being read when the tar broke may be incomplete: report it instead of yielding it.
        yield f"broken tar at sample {key!r}: {exc}"
        return
    if key is not None:
        yield key, parts


def group_to_sample(key: str, parts: dict[str, bytes], *, name: str, location: str) -> Sample | Rejection:
    """One webdataset sample (its parts by extension) -> an unchecked Sample or a Rejection (parse_error, too_deep,
    too_large, link_member, duplicate_key)."""
    unread = [v for v in parts.values() if isinstance(v, Unread)]
    if unread:
        return Rejection(unread[0].reason, name, location, "; ".join(unread), key)
    big = [f"{key}.{ext} ({size:,} bytes)" for ext, size in parts.items() if isinstance(size, Oversized)]
    if big:
        return Rejection("too_large", name, location, f"{', '.join(big)} over the limit of {MAX_MEMBER_BYTES >> 20} MiB per member", key)
    image_exts = sorted((e for e in parts if e.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS), key=_natural)
    images = [parts[e] for e in image_exts]
    video_exts = sorted((e for e in parts if e.rsplit(".", 1)[-1] in VIDEO_EXTENSIONS), key=_natural)
    videos = [parts[e] for e in video_exts]
    audio_exts = sorted((e for e in parts if e.rsplit(".", 1)[-1] in AUDIO_EXTENSIONS), key=_natural)
    audios = [parts[e] for e in audio_exts]
    meta: dict[str, Any] = {}
    sid = key
    try:
        record: dict[str, Any] | None = None
        if "json" in parts:
            decoded = decode_record(parts["json"])
            if isinstance(decoded, JsonParseError):
                if decoded.reason != "parse_error":
                    return Rejection(decoded.reason, name, location, f"{key}.json: {decoded.message}", sid)
                raise RecordError(f"{key}.json is not valid JSON: {decoded.message}")
            record = decoded.value
            if not isinstance(record, dict):
                raise RecordError(f"{key}.json must hold an object")
            meta = extract_meta(record)
            if record.get("id") not in (None, ""):
                sid = str(record["id"])
        answer = parts["txt"].decode("utf-8", errors="replace") if "txt" in parts else None
        if record is not None and ("messages" in record or "conversations" in record):
            turns = turns_of(record, ("messages", "conversations"))
            if isinstance(record.get("system"), str) and record["system"].strip():
                turns.insert(0, ("system", record["system"]))
        elif record is not None and "question" in record:
            if answer is None:
                answer = record.get("answer") or (record.get("answers") or [None])[0]
            if answer is not None and "answers" not in meta:
                meta["answers"] = [answer]
            question = record["question"]
            if isinstance(question, str) and not question.strip() and (images or videos or audios):
                question = media_parts(images, videos, audios)  # no question: the media alone ask, as in a caption
            turns = [("user", question), ("assistant", answer)]
        elif answer is not None and (images or videos or audios):
            # A caption (or transcript) sample: the media alone are the user turn.
            turns = [("user", media_parts(images, videos, audios)), ("assistant", answer)]
        else:
            raise RecordError(f"sample {key} has no .json with messages/question and no .txt caption (parts: {', '.join(sorted(parts))})")
    except RecordError as exc:
        return Rejection("parse_error", name, location, str(exc), sid)
    return build_sample(turns, images=images, videos=videos, audios=audios, id=sid, source=name, location=location, meta=meta)


def media_parts(images, videos, audios) -> list[dict[str, str]]:
    """Content parts for a user turn made of a sample's media alone: one `{"type": ...}` per image, video, audio."""
    return [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos] + [{"type": "audio"} for _ in audios]


def read_webdataset(source: DataSource, *, media_roots: Iterable[Path | str] = ()) -> Iterator[Sample | Rejection]:
    """Stream unchecked samples from WebDataset tar shards (their images are embedded: `media_roots` is unused)."""
    name = source_name(source)
    for file in expand_paths(source.path, TAR_SUFFIXES):
        for item in iter_tar_groups(file):
            if isinstance(item, str):
                yield Rejection("parse_error", name, display(file), item)
                break
            key, parts = item
            yield group_to_sample(key, parts, name=name, location=f"{display(file)}:{key}")
