"""Readers: the six formats, auto detection, streaming JSON with line numbers, clear errors."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmctl.config.data import DataSource
from vlmctl.data.checks import Rejection
from vlmctl.data.formats import detect_format, read_source
from vlmctl.data.formats._json import JsonParseError, iter_json_records
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError
from real_data import REAL



def png(color=(200, 30, 30), size=(40, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def samples(source: DataSource) -> list[Sample | Rejection]:
    return list(read_source(source))


def text_of(s: Sample) -> list[tuple[str, str]]:
    return [(m["role"], " ".join(p["text"] if p["type"] == "text" else f"<img{p['index']}>" for p in m["content"])) for m in s.messages]


def lf_root(tmp_path: Path) -> Path:
    """A stand-in for the LLaMA-Factory repository root: `data/` is the demo folder."""
    root = tmp_path / "lf"
    root.mkdir()
    (root / "data").symlink_to(REAL / "llamafactory_mllm_demo", target_is_directory=True)
    return root


def test_real_llava_sharegpt_messages(tmp_path):
    llava = samples(DataSource(path=str(REAL / "llava_examples" / "llava_format.json")))
    assert [s.id for s in llava] == ["extreme_ironing", "waterview", "text_only_turn"]
    assert text_of(llava[1])[0] == ("user", "Describe the scene. <img0>")  # placeholder after the text
    assert llava[2].images == [] and llava[0].location.endswith("llava_format.json:2")
    assert Image.open(io.BytesIO(llava[0].images[0])).size == (570, 380)

    share = samples(DataSource(path=str(REAL / "llamafactory_mllm_demo" / "mllm_demo.json")))
    assert len(share) == 6 and all(isinstance(s, Sample) for s in share)
    assert len(share[0].images) == 2 and share[0].images[0] == share[0].images[1]  # two placeholders, same file
    assert text_of(share[0])[2] == ("user", "What are they doing? <img1>")

    msgs = samples(DataSource(path=str(REAL / "llamafactory_mllm_demo" / "v1_multimodal_demo.jsonl"), image_root=lf_root(tmp_path)))
    assert len(msgs) == 24 and all(isinstance(s, Sample) for s in msgs)
    assert text_of(msgs[0]) == text_of(share[0]) and msgs[0].images == share[0].images
    # without the repository root the relative paths do not resolve
    missing = samples(DataSource(path=str(REAL / "llamafactory_mllm_demo" / "v1_multimodal_demo.jsonl")))
    assert {r.reason for r in missing} == {"missing_image"} and "data/mllm_demo_data/1.jpg" in missing[0].detail


def test_auto_detection(tmp_path):
    assert detect_format(str(REAL / "llava_examples" / "llava_format.json")) == "llava"
    assert detect_format(str(REAL / "llamafactory_mllm_demo" / "mllm_demo.json")) == "sharegpt"
    assert detect_format(str(REAL / "llamafactory_mllm_demo" / "v1_multimodal_demo.jsonl")) == "messages"
    (tmp_path / "a.parquet").write_bytes(b"")
    assert detect_format(str(tmp_path / "a.parquet")) == "parquet"
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "s-0.tar").write_bytes(b"")
    assert detect_format(str(tmp_path / "shards")) == "webdataset"
    with pytest.raises(DataError, match="does not exist") as exc:
        detect_format(str(tmp_path / "org" / "name"))
    assert "format: hf" in exc.value.hint
    (tmp_path / "odd.json").write_text(json.dumps([{"text": "hi"}]))
    with pytest.raises(DataError, match="keys text"):
        detect_format(str(tmp_path / "odd.json"))


def test_messages_data_and_file_urls(tmp_path):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    (tmp_path / "blue.png").write_bytes(blue)
    record = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(red).decode()}},
            {"type": "image", "image": f"file://{tmp_path / 'blue.png'}"},
            {"type": "text", "text": "Colors?"},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "Red, blue."}]},
    ]}
    remote = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/x.jpg"}}, {"type": "text", "text": "?"}]},
                           {"role": "assistant", "content": "x"}]}
    (tmp_path / "m.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(remote) + "\n")
    out = samples(DataSource(path=str(tmp_path / "m.jsonl"), format="messages"))
    s = out[0]
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant"]
    assert s.images == [red, blue] and text_of(s)[1] == ("user", "<img0> <img1> Colors?")
    assert out[1].reason == "missing_image" and "remote image" in out[1].detail


def test_json_array_streams_with_line_numbers(tmp_path, monkeypatch):
    from vlmctl.data.formats import _json

    monkeypatch.setattr(_json, "CHUNK_CHARS", 7)  # force many refills mid-record
    records = [{"id": i, "text": "x" * (i * 5)} for i in range(6)]
    (tmp_path / "a.json").write_text("[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")
    got = list(iter_json_records(tmp_path / "a.json"))
    assert [(line, r["id"]) for line, r in got] == [(i + 2, i) for i in range(6)]
    (tmp_path / "b.json").write_text('[\n{"id": 1},\n{"id": 2,,},\n{"id": 3}\n]')
    got = list(iter_json_records(tmp_path / "b.json"))
    assert got[0] == (2, {"id": 1}) and isinstance(got[1], JsonParseError) and got[1].line == 3 and len(got) == 2
    (tmp_path / "c.jsonl").write_text('{"id": 1}\n\nnot json\n{"id": 4}\n')
    got = list(iter_json_records(tmp_path / "c.jsonl"))
    assert got[0] == (1, {"id": 1}) and got[1].line == 3 and got[2] == (4, {"id": 4})


def test_parquet_cauldron_layout_columns_and_save_to_disk(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    red = png((255, 0, 0))
    table = pa.table({
        "images": [[{"bytes": red, "path": None}], [{"bytes": red, "path": None}]],
        "texts": [[{"user": "Color?", "assistant": "Red.", "source": "x"}], [{"user": "Shape?", "assistant": "Square.", "source": "x"}, {"user": "Sure?", "assistant": "Yes.", "source": "x"}]],
    })
    pq.write_table(table, tmp_path / "cauldron.parquet")
    out = samples(DataSource(path=str(tmp_path / "cauldron.parquet"), format="parquet"))
    assert text_of(out[0]) == [("user", "<img0> Color?"), ("assistant", "Red.")]
    assert len(out[1].messages) == 4 and out[1].location.endswith("cauldron.parquet#1")

    vqa = pa.table({"picture": [red], "query": ["What color?"], "answers": [["red", "Red"]], "question_type": ["color"]})
    pq.write_table(vqa, tmp_path / "vqa.parquet")
    src = DataSource(path=str(tmp_path / "vqa.parquet"), format="parquet", columns={"images": "picture", "question": "query"})
    (s,) = samples(src)
    assert text_of(s) == [("user", "<img0> What color?"), ("assistant", "red")]
    assert s.meta == {"answers": ["red", "Red"], "question_type": "color"}
    with pytest.raises(DataError, match="no conversation column") as exc:
        samples(DataSource(path=str(tmp_path / "vqa.parquet"), format="parquet"))
    assert "query" in exc.value.hint

    ds = datasets.Dataset.from_dict({"image": [red], "question": ["Q?"], "answer": ["A."]}).cast_column("image", datasets.Image())
    ds.save_to_disk(str(tmp_path / "saved"))
    (s,) = samples(DataSource(path=str(tmp_path / "saved")))
    assert text_of(s) == [("user", "<img0> Q?"), ("assistant", "A.")] and s.images == [red]


def _tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_webdataset_layouts(tmp_path):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    conv = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And?"}, {"type": "image"}]}, {"role": "assistant", "content": "Two."}]}
    _tar(tmp_path / "shard-0.tar", {
        "a.json": json.dumps({"question": "Color?", "answers": ["red"]}).encode(), "a.jpg": red, "a.txt": b"red",
        "b.img0.png": red, "b.img1.png": blue, "b.json": json.dumps(conv).encode(),
        "c.png": blue, "c.txt": b"A blue square.",
        "d.png": blue,
    })
    _tar(tmp_path / "shard-1.tar", {
        "e.json": json.dumps({"question": " ", "answers": ["red"]}).encode(), "e.jpg": red, "e.txt": b"red",
        "f.json": json.dumps({"question": ""}).encode(), "f.txt": b"red",
    })
    out = samples(DataSource(path=str(tmp_path), format="webdataset"))
    a, b, c, d, e, f = out
    # an energon VQA sample without a question: its image alone is the user turn (a media-only sample has none)
    assert text_of(e) == [("user", "<img0>"), ("assistant", "red")] and e.meta["answers"] == ["red"]
    assert f.reason == "empty_turn"
    assert text_of(a) == [("user", "<img0> Color?"), ("assistant", "red")] and a.meta["answers"] == ["red"]
    assert b.images == [red, blue] and text_of(b)[0] == ("user", "<img0> And? <img1>")
    assert text_of(c) == [("user", "<img0>"), ("assistant", "A blue square.")]
    assert d.reason == "parse_error" and d.location.endswith("shard-0.tar:d")
    # a truncated shard: samples before the break are read, then one parse_error
    data = (tmp_path / "shard-0.tar").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "x.tar").write_bytes(data[: len(data) // 2])
    out = samples(DataSource(path=str(tmp_path / "cut" / "x.tar")))
    assert isinstance(out[-1], Rejection) and out[-1].reason == "parse_error"


def test_hf_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="cannot load Hub dataset 'someorg/some-vqa'") as exc:
        samples(DataSource(path="someorg/some-vqa", format="hf"))
    assert "offline" in exc.value.hint and "save_to_disk" in exc.value.hint


def test_read_source_normalizes_pixels_for_eval(tmp_path):
    """A DataSource built in code (as `vlmctl eval --data PATH` does) yields 8-bit RGB bytes and VQA meta."""
    rgba = np.zeros((32, 32, 4), np.uint8)  # fully transparent -> white
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    (tmp_path / "t.png").write_bytes(buf.getvalue())
    rec = {"id": "q1", "image": "t.png", "answers": ["white", "White"], "options": ["white", "black"], "question_type": "color",
           "conversations": [{"from": "human", "value": "<image>Color?"}, {"from": "gpt", "value": "white"}]}
    (tmp_path / "eval.json").write_text(json.dumps([rec]))
    (s,) = read_source(DataSource(path=str(tmp_path / "eval.json")))
    assert s.meta == {"answers": ["white", "White"], "options": ["white", "black"], "question_type": "color"}
    im = Image.open(io.BytesIO(s.images[0]))
    assert im.mode == "RGB" and im.getpixel((5, 5)) == (255, 255, 255)
    # a prepared folder reads back (format auto -> parquet) with the same messages, images and meta
    from vlmctl.config.data import DataSection
    from vlmctl.data.prepare import prepare_data

    prepare_data(DataSection(sources=[DataSource(path=str(tmp_path / "eval.json"))], prepared_dir=tmp_path / "prep", val_ratio=0.0), num_proc=1, progress=False)
    (back,) = read_source(DataSource(path=str(tmp_path / "prep")))
    assert (back.id, back.messages, back.images, back.meta) == (s.id, s.messages, s.images, s.meta)
