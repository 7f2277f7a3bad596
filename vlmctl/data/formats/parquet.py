"""`parquet`: Parquet or Arrow files, or a `datasets.save_to_disk` folder, with images embedded as bytes.

Rows are read in record batches (pyarrow `iter_batches` / Arrow IPC streams over a memory map), never whole
files. Logical columns and their default physical names (override with the source's `columns:` mapping, e.g.
`columns: {images: image, question: query}`):

| logical | default column(s) | content |
|---|---|---|
| `images` | `images`, `image` | a list of (or one) `{bytes, path}` struct, raw bytes or a path string |
| `videos` | `videos`, `video` | the same for video files (vlmctl's prepared shards: stored clips, see docs/formats.md) |
| `audios` | `audios`, `audio` | the same for audio files: `datasets`' `Audio` feature is a `{bytes, path}` struct (prepared shards: 16-bit mono FLAC) |
| `texts` | `texts` | the_cauldron layout: `[{user, assistant}]`, one entry per turn pair |
| `messages` | `messages`, `conversations` | role/content or from/value turns; content parts may reference images |
| `question`, `answer` | `question`, `answer` | single-turn VQA; `answer` alone next to media: a caption or transcript (the media are the user turn) |
| `answers`, `options`, `question_type` | same names (`choices` for options) | eval references, stored in `meta` |
| `system` | `system` | optional system prompt |
| `meta` | `meta` | a JSON object (or its JSON text) merged into `meta` |
| `id` | `id` | sample id (default: `{source}-{row}`) |
| `prompt`, `chosen`, `rejected`, `rejected_response` | same names | preference pairs: TRL's columns (`prompt` + `chosen` + `rejected`), LLaMA-Factory's or ms-swift's next to `messages`, or vlmctl's prepared pairs (`messages` + a `rejected` message); read as `vlmctl.data.formats.preference` reads them |

One of `messages`, `texts`, `question` or `chosen` must exist. vlmctl's own prepared shards use the `messages` + `images`
(+ `videos`, `audios`) layout, so a prepared folder reads back with this reader. A speech-recognition table (an
`audio` column, and the transcript as `answer` next to a `question` prompt) reads as one audio question each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import Rejection, RecordError, build_sample
from vlmctl.data.formats._json import check_regular, open_regular
from vlmctl.data.formats._common import as_list, display, expand_paths, image_ref, source_name, turns_of
from vlmctl.data.formats._common import media_roots as source_media_roots
from vlmctl.data.images import MediaRoots, MissingRef
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

# pyarrow is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Light vlmctl modules are imported next to their use as well.

LOGICAL = ("id", "images", "videos", "audios", "texts", "messages", "question", "answer", "answers", "options", "question_type", "system", "meta",
           "prompt", "chosen", "rejected", "rejected_response")
PREFERENCE = ("prompt", "chosen", "rejected", "rejected_response")
ALTERNATIVES = {"images": ("images", "image"), "videos": ("videos", "video"), "audios": ("audios", "audio"), "messages": ("messages", "conversations"), "options": ("options", "choices")}
BATCH_ROWS = 64


def resolve_columns(available: list[str], mapping: dict[str, str] | None, where: str) -> dict[str, str]:
    """Map logical column names to physical ones. Raises DataError naming the missing column and the choices."""
    mapping = dict(mapping or {})
    unknown = sorted(set(mapping) - set(LOGICAL))
    if unknown:
        raise DataError(
            f"unknown logical column(s) {', '.join(unknown)} in columns: of {where}",
            hint=f"valid logical names: {', '.join(LOGICAL)}",
        )
    cols: dict[str, str] = {}
    for logical in LOGICAL:
        if logical in mapping:
            if mapping[logical] not in available:
                raise DataError(
                    f"column {mapping[logical]!r} (columns.{logical}) is not in {where}",
                    hint=f"the available columns are: {', '.join(available)}",
                )
            cols[logical] = mapping[logical]
            continue
        for candidate in ALTERNATIVES.get(logical, (logical,)):
            if candidate in available:
                cols[logical] = candidate
                break
    captions = "answer" in cols and any(k in cols for k in ("images", "videos", "audios"))
    if not captions and not any(k in cols for k in ("messages", "texts", "question", "chosen")):
        raise DataError(
            f"{where} has no conversation column (looked for messages, conversations, texts, question; or answer next to a media column)",
            hint=f"map yours with columns:, e.g. columns: {{question: <col>, answer: <col>, images: <col>}} or, for speech "
            f"recognition, {{audios: audio, answer: text}}; available: {', '.join(available)}",
        )
    return cols


def row_to_sample(row: dict[str, Any], cols: dict[str, str], *, name: str, location: str, index: int, base: Path | MediaRoots,
                  scalar: frozenset[str] = frozenset()) -> Sample | Rejection:
    """One table row -> an unchecked Sample (or a parse_error Rejection). Image paths resolve against `base` (and
    are confined to its folders when it is a MediaRoots). `scalar`: the table columns that hold one medium per row
    (not a list), where a null is a missing medium."""
    rid = row.get(cols["id"]) if "id" in cols else None
    sid = str(rid) if rid not in (None, "") else f"{name}-{index:06d}"
    meta: dict[str, Any] = {}
    try:
        images, videos, audios = (_media(row, cols, key, base, scalar) for key in ("images", "videos", "audios"))
        for key in ("answers", "options", "question_type"):
            if key in cols and row.get(cols[key]) is not None:
                meta[key] = row[cols[key]]
        if "meta" in cols and row.get(cols["meta"]):  # vlmctl's prepared shards keep meta as a JSON string
            value = row[cols["meta"]]
            meta.update(json.loads(value) if isinstance(value, str) else dict(value))
        if isinstance(meta.get("answers"), str):
            meta["answers"] = [meta["answers"]]
        if any(row.get(cols[k]) is not None for k in PREFERENCE if k in cols):
            return _preference_row(row, cols, images, videos, audios, sid=sid, name=name, location=location, meta=meta)
        turns: list[tuple[Any, Any]]
        if "messages" in cols and row.get(cols["messages"]) is not None:
            value = row[cols["messages"]]
            if isinstance(value, str):  # a JSON-encoded column
                value = json.loads(value)
            turns = turns_of({"messages": value}, ("messages",))
        elif "texts" in cols and row.get(cols["texts"]) is not None:
            turns = []
            for i, pair in enumerate(as_list(row[cols["texts"]])):
                if not isinstance(pair, dict) or "user" not in pair or "assistant" not in pair:
                    raise RecordError(f"texts[{i}] must be an object with user and assistant")
                turns += [("user", pair["user"]), ("assistant", pair["assistant"])]
        elif "question" in cols and row.get(cols["question"]) is not None:
            answer = row.get(cols["answer"]) if "answer" in cols else None
            if answer is None and meta.get("answers"):
                answer = meta["answers"][0]
            if answer is not None and "answers" not in meta:
                meta["answers"] = [answer]
            turns = [("user", row[cols["question"]]), ("assistant", answer)]
        elif "answer" in cols and row.get(cols["answer"]) is not None and (images or videos or audios):
            # a caption or transcript: the media alone are the user turn
            media = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos] + [{"type": "audio"} for _ in audios]
            turns = [("user", media), ("assistant", row[cols["answer"]])]
            meta.setdefault("answers", [row[cols["answer"]]])
        else:
            raise RecordError("the conversation column is empty in this row")
        if "system" in cols and isinstance(row.get(cols["system"]), str) and row[cols["system"]].strip():
            turns.insert(0, ("system", row[cols["system"]]))
    except (RecordError, json.JSONDecodeError, TypeError, ValueError) as exc:
        return Rejection("parse_error", name, location, str(exc), sid)
    return build_sample(turns, images=images, videos=videos, audios=audios, id=sid, source=name, location=location, meta=meta)


def _preference_row(row: dict[str, Any], cols: dict[str, str], images, videos, audios, *, sid: str, name: str, location: str,
                    meta: dict[str, Any]) -> Sample | Rejection:
    """A preference pair from a row with preference columns (see the module docstring). Raises RecordError,
    json.JSONDecodeError or TypeError for a row that does not fit (reported as parse_error by the caller)."""
    from vlmctl.data.checks import build_preference_sample
    from vlmctl.data.formats.preference import split_record

    record = {k: row[cols[k]] for k in (*PREFERENCE, "messages") if k in cols and row.get(cols[k]) is not None}
    if isinstance(record.get("messages"), str):  # a JSON-encoded column
        record["messages"] = json.loads(record["messages"])
    rejected = record.get("rejected")
    if isinstance(rejected, dict) and "role" in rejected and "chosen" not in record and "messages" in record:
        # vlmctl's prepared pairs: the chosen answer ends `messages`, the rejected one is a message of its own
        record = {"messages": record["messages"], "rejected_response": rejected.get("content")}
    prompt, chosen, rejected, keys = split_record(record)
    if "system" in cols and isinstance(row.get(cols["system"]), str) and row[cols["system"]].strip():
        prompt.insert(0, ("system", row[cols["system"]]))
    return build_preference_sample(prompt, chosen, rejected, keys=keys, images=images, videos=videos, audios=audios, id=sid,
                                   source=name, location=location, meta=meta)


def _media(row: dict[str, Any], cols: dict[str, str], key: str, base: Path | MediaRoots, scalar: frozenset[str]) -> list[Any]:
    """The media references of column `key` ("images", "videos", "audios"). A null in a column of one medium per row
    (`scalar`), or a null element of a list, is a MissingRef (rejected as missing_<kind>), never dropped; a null
    list is no media (a text-only row)."""
    if key not in cols:
        return []
    value = row.get(cols[key])
    what = f"the {cols[key]} column is null in this row"
    if value is None:
        return [MissingRef("null", what)] if cols[key] in scalar else []
    return [MissingRef("null", what) if v is None else image_ref(v, base) for v in as_list(value)]


def _json_object(path: Path, hint: str) -> dict[str, Any]:
    """The JSON object in `path`; DataError naming the file when it is missing, unreadable or not an object."""
    try:
        with open_regular(path) as f:
            value = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path} is missing: the save_to_disk folder is incomplete", hint=hint) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"{path} is not valid JSON ({exc})", hint=hint) from None
    if not isinstance(value, dict):
        raise DataError(f"{path} must hold a JSON object, not {type(value).__name__}", hint=hint)
    return value


def _arrow_files(path: Path, split: str) -> list[Path]:
    """The data files of a `save_to_disk` folder (a Dataset, or the `split` of a DatasetDict), in order. Raises
    DataError naming the file for a missing split, a malformed `dataset_dict.json` / `state.json`, or a data file
    that leaves the folder."""
    hint = "save the dataset again with `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or set data.sources[].split"
    if (path / "dataset_dict.json").is_file():
        splits = _json_object(path / "dataset_dict.json", hint).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DataError(f"{path / 'dataset_dict.json'}: `splits` must be a list of split names", hint=hint)
        if split not in splits:
            raise DataError(f"{path} is a DatasetDict without split {split!r} (splits: {', '.join(splits)})", hint="set data.sources[].split")
        path = path / split
    state = _json_object(path / "state.json", hint)
    files = state.get("_data_files", [])
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
        raise DataError(f"{path / 'state.json'}: `_data_files` must be a list of {{filename}} objects", hint=hint)
    out = []
    for f in files:
        name = f["filename"]
        if "/" in name or "\\" in name or name in ("", ".", "..") or "\0" in name:
            raise DataError(f"{path / 'state.json'} names the data file {name!r}, which is not a file name inside {path}", hint=hint)
        out.append(path / name)
    return out


def _batches(file: Path) -> Iterator[list[dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_regular(file)  # a FIFO would block the reader
    if file.suffix == ".parquet":
        pf = pq.ParquetFile(file)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS):
            yield batch.schema, batch.to_pylist()
        return
    source = pa.memory_map(str(file))
    try:
        reader = pa.ipc.open_stream(source)  # datasets writes the streaming format
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield from _slices(reader.get_batch(i))
        return
    for batch in reader:
        yield from _slices(batch)


def _slices(batch) -> Iterator[tuple[Any, list[dict[str, Any]]]]:
    for start in range(0, batch.num_rows, BATCH_ROWS):
        yield batch.schema, batch.slice(start, BATCH_ROWS).to_pylist()


def read_parquet(source: DataSource, *, media_roots: Iterable[Path | str] = ()) -> Iterator[Sample | Rejection]:
    """Stream unchecked samples from Parquet/Arrow files or a save_to_disk folder. Image paths must resolve inside
    the source's folder, its `image_root` or one of `media_roots` (else outside_root)."""
    import pyarrow as pa

    name = source_name(source)
    root = Path(source.path)
    if root.is_dir() and ((root / "state.json").is_file() or (root / "dataset_dict.json").is_file()):
        files = _arrow_files(root, source.split)
    else:
        files = expand_paths(source.path, (".parquet", ".arrow"))
    index = 0
    for file in files:
        base = source_media_roots(source, file, media_roots)
        try:
            cols = None
            row_no = 0
            for schema, rows in _batches(file):
                if cols is None and rows:
                    cols = resolve_columns(list(rows[0]), source.columns, display(file))
                    scalar = frozenset(f.name for f in schema if not pa.types.is_list(f.type) and not pa.types.is_large_list(f.type))
                for row in rows:
                    yield row_to_sample(row, cols, name=name, location=f"{display(file)}#{row_no}", index=index, base=base, scalar=scalar)
                    row_no += 1
                    index += 1
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
            # A damaged file cannot be resumed inside; report it once and go on with the next file.
            yield Rejection("parse_error", name, f"{display(file)}#{row_no}", f"unreadable file: {exc}")
