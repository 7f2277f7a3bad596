"""Readers for every input format, each turning one `DataSource` into canonical samples.

    for item in read_source(DataSource(path="data/train.jsonl")):
        if isinstance(item, Rejection):
            print(item.location, item.reason, item.detail)
        else:
            use(item)  # a Sample whose images are 8-bit RGB encoded bytes

Formats (see docs/formats.md): llava, sharegpt, messages, parquet, webdataset, hf, llamafactory (a data set of
LLaMA-Factory's dataset_info.json), preference (pairs: LLaMA-Factory's, TRL's or ms-swift's layout), and `auto`, which picks one
from the file extension and the first record (`detect_format`). Every reader streams: JSONL line by line, JSON
arrays element by element, Parquet/Arrow by record batch, tars member by member.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator

from vlmctl.config.data import DEFAULT_MAX_IMAGE_PIXELS, DataAudio, DataSource, DataVideo
from vlmctl.data.checks import Rejection, check_images
from vlmctl.data.formats._common import GLOB_CHARS, expand_paths
from vlmctl.data.formats._json import JsonParseError, iter_json_records
from vlmctl.data.formats.hf import read_hf
from vlmctl.data.formats.llamafactory import read_llamafactory
from vlmctl.data.formats.llava import read_llava
from vlmctl.data.formats.messages import read_messages
from vlmctl.data.formats.parquet import read_parquet
from vlmctl.data.formats.preference import layout_of, read_preference
from vlmctl.data.formats.sharegpt import read_sharegpt
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

# The webdataset reader (it loads numpy) is imported inside the function that uses it: reading other formats must not
# pay for it.

FORMATS = ("llava", "sharegpt", "messages", "parquet", "webdataset", "hf", "llamafactory", "preference")


def get_reader(fmt: str) -> Callable[..., Iterator[Sample | Rejection]]:
    """The reader function of a format name (not `auto`): `reader(source, *, media_roots=())`."""
    if fmt == "webdataset":
        from vlmctl.data.formats.webdataset import read_webdataset

        return read_webdataset
    readers = {"llava": read_llava, "sharegpt": read_sharegpt, "messages": read_messages, "parquet": read_parquet,
               "hf": read_hf, "llamafactory": read_llamafactory, "preference": read_preference}
    if fmt not in readers:
        raise DataError(f"unknown data format {fmt!r}", hint=f"use one of: auto, {', '.join(FORMATS)}")
    return readers[fmt]


def detect_format(path: str) -> str:
    """Pick a format for a local path from its extension, folder content, or (for JSON) its first record.

    Raises DataError when the path does not exist or the format cannot be told apart.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if any((p / n).is_file() for n in ("state.json", "dataset_dict.json")):
            return "parquet"
        for file in sorted(p.rglob("*")):
            name = file.name.lower()
            if any(part.startswith(".") for part in file.relative_to(p).parts):
                continue
            if name.endswith((".parquet", ".arrow")):
                return "parquet"
            if name.endswith((".tar", ".tgz", ".tar.gz")):
                return "webdataset"
        jsons = [f for f in sorted(p.rglob("*")) if f.name.lower().endswith((".json", ".jsonl")) and f.is_file()]
        if jsons:
            return _detect_json(jsons[0], path)
        raise DataError(f"cannot tell the format of folder {path}: no .parquet, .arrow, .tar or .json files", hint="set data.sources[].format")
    if not p.exists() and not GLOB_CHARS & set(str(p)):
        raise DataError(
            f"data source {path} does not exist",
            hint="fix the path (relative to vlmctl.yaml); for a Hub dataset id set `format: hf`",
        )
    if p.name == "dataset_info.json":  # LLaMA-Factory's registry of data sets (data.sources[].dataset names one)
        return "llamafactory"
    first = expand_paths(path, (".json", ".jsonl", ".ndjson", ".parquet", ".arrow", ".tar", ".tgz", ".tar.gz"))[0]
    name = first.name.lower()
    if name.endswith((".parquet", ".arrow")):
        return "parquet"
    if name.endswith((".tar", ".tgz", ".tar.gz")):
        return "webdataset"
    if name.endswith((".json", ".jsonl", ".ndjson")):
        return _detect_json(first, path)
    raise DataError(f"cannot tell the format of {first} from its extension", hint="set data.sources[].format")


