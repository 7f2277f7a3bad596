"""`data prepare --export energon`: the vqa, captioning and crude shapes, read by stock megatron-energon in a process
that never imports vlmctl, by energon's CLI, by the documented cooker and by vlmctl's own webdataset reader."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from vlmctl.config.data import DataExport, DataSection, DataSource
from vlmctl.data.formats import read_source
from vlmctl.data.prepare import prepare_data
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

# Runs in a fresh interpreter: stock energon only. Writes, per split, what the loader yields: the sample class, the
# text fields and the image as uint8 H x W x C (energon decodes to float C x H x W in [0, 1]).
STOCK_READER = r"""
import json, sys
import numpy as np
from megatron.energon import WorkerConfig, get_loader, get_train_dataset

root, out = sys.argv[1], sys.argv[2]
result, images = {}, {}
for split in ("train", "val"):
    ds = get_train_dataset(root, split_part=split, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                           batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, repeat=False)
    rows = result[split] = []
    for sample in get_loader(ds):
        fields = {k: getattr(sample, k) for k in ("context", "answers", "caption") if hasattr(sample, k)}
        rows.append({"class": type(sample).__name__, "key": sample.__key__, **fields})
        images[sample.__key__] = np.round(sample.image.permute(1, 2, 0).numpy() * 255).astype(np.uint8)
assert "vlmctl" not in sys.modules, "the stock reader imported vlmctl"
np.savez(out + ".npz", **images)
json.dump(result, open(out + ".json", "w"))
"""


# The cooker docs/formats.md gives for reading a crude export without vlmctl.
STOCK_COOKER = r"""
import json, sys
from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, basic_sample_keys, get_loader, get_train_dataset, stateless

@stateless
def cook(sample: dict) -> dict:
    images = sorted((k for k in sample if k.startswith("img")), key=lambda k: int(k[3:].split(".")[0]))
    return dict(**basic_sample_keys(sample), **sample["json"], images=[sample[k] for k in images])

class Encoder(DefaultTaskEncoder):
    cookers = [Cooker(cook)]

    def batch(self, samples):
        return samples

ds = get_train_dataset(sys.argv[1], split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                       batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, task_encoder=Encoder(), repeat=False)
rows = [{"id": s["id"], "messages": s["messages"], "shapes": [list(i.shape) for i in s["images"]]} for s in get_loader(ds)]
assert "vlmctl" not in sys.modules
print(json.dumps(rows))
"""


def read_with_stock_energon(root: Path, tmp_path: Path) -> tuple[dict, dict]:
    out = tmp_path / "stock"
    proc = subprocess.run([sys.executable, "-c", STOCK_READER, str(root), str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(str(out) + ".npz") as images:
        return json.loads(Path(str(out) + ".json").read_text()), {k: images[k] for k in images.files}


def energon_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron.energon.cli.main", *args], capture_output=True, text=True)


def noise_image(path: Path, size: tuple[int, int], seed: int) -> np.ndarray:
    """Random pixels (so any re-encoding or channel mix-up shows), saved by extension; returns the decoded pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return np.asarray(Image.open(path).convert("RGB"))


def llava_record(sid: str, image: str, turns: list[tuple[str, str]]) -> dict:
    conv = []
    for q, a in turns:
        conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    return {"id": sid, "image": image, "conversations": conv}


def prepare(tmp_path: Path, sources: list[DataSource], fmt: str = "auto", val_ratio: float = 0.3):
    data = DataSection(sources=sources, prepared_dir=tmp_path / "prepared", val_ratio=val_ratio, dedup=False,
                       export=DataExport(energon_format=fmt))
    return prepare_data(data, num_proc=1, progress=False, export="energon", export_dir=tmp_path / "energon")


def tar_members(root: Path) -> list[str]:
    names = []
    for tar in sorted(root.glob("*/*.tar")):
        with tarfile.open(tar) as t:
            names += t.getnames()
    return names


