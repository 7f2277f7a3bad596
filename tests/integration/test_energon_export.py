"""`data prepare --export energon`: the vqa (images: VQASample, videos: VidQASample), captioning and crude shapes,
video and audio clips included, read by stock megatron-energon in a process that never imports vlmctl, by energon's
CLI, by the documented cooker, by the `webdataset` package and by vlmctl's own webdataset reader."""

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

def numbered(sample, stem):  # img0.png, img1.jpg, ... / vid0.mkv, ... / aud0.flac, ...
    names = [k for k in sample if k.startswith(stem) and k[len(stem):].split(".")[0].isdigit()]
    return [sample[k] for k in sorted(names, key=lambda k: int(k[len(stem):].split(".")[0]))]

@stateless
def cook(sample: dict) -> dict:
    return dict(**basic_sample_keys(sample), **sample["json"], images=numbered(sample, "img"),
                videos=numbered(sample, "vid"), audios=numbered(sample, "aud"))

class Encoder(DefaultTaskEncoder):
    cookers = [Cooker(cook)]

    def batch(self, samples):
        return samples

ds = get_train_dataset(sys.argv[1], split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                       batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, task_encoder=Encoder(), repeat=False)
rows = [{"id": s["id"], "messages": s["messages"], "shapes": [list(i.shape) for i in s["images"]],
         "clips": [type(c).__name__ for c in s["videos"] + s["audios"]]} for s in get_loader(ds)]
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
    assert cooked["two_images"]["shapes"] == [[3, 40, 40], [3, 40, 40]] and cooked["two_images"]["clips"] == []

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


def clips_records(raw: Path) -> list[dict]:
    """A video sample, an audio sample, an image sample and one with an image, two videos and an audio clip in two
    turns; the sources are re-encoded at prepare (MP4/WebM -> Motion JPEG Matroska, 22.05 kHz WAV -> 16 kHz FLAC)."""
    from tests.audio_data import wav
    from tests.video_data import moving_square

    (raw / "clip.mp4").write_bytes(moving_square())
    (raw / "wide.webm").write_bytes(moving_square(frames=6, width=80, codec="libvpx", container="webm"))
    (raw / "tone.wav").write_bytes(wav(1.0, rate=22_050))
    noise_image(raw / "a.png", (40, 40), seed=1)
    noise_image(raw / "b.jpg", (36, 44), seed=2)
    turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
    return [
        {"id": "clip", "messages": [turn("user", "<video>What moves?"), turn("assistant", "A red square.")], "videos": ["clip.mp4"]},
        {"id": "speech", "messages": [turn("user", "<audio>Transcribe this."), turn("assistant", "A tone.")], "audios": ["tone.wav"]},
        {"id": "picture", "messages": [turn("user", "<image>What is it?"), turn("assistant", "Noise.")], "images": ["a.png"]},
        {"id": "mixed", "messages": [turn("user", "<video>Compare<image>with<video>"), turn("assistant", "Same square."),
                                     turn("user", "And this?<audio>"), turn("assistant", "A tone.")],
         "images": ["b.jpg"], "videos": ["clip.mp4", "wide.webm"], "audios": ["tone.wav"]},
    ]


