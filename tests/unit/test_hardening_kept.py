"""data.min_kept_fraction counts the rejections by the project's own limits (too_long, the image, video and audio
limits): a source that loses most of its records to them fails the prepare like one that loses them to defects,
with its counts per reason and the setting behind each limit. Repeats of kept samples are not counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from vlmctl.config.data import DataSection, DataSource
from vlmctl.data.checks import FILTERS
from vlmctl.data.prepare import LIMIT_KEYS, REPEATS, prepare_data
from vlmctl.errors import DataError


def record(i: int, image: str | None = None, answer: str | None = None) -> dict:
    question = f"<image>\nQuestion {i}?" if image else f"Question {i}?"
    out = {"id": f"r{i:04d}", "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer or f"Answer {i}."}]}
    return {**out, "image": image} if image else out


def write(raw: Path, name: str, records: list[dict]) -> DataSource:
    raw.mkdir(parents=True, exist_ok=True)
    (raw / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return DataSource(path=str(raw / name), format="llava")


def prepare(tmp_path: Path, *sources: DataSource, model=None, **settings):
    data = DataSection(sources=list(sources), prepared_dir=tmp_path / "prepared", val_ratio=0.0, **settings)
    from vlmctl.models.build import configured_processor

    return prepare_data(data, num_proc=1, progress=False, model=model, processors=configured_processor)


def test_every_limit_reason_names_its_setting():
    assert set(LIMIT_KEYS) | set(REPEATS) == set(FILTERS) and not set(LIMIT_KEYS) & set(REPEATS)


def test_a_source_losing_most_records_to_an_image_limit_fails(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for k, side in enumerate((40, 40, 40, 10, 10, 10, 10)):  # 4 of 7 under data.min_image_side (28)
        Image.new("RGB", (side, side), (30 * k, 90, 90)).save(raw / f"i{k}.png", "PNG")
    small = write(raw, "small.jsonl", [record(k, image=f"i{k}.png") for k in range(7)])
    good = write(raw, "good.jsonl", [record(k) for k in range(10, 14)])
    with pytest.raises(DataError) as exc:
        prepare(tmp_path, small, good)
    msg = exc.value.message
    assert "small.jsonl: kept 3 of 7 records" in msg and "image_too_small 4 (limit: data.min_image_side)" in msg
    assert "good.jsonl" not in msg
    assert "data.min_image_side" in exc.value.hint and "data.min_kept_fraction" in exc.value.hint
    assert not (tmp_path / "prepared").exists()
    # the limit is the cause: lowered, every record is kept
    assert prepare(tmp_path, small, good, min_image_side=8).kept == 11


def test_repeats_of_kept_samples_do_not_count(tmp_path):
    same = [record(1)] * 6 + [record(2), record(3)]  # 5 of 8 repeat the first: nothing is lost with them
    source = write(tmp_path / "raw", "dups.jsonl", [{**r, "id": f"d{k}"} for k, r in enumerate(same)])
    result = prepare(tmp_path, source)
    assert result.kept == 3 and result.rejected == {"duplicate": 5}


def test_too_long_counts_toward_the_fraction(tmp_path):
    from vlmctl.config.model import ModelSection

    long_answer = " ".join(f"word{w}" for w in range(300))
    records = [record(k) for k in range(4)] + [record(k, answer=long_answer) for k in range(4, 10)]
    source = write(tmp_path / "raw", "long.jsonl", records)
    model = ModelSection(preset="tiny", init="random", output_dir=tmp_path / "model")
    with pytest.raises(DataError) as exc:
        prepare(tmp_path, source, model=model, max_length=128)
    assert "long.jsonl: kept 4 of 10 records" in exc.value.message
    assert "too_long 6 (limit: data.max_length or train.tokens_per_batch)" in exc.value.message
    result = prepare(tmp_path, source, model=model, max_length=128, min_kept_fraction=0.4)
    assert result.kept == 4 and result.rejected == {"too_long": 6}