@pytest.mark.filterwarnings("ignore:'pin_memory' argument")
def test_vqa_export_reads_with_stock_energon_and_back_with_vlmctl(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    expected, records = {}, []
    for i in range(8):
        ext = "jpg" if i % 2 else "png"  # both encodings in one export: field_map lists both
        pixels = noise_image(raw / f"p{i}.{ext}", (40 + i, 36), seed=i)
        question, answer = f"What is shown in picture {i}?", f"Noise number {i}."
        # the placeholder before or after the question: both are single-turn VQA
        records.append(llava_record(f"q{i}", f"p{i}.{ext}", [(f"<image>\n{question}" if i % 3 else f"{question}\n<image>", answer)]))
        expected[question] = (f"q{i}", answer, pixels, ext)
    (raw / "vqa.json").write_text(json.dumps(records))

    result = prepare(tmp_path, [DataSource(path=str(raw / "vqa.json"))])
    export = result.manifest["export"]
    assert export["format"] == "vqa" and export["path"] == str(tmp_path / "energon")
    assert "'q0'" in export["format_note"] and "not a generic caption instruction" in export["format_note"]
    assert export["samples"]["train"] > 0 and export["samples"]["val"] > 0

    root = tmp_path / "energon"
    meta = yaml.safe_load((root / ".nv-meta" / "dataset.yaml").read_text())
    assert meta["sample_type"] == {"__module__": "megatron.energon", "__class__": "VQASample"}
    assert meta["field_map"] == {"image": "jpg,png", "context": "json[question]", "answers": "txt"}
    members = tar_members(root)
    assert {m.split(".", 1)[1] for m in members} == {"jpg", "png", "txt", "json"} and len(members) == 3 * 8

    got, images = read_with_stock_energon(root, tmp_path)
    assert sum(len(rows) for rows in got.values()) == 8
    for split, rows in got.items():
        assert len(rows) == export["samples"][split]
        for row in rows:
            sid, answer, pixels, _ = expected[row["context"]]
            assert row["class"] == "VQASample" and row["answers"] == answer
            np.testing.assert_array_equal(images[row["key"]], pixels)

    # the json part carries the metadata; the image keeps its encoding
    with tarfile.open(root / "train" / "shard-00000.tar") as t:
        first = sorted(n for n in t.getnames() if n.endswith(".json"))[0]
        record = json.loads(t.extractfile(first).read())
        key = first[: -len(".json")]
        sid, answer, _, ext = expected[record["question"]]
        assert record["id"] == sid and record["source"] == "vqa.json" and f"{key}.{ext}" in t.getnames()
        assert t.extractfile(f"{key}.txt").read().decode() == answer

    lint = energon_cli("lint", str(root))
    assert lint.returncode == 0, lint.stderr[-2000:]
    info = energon_cli("info", str(root))
    assert info.returncode == 0 and "VQASample" in info.stdout and "8 samples" in info.stdout

    # vlmctl's webdataset reader takes the export back (energon VQA layout): same ids, question, answer, image bytes
    prepared = {s.id: s for s in read_source(DataSource(path=str(tmp_path / "prepared"), format="parquet"))}
    back = list(read_source(DataSource(path=str(root), format="webdataset")))
    assert sorted(s.id for s in back) == sorted(prepared)
    for s in back:
        assert isinstance(s, Sample)
        orig = prepared[s.id]
        assert s.images == orig.images
        assert [[p.get("text") for p in m["content"] if p["type"] == "text"] for m in s.messages] == \
               [[p.get("text") for p in m["content"] if p["type"] == "text"] for m in orig.messages]


@pytest.mark.filterwarnings("ignore:'pin_memory' argument")
def test_captioning_export_yields_captioning_samples(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    expected = {}
    # a captioning webdataset source: {key}.jpg + {key}.txt, no prompt at all
    with tarfile.open(raw / "captions.tar", "w") as tar:
        for i in range(4):
            pixels = noise_image(tmp_path / f"c{i}.jpg", (48, 32 + i), seed=10 + i)
            caption = f"A caption for noise {i}."
            expected[caption] = pixels
            for name, data in ((f"c{i}.jpg", (tmp_path / f"c{i}.jpg").read_bytes()), (f"c{i}.txt", caption.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    # and a LLaVA-Pretrain style record: a generic brief-description prompt
    pixels = noise_image(raw / "lp.png", (33, 44), seed=20)
    expected["A pretraining caption."] = pixels
    (raw / "pretrain.json").write_text(json.dumps([llava_record(
        "GCC_1", "lp.png", [("Provide a brief description of the given image.\n<image>", "A pretraining caption.")])]))

    result = prepare(tmp_path, [DataSource(path=str(raw / "captions.tar")), DataSource(path=str(raw / "pretrain.json"))])
    assert result.manifest["export"]["format"] == "captioning"
    root = tmp_path / "energon"
    meta = yaml.safe_load((root / ".nv-meta" / "dataset.yaml").read_text())
    assert meta == {"sample_type": {"__module__": "megatron.energon", "__class__": "CaptioningSample"},
                    "field_map": {"image": "jpg,png", "caption": "txt"}}

    got, images = read_with_stock_energon(root, tmp_path)
    rows = got["train"] + got["val"]
    assert sorted(r["caption"] for r in rows) == sorted(expected)
    for row in rows:
        assert row["class"] == "CaptioningSample"
        np.testing.assert_array_equal(images[row["key"]], expected[row["caption"]])

    info = energon_cli("info", str(root))
    assert info.returncode == 0 and "CaptioningSample" in info.stdout, info.stderr[-2000:]

    # vlmctl reads the captions back as captions (the image alone is the question), the prompt stays in the json
    back = {s.id: s for s in read_source(DataSource(path=str(root), format="webdataset"))}
    assert back["GCC_1"].messages[0]["content"] == [{"type": "image", "index": 0}]
    assert back["GCC_1"].messages[1]["content"][0]["text"] == "A pretraining caption."


@pytest.mark.filterwarnings("ignore:'pin_memory' argument")
def test_multi_turn_export_is_crude_and_round_trips_through_the_cooker(tmp_path):
    from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset

    from vlmctl.data.energon import ConversationSample, cook_conversation

    raw = tmp_path / "raw"
    raw.mkdir()
    pixels = {name: noise_image(raw / name, (40, 40), seed=i) for i, name in enumerate(("a.png", "b.jpg", "c.jpg"))}
    (raw / "chat.json").write_text(json.dumps([
        {"id": "two_images", "messages": [
            {"role": "user", "content": "<image>Who is this?"}, {"role": "assistant", "content": "Noise A."},
            {"role": "user", "content": "And this one?<image>"}, {"role": "assistant", "content": "Noise B."}],
         "images": ["a.png", "b.jpg"]},
        {"id": "single", "messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "Noise C."}],
         "images": ["c.jpg"]},
    ]))
    result = prepare(tmp_path, [DataSource(path=str(raw / "chat.json"), format="sharegpt")], val_ratio=0.0)
    export = result.manifest["export"]
    assert export["format"] == "crude" and "'two_images'" in export["format_note"] and "2 user turns" in export["format_note"]
    root = tmp_path / "energon"
    assert yaml.safe_load((root / ".nv-meta" / "dataset.yaml").read_text()) == {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
    # each image keeps its own encoding, numbered in order of use
    assert sorted(m.split(".", 1)[1] for m in tar_members(root)) == ["img0.jpg", "img0.png", "img1.jpg", "json", "json"]

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook_conversation)]

        def batch(self, samples):
            return samples

    ds = get_train_dataset(root, split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                           batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, task_encoder=Encoder(), repeat=False)
    got = {s.id: s for s in get_loader(ds)}
    assert all(isinstance(s, ConversationSample) for s in got.values())
    prepared = {s.id: s for s in read_source(DataSource(path=str(tmp_path / "prepared"), format="parquet"))}
    assert set(got) == set(prepared) == {"two_images", "single"}
    for sid, sample in got.items():
        assert sample.messages == prepared[sid].messages
        decoded = [np.round(t.permute(1, 2, 0).numpy() * 255).astype(np.uint8) for t in sample.images]
        originals = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in prepared[sid].images]
        assert len(decoded) == len(originals)
        for d, o in zip(decoded, originals):
            np.testing.assert_array_equal(d, o)
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(prepared["two_images"].images[1]))), pixels["b.jpg"])

    # the stock-only cooker of docs/formats.md reads it without vlmctl
    proc = subprocess.run([sys.executable, "-c", STOCK_COOKER, str(root)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cooked = {r["id"]: r for r in json.loads(proc.stdout)}
    assert {sid: r["messages"] for sid, r in cooked.items()} == {sid: s.messages for sid, s in prepared.items()}
    assert cooked["two_images"]["shapes"] == [[3, 40, 40], [3, 40, 40]]

    # stock energon without a cooker refuses the crude set
    lint = energon_cli("lint", str(root))
    assert lint.returncode != 0 and "cookers" in lint.stderr


def test_explicit_vqa_on_multi_turn_data_fails_naming_the_sample(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    noise_image(raw / "a.png", (40, 40), seed=0)
    (raw / "d.json").write_text(json.dumps([
        llava_record("fine", "a.png", [("<image>\nWhat?", "Noise.")]),
        llava_record("chatty", "a.png", [("<image>\nWhat?", "Noise."), ("Sure?", "Yes.")]),
    ]))
    with pytest.raises(DataError) as err:
        prepare(tmp_path, [DataSource(path=str(raw / "d.json"))], fmt="vqa")
    assert "'chatty'" in err.value.message and "d.json" in err.value.message and "2 user turns" in err.value.message
    assert "energon_format" in err.value.hint and "crude" in err.value.hint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # nothing written, no temporary folder left

    # explicit crude on VQA-shaped data writes crude; explicit captioning keeps a specific prompt in the json
    (raw / "d.json").write_text(json.dumps([llava_record("fine", "a.png", [("<image>\nWhat colour dominates?", "Grey.")])]))
    assert prepare(tmp_path, [DataSource(path=str(raw / "d.json"))], fmt="crude", val_ratio=0.0).manifest["export"]["format"] == "crude"
    assert prepare(tmp_path, [DataSource(path=str(raw / "d.json"))], fmt="captioning", val_ratio=0.0).manifest["export"]["format"] == "captioning"
    with tarfile.open(tmp_path / "energon" / "train" / "shard-00000.tar") as t:
        record = json.loads(t.extractfile("train_000000000.json").read())
    assert record["prompt"] == "What colour dominates?" and "question" not in record
