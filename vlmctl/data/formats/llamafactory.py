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

Media paths resolve against the folder of dataset_info.json (LLaMA-Factory's `media_dir` default), or
`image_root`. Tool turns (observation, function_call) are not supported: such a record is a parse_error naming the
role.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import RecordError, Rejection
from vlmctl.data.formats._common import read_conversation_json, source_name
from vlmctl.data.formats.preference import read_preference
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

INFO_FILE = "dataset_info.json"
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None, "images": None, "videos": None, "audios": None}
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": None, "history": None,
                  "images": None, "videos": None, "audios": None}
TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
        "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}


def dataset_entry(source: DataSource) -> tuple[dict[str, Any], Path]:
    """(the entry of `source.dataset` in the dataset_info.json at `source.path`, that file's folder). Raises
    DataError naming the file and the registered names when the name is missing or unknown, the file cannot be
    read, or the entry is of a kind not read here (a Hub or script data set)."""
    info_file = Path(source.path)
    try:
        entries = json.loads(info_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {info_file}: {exc}", hint="point data.sources[].path at LLaMA-Factory's dataset_info.json") from exc
    names = ", ".join(sorted(entries)) if isinstance(entries, dict) else ""
    if source.dataset is None or not isinstance(entries, dict) or source.dataset not in entries:
        what = "names no data set" if source.dataset is None else f"has no data set {source.dataset!r}"
        raise DataError(f"data.sources[] with {info_file} {what}", hint=f"set data.sources[].dataset to one of: {names}")
    entry = entries[source.dataset]
    if not isinstance(entry, dict) or not entry.get("file_name"):
        kind = next((k for k in ("hf_hub_url", "ms_hub_url", "script_url", "om_hub_url") if isinstance(entry, dict) and k in entry), None)
        raise DataError(f"{info_file}: data set {source.dataset!r} has no file_name" + (f" ({kind}: a Hub data set)" if kind else ""),
                        hint="read Hub data sets with format: hf (data.sources[].path: the dataset id), or give the entry a file_name")
    if entry.get("formatting", "sharegpt") not in ("sharegpt", "alpaca"):
        raise DataError(f"{info_file}: data set {source.dataset!r} has formatting {entry['formatting']!r}",
                        hint="vlmctl reads LLaMA-Factory's sharegpt and alpaca formatting")
    return entry, info_file.parent


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
    entry, folder = dataset_entry(source)
    inner = source.model_copy(update={"path": str(folder / entry["file_name"]), "name": source_name(source),
                                      "image_root": source.image_root or folder})
    if entry.get("ranking"):
        return read_preference(inner, media_roots=media_roots, transform=lambda record: to_preference(record, entry))
    return read_conversation_json(inner, turn_keys=("messages",), image_keys=("images",), video_keys=("videos",),
                                  audio_keys=("audios",), system_key="system", extra_roots=media_roots,
                                  transform=lambda record: to_messages(record, entry))
