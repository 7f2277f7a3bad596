"""Preference pairs: LLaMA-Factory's, TRL's and ms-swift's layouts read into one canonical pair, each reason code,
storage in shards, and data.kind."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from vlmctl.config.data import DataSection, DataSource
from vlmctl.data.checks import Rejection, count_tokens, sample_digest
from vlmctl.data.formats import detect_format, read_source
from vlmctl.data.pipeline import too_long
from vlmctl.data.prepare import prepare_data
from vlmctl.data.sample import Sample, arrow_schema
from vlmctl.errors import DataError
from preference_data import LLAMAFACTORY, SWIFT, TRL, answers, png, write


def read(path: Path, **kw) -> list:
    return list(read_source(DataSource(path=str(path), **kw)))


def test_three_layouts_read_into_the_same_canonical_pair(tmp_path):
    lf = read(write(tmp_path / "lf" / "dpo.json", LLAMAFACTORY))
    trl = read(write(tmp_path / "trl" / "prefs.jsonl", TRL, jsonl=True))
    swift = read(write(tmp_path / "swift" / "rlhf.jsonl", SWIFT, jsonl=True))
    assert all(isinstance(s, Sample) and s.is_preference for s in lf + trl + swift), [s for s in lf + trl + swift if isinstance(s, Rejection)]
    assert [answers(s) for s in lf] == [("Red.", "Blue."), ("Hi again.", "No.")]
    assert [answers(s) for s in trl] == [("Green.", "Red."), (" blue.", " green."), ("4", "5")]
    assert [answers(s) for s in swift] == [("Blue.", "Green."), ("Red.", "Pink.")]
    # the prompt (and its image) is shared: the same turns before each answer
    first = lf[0]
    assert [m["role"] for m in first.rejected_messages()] == ["user", "assistant"]
    assert first.prompt_messages() == first.rejected_messages()[:-1] == first.chosen_messages()[:-1]
    assert first.messages[0]["content"][0] == {"type": "image", "index": 0} and len(first.images) == 1
    assert Image.open(io.BytesIO(first.images[0])).getpixel((0, 0)) == (200, 30, 30)
    assert [m["role"] for m in lf[1].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in swift[0].messages] == ["system", "user", "assistant"] and len(swift[0].images) == 1
    assert [m["role"] for m in trl[2].rejected_messages()] == ["user", "assistant"]
    for folder, name in (("lf", "dpo.json"), ("trl", "prefs.jsonl"), ("swift", "rlhf.jsonl")):
        assert detect_format(str(tmp_path / folder / name)) == "preference"


def test_llamafactory_dataset_info_ranking_entry(tmp_path):
    write(tmp_path / "data" / "dpo_demo.json", [{**LLAMAFACTORY[0], "answer_good": LLAMAFACTORY[0]["chosen"]}])
    info = {"dpo_demo": {"file_name": "dpo_demo.json", "ranking": True, "formatting": "sharegpt",
                         "columns": {"messages": "conversations", "chosen": "answer_good", "rejected": "rejected", "images": "images"}},
            "alpaca_dpo": {"file_name": "alpaca.json", "ranking": True,
                           "formatting": "alpaca", "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}}}
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(info))
    (tmp_path / "data" / "alpaca.json").write_text(json.dumps([{"instruction": "Add", "input": "2+2", "chosen": "4", "rejected": "22"}]))
    [pair] = read(tmp_path / "data" / "dataset_info.json", dataset="dpo_demo")
    assert answers(pair) == ("Red.", "Blue.") and len(pair.images) == 1
    [pair] = read(tmp_path / "data" / "dataset_info.json", dataset="alpaca_dpo")
    assert answers(pair) == ("4", "22") and pair.messages[0]["content"][0]["text"] == "Add\n2+2"


@pytest.mark.parametrize("record, reason, words", [
    ({"conversations": [{"from": "human", "value": "Hi"}], "rejected": {"from": "gpt", "value": "No"}}, "missing_response", "chosen answer is missing"),
    ({"prompt": "Hi", "chosen": "Hello", "rejected": "   "}, "missing_response", "rejected answer is empty"),
    ({"messages": [{"role": "user", "content": "Hi"}], "rejected_response": "No"}, "missing_response", "messages[-1] answer is missing"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], "rejected_response": ""},
     "missing_response", "rejected_response answer is empty"),
    ({"prompt": "Hi", "chosen": "Hello  there", "rejected": "Hello there"}, "same_response", "same text"),
    ({"conversations": [{"from": "human", "value": "<image><image>Two?"}], "chosen": {"from": "gpt", "value": "Yes"},
      "rejected": {"from": "gpt", "value": "No"}, "images": ["images/0.png"]}, "placeholder_mismatch", "2 <image> placeholder(s) for 1 image"),
    ({"prompt": "<image>Color?", "chosen": "Red", "rejected": "<image>Blue", "images": ["images/0.png"]},
     "placeholder_mismatch", "rejected answer holds <image>"),
    ({"prompt": [{"role": "assistant", "content": "Hi"}], "chosen": "a", "rejected": "b"}, "bad_roles", "turn 0 is assistant"),
    ({"chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
      "rejected": [{"role": "user", "content": "Other Q"}, {"role": "assistant", "content": "B"}]}, "parse_error", "share every turn"),
    ({"prompt": "Q", "chosen": [{"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"}], "rejected": "C"},
     "parse_error", "one assistant message"),
])
def test_reason_codes(tmp_path, record, reason, words):
    [out] = read(write(tmp_path / "d.jsonl", [record], jsonl=True), format="preference")
    assert isinstance(out, Rejection), out
    assert out.reason == reason and words in out.detail and out.location.endswith("d.jsonl:1")


class CharCounter:
    """A stand-in token counter: one token per character of the rendered turns plus 10 per image."""

    def count(self, sample, sizes):
        return sum(len(p["text"]) if p["type"] == "text" else 10 for m in sample.messages for p in m["content"])


def test_too_long_counts_both_sequences_of_a_pair(tmp_path):
    [pair] = read(write(tmp_path / "d.jsonl", [TRL[0]], jsonl=True))
    prompt = len("What color is the square?") + 10
    n = count_tokens(CharCounter(), pair, [(40, 32)])
    assert n == (prompt + len("Green.")) + (prompt + len("Red."))
    pair.num_tokens = n
    assert too_long(pair, max_length=n) is None
    rejection = too_long(pair, max_length=n - 1)
    assert rejection.reason == "too_long" and "chosen and rejected each with the prompt" in rejection.detail


def test_row_round_trip_and_digest():
    pair = Sample(id="p", messages=[{"role": "user", "content": [{"type": "text", "text": "Q"}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": "A"}]}],
                  rejected={"role": "assistant", "content": [{"type": "text", "text": "B"}]})
    back = Sample.from_row(pair.to_row())
    assert back == pair and back.rejected == pair.rejected
    other = Sample(id="p", messages=pair.messages, rejected={"role": "assistant", "content": [{"type": "text", "text": "C"}]})
    sft = Sample(id="p", messages=pair.messages)
    assert len({sample_digest(pair), sample_digest(other), sample_digest(sft)}) == 3
    assert "rejected" in arrow_schema(preference=True).names and "rejected" not in arrow_schema().names
    with pytest.raises(DataError, match="not a preference pair"):
        sft.rejected_messages()


def prepare(tmp_path: Path, sources: list[DataSource], **kw):
    data = DataSection(sources=sources, prepared_dir=tmp_path / "prepared", val_ratio=0.0, min_kept_fraction=0, **kw)
    return prepare_data(data, num_proc=1, progress=False)


def test_kind_auto_refuses_mixed_data_and_sft_or_preference_settle_it(tmp_path):
    import pyarrow.parquet as pq

    pairs = write(tmp_path / "p" / "pairs.json", LLAMAFACTORY)
    sft = write(tmp_path / "s" / "chat.json", [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}])
    sources = [DataSource(path=str(pairs)), DataSource(path=str(sft))]
    with pytest.raises(DataError, match=r"mixes 2 preference pairs \(sources: pairs.json\) and 1 conversations"):
        prepare(tmp_path, sources)
    result = prepare(tmp_path, sources, kind="preference")
    assert result.manifest["kind"] == "preference" and result.rejected == {"missing_response": 1} and result.kept == 2
    rows = pq.read_table(tmp_path / "prepared" / "train" / "train-00000.parquet").to_pylist()
    assert [answers(Sample.from_row(r)) for r in rows] == [("Red.", "Blue."), ("Hi again.", "No.")]
    result = prepare(tmp_path, sources, kind="sft")
    assert result.manifest["kind"] == "sft" and result.kept == 3
    table = pq.read_table(tmp_path / "prepared" / "train" / "train-00000.parquet")
    assert "rejected" not in table.column_names  # SFT on the chosen answers: the plain SFT schema
    assert table.schema.equals(arrow_schema(), check_metadata=True)


def test_parquet_with_trl_columns_and_prepared_pairs_read_back(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.loader import ShardDataset

    # a table as `datasets` writes TRL's vision preference sets: conversational columns, images as {bytes, path}
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Color?"}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}],
             "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}],
             "images": [{"bytes": png(), "path": None}]},
            {"prompt": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}],
             "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}], "images": []}]
    (tmp_path / "trl").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "trl" / "train.parquet")
    pair, same = read(tmp_path / "trl" / "train.parquet")
    assert answers(pair) == ("Red.", "Blue.") and len(pair.images) == 1 and pair.messages[0]["content"][0] == {"type": "image", "index": 0}
    assert isinstance(same, Rejection) and same.reason == "same_response" and same.location.endswith("train.parquet#1")

    # prepared pairs read back (data validate, a second prepare, the trainer's dataset) as the same pairs
    result = prepare(tmp_path, [DataSource(path=str(tmp_path / "trl" / "train.parquet"))], kind="preference")
    assert result.kept == 1 and result.manifest["kind"] == "preference"
    [again] = read(tmp_path / "prepared")
    assert answers(again) == ("Red.", "Blue.") and again.images == pair.images
    [loaded] = ShardDataset.from_dir(tmp_path / "prepared" / "train")
    assert loaded.rejected == again.rejected and loaded.num_tokens is None
