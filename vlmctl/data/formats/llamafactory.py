"""`llamafactory`: a data set registered in LLaMA-Factory's `dataset_info.json` (hiyouga/LLaMA-Factory,
`data/README.md`), read through its entry as LLaMA-Factory reads it::

    data:
      sources:
        - {path: data/dataset_info.json, dataset: mllm_demo}      # format: llamafactory (detected from the name)

An entry names its file (`file_name`, relative to the folder of dataset_info.json), its `formatting` (`sharegpt`, the
default, or `alpaca`), the record keys of each field (`columns`) and, for sharegpt, the spelling of roles and turns
(`tags`). The defaults are LLaMA-Factory's (`data/README.md`):

- sharegpt: columns messages=`conversations`, system, images, videos, audios; tags role_tag=`from`,
  content_tag=`value`, user_tag=`human`, assistant_tag=`gpt`, observation_tag=`observation`,
  function_tag=`function_call`, system_tag=`system`;
- alpaca: columns prompt=`instruction`, query=`input`, response=`output`, system, history, images, videos, audios;
  a turn's user text is the prompt, then a newline and the query when there is one; `history` holds earlier
  [user, assistant] pairs.

An entry with `"ranking": true` holds preference pairs (LLaMA-Factory's `dpo_en_demo`): its columns also name the
`chosen` and `rejected` answers (defaults `chosen`, `rejected`); with sharegpt formatting each is a turn
(`{"from": "gpt", "value": ...}`, spelled by the entry's tags), with alpaca a string. They are read as the
`preference` format reads pairs (`vlmctl.data.formats.preference`).

A dataset_info.json comes with a downloaded data set and is not trusted: `file_name` is joined to the data set's
folder as LLaMA-Factory joins it (not a glob), and it (and each file under it, symlinks resolved) must lie inside
that folder, the source's `image_root` or `data.media_roots`; an entry with a key of the wrong type, a pattern or a
path outside is refused with `EntryError` and its reason. Media paths resolve against the folder of
dataset_info.json (LLaMA-Factory's `media_dir` default), or `image_root`, and must lie inside the same folders. Tool turns (observation, function_call) are not supported: such a record is a parse_error naming the
role.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import RecordError, Rejection
from vlmctl.data.formats._common import GLOB_CHARS, expand_paths, read_conversation_json, source_name
from vlmctl.data.formats.preference import read_preference
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

INFO_FILE = "dataset_info.json"
JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")  # the files of a folder file_name that are read
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None, "images": None, "videos": None, "audios": None}
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": None, "history": None,
                  "images": None, "videos": None, "audios": None}
TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
        "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}


class EntryError(DataError):
    """A dataset_info.json entry that cannot be read safely; `reason` is one of `bad_entry` (a key of the wrong
    type), `no_file_name`, `glob` (file_name is a pattern), `outside_root` (file_name, or a file under it, resolves
    outside the data set's folder and the configured roots) and `missing_file`."""

    def __init__(self, info_file: Path, dataset: str, reason: str, detail: str, hint: str):
        super().__init__(f"{info_file}: data set {dataset!r}: {detail} ({reason})", hint=hint)
        self.reason = reason


def dataset_entry(source: DataSource) -> tuple[dict[str, Any], Path]:
    """(the entry of `source.dataset` in the dataset_info.json at `source.path`, that file's folder). Raises
    DataError naming the file and the registered names when the name is missing or unknown or the file cannot be
    read, EntryError for an entry of a kind not read here (a Hub or script data set) or with a key of the wrong
    type (`check_entry`)."""
    info_file = Path(source.path)
    try:
        entries = json.loads(info_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not UTF-8 or not JSON
        detail = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise DataError(f"cannot read {info_file}: {detail}", hint="point data.sources[].path at LLaMA-Factory's dataset_info.json") from None
    names = ", ".join(sorted(entries)) if isinstance(entries, dict) else ""
    if source.dataset is None or not isinstance(entries, dict) or source.dataset not in entries:
        what = "names no data set" if source.dataset is None else f"has no data set {source.dataset!r}"
        raise DataError(f"data.sources[] with {info_file} {what}", hint=f"set data.sources[].dataset to one of: {names}")
    entry = entries[source.dataset]
    check_entry(entry, info_file, source.dataset)
    return entry, info_file.parent


_FIX_ENTRY = "fix the entry as LLaMA-Factory's data/README.md describes it"


def check_entry(entry: Any, info_file: Path, dataset: str) -> None:
    """Raise EntryError unless `entry` has the shape LLaMA-Factory reads (data/README.md): an object with a
    `file_name` string, `formatting` sharegpt or alpaca, `columns` and `tags` objects of strings, `ranking` a
    boolean. The entry comes with a downloaded data set: nothing in it is trusted."""
    def fail(reason: str, detail: str, hint: str = _FIX_ENTRY):
        raise EntryError(info_file, dataset, reason, detail, hint)

    if not isinstance(entry, dict):
        fail("bad_entry", f"the entry is {type(entry).__name__}, not an object")
    if not entry.get("file_name"):
        kind = next((k for k in ("hf_hub_url", "ms_hub_url", "script_url", "om_hub_url") if k in entry), None)
        fail("no_file_name", "the entry has no file_name" + (f" ({kind}: a Hub data set)" if kind else ""),
             "read Hub data sets with format: hf (data.sources[].path: the dataset id), or give the entry a file_name")
    if not isinstance(entry["file_name"], str):
        fail("bad_entry", f"file_name is {type(entry['file_name']).__name__}, not a file name")
    if entry.get("formatting", "sharegpt") not in ("sharegpt", "alpaca"):
        fail("bad_entry", f"formatting is {entry['formatting']!r}", "vlmctl reads LLaMA-Factory's sharegpt and alpaca formatting")
    for key in ("columns", "tags"):
        value = entry.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            fail("bad_entry", f"{key} is {type(value).__name__}, not an object")
        for name, spelled in value.items():
            if not (isinstance(spelled, str) or (key == "columns" and spelled is None)):
                fail("bad_entry", f"{key}.{name} is {type(spelled).__name__}, not a key name")
    if not isinstance(entry.get("ranking", False), bool):
        fail("bad_entry", f"ranking is {entry['ranking']!r}, not true or false")


def entry_path(entry: dict[str, Any], folder: Path, *, info_file: Path, dataset: str,
               roots: Iterable[Path | str] = ()) -> Path:
    """The real path (symlinks resolved) of the entry's `file_name`, a file or a folder relative to `folder` (the
    data set's folder) as LLaMA-Factory joins it (a name, never a glob; no `~`). It and, for a folder, every file under it must
    lie inside `folder` or one of `roots` (the source's `image_root`, `data.media_roots`): a downloaded data set
    names no file elsewhere on the machine. Raises EntryError (`glob`, `outside_root`, `missing_file`)."""
    name = entry["file_name"]
    allowed = [Path(os.path.realpath(folder)), *(Path(os.path.realpath(Path(r).expanduser())) for r in roots if r)]
    where = f"data set folder {allowed[0]}" + (f" or {', '.join(map(str, allowed[1:]))}" if allowed[1:] else "")
    hint = ("keep the data set's files in its folder, or add their folder to data.media_roots if you trust this "
            "dataset_info.json")
    path = Path(os.path.realpath(allowed[0] / name))

    def inside(p: Path) -> bool:
        return any(p == root or p.is_relative_to(root) for root in allowed)

    if not path.exists() and GLOB_CHARS & set(name):
        raise EntryError(info_file, dataset, "glob", f"file_name {name!r} is a pattern; LLaMA-Factory names one file or folder",
                         "name the file (or a folder of files) in file_name")
    if Path(name).is_absolute() or not inside(path):
        raise EntryError(info_file, dataset, "outside_root", f"file_name {name!r} resolves to {path}, outside the {where}", hint)
    if not path.exists():
        raise EntryError(info_file, dataset, "missing_file", f"file_name {name!r}: {path} does not exist",
                         f"put the data set's file next to {info_file.name}, or fix file_name")
    if path.is_dir():
        for file in expand_paths(glob.escape(str(path)), JSON_SUFFIXES):
            real = Path(os.path.realpath(file))
            if not inside(real):
                raise EntryError(info_file, dataset, "outside_root",
                                 f"{file} (under file_name {name!r}) resolves to {real}, outside the {where}", hint)
    return path


def to_messages(record: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """One record of the entry's file as a canonical ShareGPT record {messages: [{role, content}], system, images,
    videos, audios}, through the entry's `formatting`, `columns` and `tags`. Raises RecordError for a record that
    does not fit them (naming the key)."""
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, not {type(record).__name__}")
    alpaca = entry.get("formatting", "sharegpt") == "alpaca"
    columns = {**(ALPACA_COLUMNS if alpaca else SHAREGPT_COLUMNS), **(entry.get("columns") or {})}
    out = {key: record.get(columns[key]) for key in ("system", "images", "videos", "audios") if columns.get(key)}
    out["messages"] = _alpaca_turns(record, columns) if alpaca else _sharegpt_turns(record, columns, {**TAGS, **(entry.get("tags") or {})})
    return out


def _sharegpt_turns(record: dict[str, Any], columns: dict[str, Any], tags: dict[str, str]) -> list[dict[str, Any]]:
    turns = record.get(columns["messages"])
    if not isinstance(turns, list):
        raise RecordError(f"{columns['messages']} (columns.messages) must be a list of turns")
    roles = {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["system_tag"]: "system"}
    out = []
    for i, turn in enumerate(turns):
        role = turn.get(tags["role_tag"]) if isinstance(turn, dict) else None
        if role not in roles:
            raise RecordError(f"{columns['messages']}[{i}] has role {role!r} ({tags['role_tag']}), not one of the entry's "
                              f"tags {', '.join(repr(r) for r in roles)}")
        out.append({"role": roles[role], "content": turn.get(tags["content_tag"])})
    return out


def _alpaca_turns(record: dict[str, Any], columns: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for pair in (record.get(columns["history"]) or []) if columns.get("history") else []:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise RecordError(f"{columns['history']} (columns.history) must hold [user, assistant] pairs")
        out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt, query = record.get(columns["prompt"]), record.get(columns["query"]) if columns.get("query") else None
    if not isinstance(prompt, str):
        raise RecordError(f"{columns['prompt']} (columns.prompt) must be text")
    user = f"{prompt}\n{query}" if isinstance(query, str) and query else prompt
    return out + [{"role": "user", "content": user}, {"role": "assistant", "content": record.get(columns["response"])}]


def to_preference(record: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """One record of a `ranking` entry's file as a preference record of the LLaMA-Factory layout of
    `vlmctl.data.formats.preference` ({conversations, chosen, rejected, system, images, videos, audios}): the prompt
    turns through `to_messages`, the answers through the entry's `chosen` / `rejected` columns and tags. Raises
    RecordError for a record that does not fit them."""
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, not {type(record).__name__}")
    alpaca = entry.get("formatting", "sharegpt") == "alpaca"
    columns = {"chosen": "chosen", "rejected": "rejected", **(entry.get("columns") or {})}
    tags = {**TAGS, **(entry.get("tags") or {})}
    if alpaca:  # the prompt is instruction + input; to_messages wants a response: give it the chosen one
        record = {**record, (entry.get("columns") or {}).get("response", "output"): ""}
    out = to_messages(record, entry)
    turns = out.pop("messages")
    if alpaca:
        turns = turns[:-1]
    answers = {}
    for key in ("chosen", "rejected"):
        value = record.get(columns[key])
        if isinstance(value, dict) and not alpaca:
            if value.get(tags["role_tag"]) != tags["assistant_tag"]:
                raise RecordError(f"{columns[key]} (columns.{key}) has role {value.get(tags['role_tag'])!r} "
                                  f"({tags['role_tag']}), not the entry's assistant tag {tags['assistant_tag']!r}")
            value = value.get(tags["content_tag"])
        answers[key] = value
    return {**out, "conversations": turns, **answers}


def read_llamafactory(source: DataSource, *, media_roots: Iterable[Path | str] = ()) -> Iterator[Sample | Rejection]:
    """Stream unchecked samples and parse errors of the data set `source.dataset` of a dataset_info.json
    (preference pairs for an entry with `"ranking": true`)."""
    media_roots = tuple(media_roots)
    entry, folder = dataset_entry(source)
    path = entry_path(entry, folder, info_file=Path(source.path), dataset=source.dataset or "",
                      roots=[source.image_root, *media_roots])
    # the real path, its glob characters escaped (a name, not a pattern): the media roots are the data set's folder,
    # the file's own folder, image_root and media_roots, never wider
    inner = source.model_copy(update={"path": glob.escape(str(path)), "name": source_name(source),
                                      "image_root": source.image_root or Path(os.path.realpath(folder))})
    if entry.get("ranking"):
        return read_preference(inner, media_roots=media_roots, transform=lambda record: to_preference(record, entry))
    return read_conversation_json(inner, turn_keys=("messages",), image_keys=("images",), video_keys=("videos",),
                                  audio_keys=("audios",), system_key="system", extra_roots=media_roots,
                                  transform=lambda record: to_messages(record, entry))
