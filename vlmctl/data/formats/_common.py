"""Pieces shared by the readers: path expansion, locations, meta keys, and the conversation-JSON reader that the
llava, sharegpt and messages formats spell differently."""

from __future__ import annotations

import base64
import binascii
import functools
import glob
import io
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import MEDIA_KEYS, PART_TYPES, Rejection, RecordError, build_sample
from vlmctl.data.formats._json import JsonParseError, read_json
from vlmctl.data.images import MediaRoots, MissingRef, resolve_ref
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

# Record keys copied into Sample.meta (eval references). `choices` is stored as `options`.
META_KEYS = ("answers", "options", "choices", "question_type", "answer_type", "question_id", "category")
GLOB_CHARS = set("*?[")
_ESCAPED = re.compile(r"\[[*?[]\]")  # a glob character as `glob.escape` writes it: [*], [?], [[]


def literal_path(path: str | Path) -> Path | None:
    """The path a pattern names when every glob character in it is escaped (`glob.escape`), else None: such a
    pattern is a file or folder name holding `*`, `?` or `[`, not a glob."""
    text = str(path)
    if GLOB_CHARS & set(_ESCAPED.sub("", text)):
        return None
    return Path(_ESCAPED.sub(lambda m: m.group(0)[1], text))


def is_glob(path: str | Path) -> bool:
    """Whether `path` is a glob pattern: a glob character not escaped by `glob.escape`."""
    return bool(GLOB_CHARS & set(str(path))) and literal_path(path) is None