def _detect_json(file: Path, path: str) -> str:
    for item in iter_json_records(file):
        if isinstance(item, JsonParseError):
            continue  # a bad first line is reported by the reader; look at the next record
        record = item[1]
        if not isinstance(record, dict):
            break
        if layout_of(record) is not None:
            return "preference"
        if "conversations" in record and not any(k in record for k in ("images", "videos", "audios")):
            return "llava"
        turns = record.get("messages", record.get("conversations"))
        if isinstance(turns, list):
            if any(isinstance(t, dict) and isinstance(t.get("content"), list) for t in turns):
                return "messages"
            return "sharegpt"
        raise DataError(
            f"cannot tell the format of {file}: its first record has keys {', '.join(sorted(record))}",
            hint="expected conversations (llava), messages + images, videos or audios (sharegpt), messages with content parts (messages), or chosen/rejected or rejected_response (preference); or set data.sources[].format",
        )
    raise DataError(f"cannot tell the format of {path}: no JSON object records found", hint="set data.sources[].format")


def resolve_format(source: DataSource) -> str:
    """The source's format, detected when `auto`."""
    return detect_format(source.path) if source.format == "auto" else source.format


def iter_unchecked(source: DataSource, *, media_roots: Iterable[Path | str] = ()) -> Iterator[Sample | Rejection]:
    """Parsed samples whose `images` are still references (bytes, Path or MissingRef), plus parse-time rejections
    (parse_error, too_deep, too_large, bad_roles, empty_turn, placeholder_mismatch). Honors `source.max_samples`.

    Image paths must resolve (symlinks included) inside the source's folder, its `image_root` or one of
    `media_roots`; the others become MissingRefs reported as outside_root by the check stage.
    """
    reader = get_reader(resolve_format(source))
    for n, item in enumerate(reader(source, media_roots=media_roots)):
        if source.max_samples is not None and n >= source.max_samples:
            return
        yield item


def read_source(
    source: DataSource,
    *,
    min_image_side: int = 28,
    check: bool = True,
    media_roots: Iterable[Path | str] = (),
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    video: DataVideo | None = None,
    audio: DataAudio | None = None,
) -> Iterator[Sample | Rejection]:
    """Stream the samples of one source as canonical Samples or reason-coded Rejections.

    With `check` (the default) every sample also passes the image checks (outside_root, missing_image,
    not_a_file, corrupt_image, image_too_large, image_too_small) and its images are normalized to 8-bit RGB
    encoded bytes; its videos pass the video checks (missing_video, corrupt_video, unsupported_codec,
    video_too_short, video_too_long) and become stored clips sampled by `video` (`data.video`; defaults when None);
    its audio clips pass the audio checks (missing_audio, corrupt_audio, unsupported_audio, audio_too_short,
    audio_too_long) and become 16-bit mono FLAC at `audio.sampling_rate` (`data.audio`; defaults when None).
    `media_roots`: folders besides the source's own that media paths may resolve into. Dedup,
    duplicate ids and too_long need the whole dataset or a processor and are applied by `prepare_data` /
    `validate_data`.
    Raises DataError when the source cannot be opened at all (missing path, unknown layout, Hub unreachable).
    """
    for item in iter_unchecked(source, media_roots=media_roots):
        if isinstance(item, Rejection) or not check:
            yield item
            continue
        out = check_images(item, min_image_side=min_image_side, max_image_pixels=max_image_pixels, video=video, audio=audio)
        yield out if isinstance(out, Rejection) else out[0]


__all__ = ["FORMATS", "Rejection", "detect_format", "get_reader", "iter_unchecked", "read_source", "resolve_format"]
