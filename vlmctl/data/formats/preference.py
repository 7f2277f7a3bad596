"""`preference`: preference pairs (a prompt, a chosen and a rejected answer) in the three layouts users have, told
apart record by record:

- LLaMA-Factory's ShareGPT preference samples (hiyouga/LLaMA-Factory `data/README.md`, `dpo_en_demo.json`; a
  dataset_info.json entry with `"ranking": true`): the prompt turns in `conversations` (or `messages`), the answers
  as turns of their own::

    {"conversations": [{"from": "human", "value": "<image>What is in the picture?"}],
     "chosen": {"from": "gpt", "value": "A cat."}, "rejected": {"from": "gpt", "value": "A dog."},
     "images": ["images/1.jpg"]}

- TRL's conversational preference columns (huggingface/trl docs, "Dataset formats": preference, explicit prompt),
  or the implicit-prompt form where `chosen` and `rejected` are whole conversations sharing their first turns::

    {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}],
     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}],
     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "A dog."}]}],
     "images": ["images/1.jpg"]}

  (`prompt`, `chosen` and `rejected` may also be plain strings: TRL's standard preference format);

- ms-swift's RLHF layout (modelscope/ms-swift docs, "Custom dataset"): the chosen answer is the last turn of
  `messages`, the rejected one is `rejected_response`; `rejected_messages` (ms-swift >= 3.8) is read when its turns
  before the answer are those of `messages` and `rejected_images` (if any) are the same as `images`::

    {"messages": [{"role": "user", "content": "<image>What is in the picture?"}, {"role": "assistant", "content": "A cat."}],
     "rejected_response": "A dog.", "images": ["images/1.jpg"]}

Media (`images`, `videos`, `audios`, as in SFT data) belong to the prompt and are shared by both answers. A record
of none of these layouts is a parse_error naming the keys it has. See `vlmctl.data.checks.build_preference_sample`
for the reason codes (missing_response, same_response, placeholder_mismatch, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import RecordError, Rejection, build_preference_sample
from vlmctl.data.formats._common import _listed, extract_meta, json_records, part_ref, source_name, turns_of
from vlmctl.data.sample import Sample

LAYOUTS = ("llamafactory", "trl", "swift")


def layout_of(record: Any) -> str | None:
    """Which preference layout a record is in (`LAYOUTS`), or None when it is not a preference record."""
    if not isinstance(record, dict):
        return None
    if "rejected_response" in record or "rejected_messages" in record:
        return "swift"
    if "chosen" in record or "rejected" in record:
        if "prompt" in record:
            return "trl"
        if "conversations" in record or "messages" in record:
            return "llamafactory"
        return "trl"  # implicit prompt: chosen and rejected are whole conversations
    return None


def split_record(record: dict[str, Any]) -> tuple[list[tuple[Any, Any]], Any, Any, tuple[str, str]]:
    """(prompt turns as (role, content) pairs, chosen content, rejected content, the keys of the two answers) of a
    record in one of `LAYOUTS`. An answer the record lacks is None (reported as missing_response). Raises
    RecordError for a record that is in none of them or whose parts do not fit."""
    layout = layout_of(record)
    if layout == "swift":
        turns = turns_of(record, ("messages",))
        chosen = _last_assistant(turns, "messages")
        prompt = turns[:-1] if chosen is not None else turns
        if "rejected_messages" in record and "rejected_response" not in record:
            rejected_turns = turns_of(record, ("rejected_messages",))
            if [t for t in rejected_turns[:-1]] != prompt:
                raise RecordError("rejected_messages must repeat the turns of messages before the answer "
                                  "(a rejected answer to another prompt is not a pair)")
            rejected = _last_assistant(rejected_turns, "rejected_messages")
            if record.get("rejected_images") not in (None, record.get("images")):
                raise RecordError("rejected_images differ from images: both answers must answer the same images")
            return prompt, chosen, rejected, ("messages[-1]", "rejected_messages[-1]")
        return prompt, chosen, record.get("rejected_response"), ("messages[-1]", "rejected_response")
    if layout == "llamafactory":
        turns = turns_of(record, ("conversations", "messages"))
        return turns, _answer(record.get("chosen"), "chosen"), _answer(record.get("rejected"), "rejected"), ("chosen", "rejected")
    if layout == "trl":
        prompt_value = record.get("prompt")
        chosen, rejected = record.get("chosen"), record.get("rejected")
        if prompt_value is None and isinstance(chosen, list) and isinstance(rejected, list):
            # implicit prompt: the turns before the last are the prompt, and must be the same in both
            c, r = turns_of(record, ("chosen",)), turns_of(record, ("rejected",))
            if c[:-1] != r[:-1]:
                raise RecordError("chosen and rejected (without prompt) must share every turn but their last answer")
            return c[:-1], _last_assistant(c, "chosen"), _last_assistant(r, "rejected"), ("chosen", "rejected")
        if isinstance(prompt_value, str):
            prompt = [("user", prompt_value)]
        elif isinstance(prompt_value, list):
            prompt = turns_of(record, ("prompt",))
        else:
            raise RecordError("prompt must be a string or a list of messages")
        return prompt, _answer(chosen, "chosen"), _answer(rejected, "rejected"), ("chosen", "rejected")
    raise RecordError(f"not a preference record: it has none of chosen/rejected (LLaMA-Factory, TRL) or rejected_response "
                      f"(ms-swift) (keys: {', '.join(sorted(record)) or 'none'})")


def _answer(value: Any, key: str) -> Any:
    """The content of an answer given as a string, a turn object ({from, value} / {role, content}), a list of
    content parts, or a list of one assistant message (TRL)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        if any(k in value for k in ("from", "role")):
            role = value.get("role", value.get("from"))
            if str(role).lower() not in ("assistant", "gpt", "model", "bot"):
                raise RecordError(f"{key} must be an assistant turn, not {role!r}")
            return value.get("content", value.get("value"))
        return [value]
    if isinstance(value, list):
        messages = [m for m in value if isinstance(m, dict) and any(k in m for k in ("from", "role"))]
        if not messages:
            return value  # content parts
        if len(value) != 1:
            raise RecordError(f"{key} must hold one assistant message (the answer), not {len(value)} messages")
        return _answer(value[0], key)
    raise RecordError(f"{key} must be a string, a turn or a list of messages, not {type(value).__name__}")