def printable(text: str) -> str:
    """`text` as valid Unicode: a byte of a file name that is not UTF-8 (Python's surrogate escape, e.g. `\\udcff`)
    is written as that escape, so names and locations can be stored in shards and reports."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def source_name(source: DataSource) -> str:
    """The name reports use for a source: `name`, else the file or folder name (the dataset id for hf)."""
    if source.name:
        return printable(source.name)
    if source.dataset:  # a LLaMA-Factory data set: its name in dataset_info.json
        return printable(source.dataset)
    if source.format == "hf":
        return printable(source.path)
    p = Path(source.path.rstrip("/"))
    # A glob's own name ("*.jsonl") says little: keep its folder in front.
    return printable(f"{p.parent.name}/{p.name}" if GLOB_CHARS & set(p.name) else p.name)


def expand_paths(path: str, suffixes: tuple[str, ...]) -> list[Path]:
    """Files of a source: the file itself, every file with one of `suffixes` under a folder (recursive, sorted),
    or the matches of a glob (sorted). Raises DataError when nothing matches."""
    p = Path(path).expanduser()
    if is_glob(p):
        files = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if not files:
            raise DataError(f"no files match {path}", hint="check data.sources[].path (globs like data/*.jsonl are allowed)")
        return files
    p = literal_path(p) or p
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.lower().endswith(suffixes) and not _hidden(f, p))
        if not files:
            raise DataError(f"folder {path} holds no {'/'.join(suffixes)} files", hint="point data.sources[].path at the data files")
        return files
    if not p.exists():
        raise DataError(f"data source {path} does not exist", hint="fix data.sources[].path (relative paths are relative to vlmctl.yaml)")
    if not p.is_file():  # a device, FIFO or socket would be read forever
        raise DataError(f"data source {path} is not a regular file", hint="point data.sources[].path at a data file or a folder of them")
    return [p]


def source_folder(source: DataSource) -> Path:
    """The folder a local source lives in: the folder itself, a glob's fixed leading folders, or a file's folder
    (a name whose glob characters are escaped, `literal_path`, is a name, not a glob)."""
    p = Path(source.path).expanduser()
    if is_glob(p):
        fixed = []
        for part in p.parts:
            if GLOB_CHARS & set(part):
                break
            fixed.append(part)
        return Path(*fixed) if fixed else Path.cwd()
    p = literal_path(p) or p
    return p if p.is_dir() else p.parent


def media_roots(source: DataSource, file: Path | None, extra: Iterable[Path | str] = ()) -> MediaRoots:
    """Where the media paths of `file` (a file of `source`; None for Hub sources) resolve from and may resolve into:
    relative paths resolve against `image_root`, else the file's folder (the working directory for Hub sources);
    they must land inside the source's folder, the file's folder, `image_root` or one of `extra`
    (`data.media_roots`)."""
    if file is None:
        base = Path(source.image_root) if source.image_root else Path.cwd()
        return MediaRoots.of(base, [base, *extra])
    base = Path(source.image_root) if source.image_root else file.parent
    return MediaRoots.of(base, [source_folder(source), file.parent, source.image_root, *extra])


def _hidden(f: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in f.relative_to(root).parts)


@functools.lru_cache(maxsize=4096)
def display(path: Path) -> str:
    """A path for locations: relative to the working directory when below it, else absolute."""
    try:
        return printable(os.path.relpath(path) if not os.path.relpath(path).startswith("..") else str(path))
    except ValueError:
        return printable(str(path))


def extract_meta(record: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key in META_KEYS:
        if record.get(key) is not None:
            meta["options" if key == "choices" else key] = record[key]
    if isinstance(record.get("meta"), dict):
        meta.update(record["meta"])
    return meta


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def image_ref(value: Any, base: Path | MediaRoots) -> Any:
    """A media reference (bytes, Path or MissingRef) from a path/URL string, raw bytes, a `{bytes, path}` dict
    (`datasets`' Image and Audio features undecoded), a `{url}` dict or OpenAI's `input_audio` object
    (`{"data": <base64>, "format": "wav"}`; invalid base64 gives empty bytes, reported by the check stage); paths
    are confined to `base` when it is a MediaRoots (see `images.resolve_ref`). Used for images, videos and audio
    alike. Raises RecordError for anything else."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        if not value.strip():
            return MissingRef(value, "empty image path")
        return resolve_ref(value.strip(), base)
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        if isinstance(value.get("data"), str):  # OpenAI input_audio: base64 without a data: URL header
            try:
                return base64.b64decode(value["data"], validate=False)
            except (binascii.Error, ValueError):
                return b""
        for key in ("url", "path", "image_url", "image", "video_url", "video", "audio_url", "audio"):
            if value.get(key):
                return image_ref(value[key], base)
        raise RecordError(f"media entry {sorted(value)} has no bytes, path or url")
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image (decoded datasets rows)
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    raise RecordError(f"image reference must be a path string, bytes or an object, not {type(value).__name__}")


def turns_of(record: dict[str, Any], keys: Iterable[str]) -> list[tuple[Any, Any]]:
    """(role, content) pairs from the first present key of `keys`; accepts role/content and from/value."""
    for key in keys:
        if key in record:
            raw = record[key]
            break
    else:
        raise RecordError(f"record has none of the keys {', '.join(keys)} (keys: {', '.join(sorted(record)) or 'none'})")
    if not isinstance(raw, list):
        raise RecordError(f"{key} must be a list of turns, not {type(raw).__name__}")
    turns = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise RecordError(f"{key}[{i}] must be an object with role/content or from/value")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if isinstance(content, str) or content is None or isinstance(content, (list, dict)):
            turns.append((role, content))
        else:
            raise RecordError(f"{key}[{i}] content must be a string or a list of parts, not {type(content).__name__}")
    return turns


PART_REF_KEYS = {"image": ("image", "image_url", "url", "path", "value", "bytes"),
                 "video": ("video", "video_url", "url", "path", "value", "bytes"),
                 "audio": ("audio", "input_audio", "audio_url", "url", "path", "value", "bytes")}
"""Keys holding the reference of an explicit media part, by modality (OpenAI `image_url`: a string or `{url}`;
OpenAI `input_audio`: `{data: <base64>, format}`; vLLM's `video_url` / `audio_url` likewise; transformers' chat
templates: `image` / `video` / `audio` / `url` / `path`)."""


def part_ref(part: dict[str, Any], base: Path | MediaRoots) -> Any:
    """The media reference of an explicit image, video or audio part (`checks.PART_TYPES`; keys `PART_REF_KEYS`),
    or None for a part without one."""
    marked = [m for m, keys in MEDIA_KEYS.items() if any(k in part for k in keys)]
    kind = PART_TYPES.get(part.get("type") or "", marked[0] if marked else "image")
    for key in PART_REF_KEYS[kind]:
        if part.get(key) is not None:
            return image_ref(part[key], base)
    return None  # a placeholder part: it takes the next part of its modality in the record's `images` / `videos`


def iter_json_source(source: DataSource, suffixes: tuple[str, ...] = (".json", ".jsonl", ".ndjson")) -> Iterator[tuple[Path, str, Any] | Rejection]:
    """(file, location, record) for every record of every file of a JSON/JSONL source; records that cannot be
    used as Rejections (parse_error, too_deep, too_large)."""
    name = source_name(source)
    for file in expand_paths(source.path, suffixes):
        try:
            for item in read_json(file):
                location = f"{display(file)}:{item.where}"
                if isinstance(item, JsonParseError):
                    yield Rejection(item.reason, name, location, item.message)
                else:
                    yield file, location, item.value
        except OSError as exc:
            raise DataError(f"cannot read {file}: {exc.strerror or exc}", hint="check the file's permissions") from None


def json_records(source: DataSource, extra_roots: Iterable[Path | str] = (),
                 transform: Any = None) -> Iterator[tuple[str, dict[str, Any], MediaRoots, str] | Rejection]:
    """The records of a JSON/JSONL source as (location, record, media roots of its file, sample id), each record
    passed through `transform` (-> the reader's keys, raising RecordError when it does not fit) and checked to be
    a JSON object; a record that is not, or that `transform` refuses, comes as a `parse_error` Rejection, as do the
    file's own parse errors. The sample id is the record's `id`, else `<source>-<n>` (n counts every record)."""
    name = source_name(source)
    count = 0
    roots_of: dict[Path, MediaRoots] = {}
    for item in iter_json_source(source):
        if isinstance(item, Rejection):
            yield item
            continue
        file, location, record = item
        roots = roots_of.get(file)
        if roots is None:
            roots = roots_of[file] = media_roots(source, file, extra_roots)
        rid = record.get("id") if isinstance(record, dict) else None
        sid = str(rid) if rid not in (None, "") else f"{name}-{count:06d}"
        count += 1
        try:
            if transform is not None:
                record = transform(record)
            if not isinstance(record, dict):
                raise RecordError(f"record must be a JSON object, not {type(record).__name__}")
        except RecordError as exc:
            yield Rejection("parse_error", name, location, str(exc), sid)
            continue
        yield location, record, roots, sid


def read_conversation_json(
    source: DataSource,
    *,
    turn_keys: tuple[str, ...],
    image_keys: tuple[str, ...],
    video_keys: tuple[str, ...] = ("videos", "video"),
    audio_keys: tuple[str, ...] = ("audios", "audio"),
    system_key: str | None = None,
    extra_roots: Iterable[Path | str] = (),
    image_placeholder_for_video: bool = False,
    transform: Any = None,
) -> Iterator[Sample | Rejection]:
    """Shared reader of the llava / sharegpt / messages layouts (they differ only in key spelling).
    `image_keys` / `video_keys` / `audio_keys`: the record keys listing its images / videos / audio clips (the first
    present one counts);
    `extra_roots`: more folders media paths may resolve into (`data.media_roots`);
    `image_placeholder_for_video`: see `checks.build_sample`; `transform(record)` -> the record in these keys
    (raising RecordError for one that does not fit), e.g. a LLaMA-Factory entry's column and tag mapping."""
    name = source_name(source)
    for item in json_records(source, extra_roots, transform):
        if isinstance(item, Rejection):
            yield item
            continue
        location, record, roots, sid = item
        try:
            turns = turns_of(record, turn_keys)
            if system_key and isinstance(record.get(system_key), str) and record[system_key].strip():
                turns.insert(0, ("system", record[system_key]))
            images = _listed(record, image_keys, roots)
            videos = _listed(record, video_keys, roots)
            audios = _listed(record, audio_keys, roots)
        except RecordError as exc:
            yield Rejection("parse_error", name, location, str(exc), sid)
            continue
        yield build_sample(
            turns,
            images=images,
            videos=videos,
            audios=audios,
            id=sid,
            source=name,
            location=location,
            meta=extract_meta(record),
            resolve_part=lambda part, roots=roots: part_ref(part, roots),
            image_placeholder_for_video=image_placeholder_for_video,
        )


def _listed(record: dict[str, Any], keys: tuple[str, ...], roots: MediaRoots) -> list[Any]:
    """References of the first of `keys` the record has (a list or a single value); [] when none."""
    for key in keys:
        if record.get(key) is not None:
            return [image_ref(v, roots) for v in as_list(record[key])]
    return []