@pytest.mark.filterwarnings("ignore:'pin_memory' argument")
def test_video_and_audio_samples_export_crude_with_their_clips_byte_for_byte(tmp_path):
    from vlmctl.data.modalities.audio import decode_audio
    from vlmctl.data.modalities.video import decode_clip

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "media.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clips_records(raw)))
    export = prepare(tmp_path, [DataSource(path=str(raw / "media.jsonl"))], val_ratio=0.0).manifest["export"]
    assert export["format"] == "crude" and export["samples"] == {"train": 4, "val": 0}
    assert "'speech'" in export["format_note"] and "has audio parts" in export["format_note"]
    prepared = {s.id: s for s in read_source(DataSource(path=str(tmp_path / "prepared"), format="parquet"))}
    assert [len(prepared["mixed"].media[m]) for m in ("image", "video", "audio")] == [1, 2, 1]
    assert prepared["clip"].videos[0][:4] == b"\x1a\x45\xdf\xa3" and prepared["speech"].audios[0][:4] == b"fLaC"

    # the tar: per sample its json and every medium, numbered per modality, byte for byte
    root = tmp_path / "energon"
    with tarfile.open(root / "train" / "shard-00000.tar") as t:
        members = {n: t.extractfile(n).read() for n in t.getnames()}
    by_id = {}
    for name, data in members.items():
        if name.endswith(".json"):
            record = json.loads(data)
            by_id[record["id"]] = (name[: -len(".json")], record)
    assert set(by_id) == set(prepared)
    expected_parts = {"clip": ["vid0.mkv"], "speech": ["aud0.flac"], "picture": ["img0.png"],
                      "mixed": ["aud0.flac", "img0.jpg", "vid0.mkv", "vid1.mkv"]}
    for sid, (key, record) in by_id.items():
        orig = prepared[sid]
        parts = sorted(n[len(key) + 1:] for n in members if n.startswith(key + ".") and not n.endswith(".json"))
        assert parts == expected_parts[sid]
        for part in parts:
            modality = {"img": "image", "vid": "video", "aud": "audio"}[part[:3]]
            assert members[f"{key}.{part}"] == orig.media[modality][int(part[3:].split(".")[0])]
        assert record == {"id": sid, "source": "media.jsonl", "messages": orig.messages, "meta": {}, "num_tokens": None}
    assert {"type": "video", "index": 1} in by_id["mixed"][1]["messages"][0]["content"]

    # .nv-meta: energon's crude form, the split and the shard count
    meta = root / ".nv-meta"
    assert yaml.safe_load((meta / "dataset.yaml").read_text()) == {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
    assert yaml.safe_load((meta / "split.yaml").read_text())["split_parts"] == {"train": ["train/shard-00000.tar"], "val": [], "test": []}
    assert json.loads((meta / ".info.json").read_text())["shard_counts"] == {"train/shard-00000.tar": 4}

    # the webdataset package reads the shard back with the same members
    import webdataset as wds

    raw_samples = list(wds.WebDataset(str(root / "train" / "shard-00000.tar"), shardshuffle=False))
    assert {(s["__key__"], k) for s in raw_samples for k in s if not k.startswith("__")} == \
           {tuple(n.split(".", 1)) for n in members}

    # energon's own loader with the cooker: clips come as AVDecoder objects that decode to the prepared clips
    pytest.importorskip("av")
    pytest.importorskip("filetype")
    from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset
    from megatron.energon.av import AVDecoder

    from vlmctl.data.energon import cook_conversation

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook_conversation)]

        def batch(self, samples):
            return samples

    ds = get_train_dataset(root, split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                           batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, task_encoder=Encoder(), repeat=False)
    got = {s.id: s for s in get_loader(ds)}
    assert set(got) == set(prepared)
    for sid, sample in got.items():
        orig = prepared[sid]
        assert sample.messages == orig.messages and len(sample.images) == len(orig.images)
        assert len(sample.videos) == len(orig.videos) and len(sample.audios) == len(orig.audios)
        for decoder, data in zip(sample.videos, orig.videos):
            assert isinstance(decoder, AVDecoder)
            frames = decoder.get_video().video_clips[0]  # [T, 3, H, W] uint8
            np.testing.assert_array_equal(frames.permute(0, 2, 3, 1).numpy(), decode_clip(data).frames)
        for decoder, data in zip(sample.audios, orig.audios):
            assert isinstance(decoder, AVDecoder)
            wave = decoder.get_audio().audio_clips[0]  # [channels, samples], the FLAC's 16-bit integers
            assert tuple(wave.shape) == (1, 16_000) and decoder.get_metadata().audio_sample_rate == 16_000
            np.testing.assert_allclose(wave[0].numpy() / 32768, decode_audio(data), atol=1e-6)
    assert [tuple(v.get_video().video_clips[0].shape) for v in got["mixed"].videos] == [(4, 3, 48, 64), (4, 3, 48, 80)]

    # the stock-only cooker of docs/formats.md hands the clips over as AVDecoder objects too
    proc = subprocess.run([sys.executable, "-c", STOCK_COOKER, str(root)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {r["id"]: r["clips"] for r in json.loads(proc.stdout)} == {
        "clip": ["AVDecoder"], "speech": ["AVDecoder"], "picture": [], "mixed": ["AVDecoder"] * 3}

    # and vlmctl's webdataset reader takes the clips back where they were
    back = {s.id: s for s in read_source(DataSource(path=str(root), format="webdataset"))}
    assert {sid: (s.messages, s.media) for sid, s in back.items()} == {sid: (s.messages, s.media) for sid, s in prepared.items()}


# Stock energon only (never imports vlmctl): a VidQASample export, its clip decoded through AVDecoder.
STOCK_VIDEO_READER = r"""
import json, sys
from megatron.energon import WorkerConfig, get_loader, get_train_dataset

ds = get_train_dataset(sys.argv[1], split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                       batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, repeat=False)
rows = [{"class": type(s).__name__, "decoder": type(s.video).__name__, "context": s.context, "answers": s.answers,
         "shape": list(s.video.get_video().video_clips[0].shape)} for s in get_loader(ds)]
assert "vlmctl" not in sys.modules
print(json.dumps(rows))
"""


@pytest.mark.filterwarnings("ignore:'pin_memory' argument")
def test_single_video_samples_export_as_vidqa(tmp_path):
    pytest.importorskip("av")
    pytest.importorskip("filetype")
    raw = tmp_path / "raw"
    raw.mkdir()
    records = [r for r in clips_records(raw) if r["id"] == "clip"]
    records.append({"id": "wide", "messages": [{"role": "user", "content": "Describe the video.<video>"},
                                                {"role": "assistant", "content": "A square moves right."}], "videos": ["wide.webm"]})
    (raw / "videos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    export = prepare(tmp_path, [DataSource(path=str(raw / "videos.jsonl"))], val_ratio=0.0).manifest["export"]
    assert export["format"] == "vqa" and "has a video (energon's CaptioningSample holds an image)" in export["format_note"]

    root = tmp_path / "energon"
    assert yaml.safe_load((root / ".nv-meta" / "dataset.yaml").read_text()) == {
        "sample_type": {"__module__": "megatron.energon", "__class__": "VidQASample"},
        "field_map": {"video": "mkv", "context": "json[question]", "answers": "txt"}}
    prepared = {s.id: s for s in read_source(DataSource(path=str(tmp_path / "prepared"), format="parquet"))}
    with tarfile.open(root / "train" / "shard-00000.tar") as t:
        members = {n: t.extractfile(n).read() for n in t.getnames()}
    assert sorted(n.split(".", 1)[1] for n in members) == ["json", "json", "mkv", "mkv", "txt", "txt"]
    for name, data in members.items():
        if name.endswith(".json"):
            record, key = json.loads(data), name[: -len(".json")]
            assert members[f"{key}.mkv"] == prepared[record["id"]].videos[0]
            assert record["question"] == {"clip": "What moves?", "wide": "Describe the video."}[record["id"]]

    proc = subprocess.run([sys.executable, "-c", STOCK_VIDEO_READER, str(root)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted(json.loads(proc.stdout), key=lambda r: r["context"])
    assert rows == [
        {"class": "VidQASample", "decoder": "AVDecoder", "context": "Describe the video.", "answers": "A square moves right.", "shape": [4, 3, 48, 80]},
        {"class": "VidQASample", "decoder": "AVDecoder", "context": "What moves?", "answers": "A red square.", "shape": [4, 3, 48, 64]},
    ]
    lint = energon_cli("lint", str(root))
    assert lint.returncode == 0, lint.stderr[-2000:]
    info = energon_cli("info", str(root))
    assert info.returncode == 0 and "VidQASample" in info.stdout and "2 samples" in info.stdout

    # a video has no energon captioning sample; an image among the videos has no place in one VidQASample export
    with pytest.raises(DataError, match=r"energon_format=captioning: it has a video"):
        prepare(tmp_path, [DataSource(path=str(raw / "videos.jsonl"))], fmt="captioning")
    (raw / "mixed.jsonl").write_text(json.dumps({"id": "pic", "messages": [{"role": "user", "content": "<image>What?"},
                                                                          {"role": "assistant", "content": "Noise."}], "images": ["a.png"]}) + "\n")
    with pytest.raises(DataError, match=r"'pic'.* has an image while sample '(clip|wide)'.* has a video"):
        prepare(tmp_path, [DataSource(path=str(raw / "videos.jsonl")), DataSource(path=str(raw / "mixed.jsonl"))], fmt="vqa")