def _last_assistant(turns: list[tuple[Any, Any]], key: str) -> Any:
    """The content of the last turn when it is the assistant's; None when the conversation has no answer."""
    if not turns:
        return None
    role, content = turns[-1]
    if str(role).strip().lower() not in ("assistant", "gpt", "model", "bot"):
        return None
    return content


def read_preference(source: DataSource, *, media_roots: Iterable[Path | str] = (),
                    transform: Callable[[Any], Any] | None = None) -> Iterator[Sample | Rejection]:
    """Stream unchecked preference pairs and their rejections (parse_error, missing_response, same_response,
    bad_roles, empty_turn, placeholder_mismatch, invalid_text) of a JSON/JSONL source. `transform(record)` -> the
    record in one of `LAYOUTS` (e.g. a LLaMA-Factory entry's column mapping), raising RecordError when it does not
    fit."""
    name = source_name(source)
    for item in json_records(source, media_roots, transform):
        if isinstance(item, Rejection):
            yield item
            continue
        location, record, roots, sid = item
        try:
            prompt, chosen, rejected, keys = split_record(record)
            if isinstance(record.get("system"), str) and record["system"].strip():
                prompt.insert(0, ("system", record["system"]))
            images = _listed(record, ("images", "image"), roots)
            videos = _listed(record, ("videos", "video"), roots)
            audios = _listed(record, ("audios", "audio"), roots)
        except RecordError as exc:
            yield Rejection("parse_error", name, location, str(exc), sid)
            continue
        yield build_preference_sample(
            prompt, chosen, rejected, keys=keys, images=images, videos=videos, audios=audios, id=sid, source=name,
            location=location, meta=extract_meta(record), resolve_part=lambda part, roots=roots: part_ref(part, roots),
        )
