"""Data from elsewhere: no good record is lost to a bad one, nothing outside the data is read, nothing aborts the
whole prepare, every refusal has a reason code."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import pytest
from PIL import Image

from vlmctl.config import validate_config
from vlmctl.config.data import DataSection, DataSource
from vlmctl.data.checks import REASONS, Rejection
from vlmctl.data.formats import read_source
from vlmctl.data.images import ImageError, normalize_image, read_ref
from vlmctl.data.prepare import prepare_data
from vlmctl.data.validate import validate_data
from vlmctl.errors import ConfigError, DataError
from cli_runner import run_cli as run


def record(i: int, **extra) -> dict:
    return {"id": f"r{i:04d}", "conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": f"Answer {i}."}], **extra}


def png(path: Path, size=(40, 32), color=(200, 30, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path, "PNG")
    return path


def prepare(tmp_path: Path, *sources: DataSource, **settings):
    data = DataSection(sources=list(sources), prepared_dir=tmp_path / "prepared", val_ratio=0.0, **settings)
    return prepare_data(data, num_proc=1, progress=False)


def rejected(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "prepared" / "rejected.jsonl").read_text().splitlines()]


def jsonl_with_bad_byte(path: Path, n: int, bad_line: int) -> Path:
    lines = [json.dumps(record(i)).encode() for i in range(n)]
    lines[bad_line - 1] = lines[bad_line - 1].replace(b"Question", b"Qu\xffestion")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


# ------------------------------------------------------------------------------------------------ decoding


def test_bad_utf8_byte_on_line_501_keeps_the_other_999_lines(tmp_path):
    src = jsonl_with_bad_byte(tmp_path / "raw" / "big.jsonl", 1000, 501)
    result = prepare(tmp_path, DataSource(path=str(src), format="llava"))
    assert result.kept == 999 and result.rejected == {"parse_error": 1}
    (rej,) = rejected(tmp_path)
    assert rej["location"].endswith("big.jsonl:501") and "not UTF-8" in rej["detail"] and rej["reason"] == "parse_error"


def test_a_100_line_file_with_one_bad_byte_keeps_99(tmp_path):
    src = jsonl_with_bad_byte(tmp_path / "raw" / "small.jsonl", 100, 7)
    result = prepare(tmp_path, DataSource(path=str(src), format="llava"))
    assert result.kept == 99 and result.manifest["splits"]["train"]["samples"] == 99
    assert rejected(tmp_path)[0]["location"].endswith("small.jsonl:7")


def test_bad_byte_in_a_json_array_costs_one_element(tmp_path):
    text = json.dumps([record(i) for i in range(20)], indent=1).encode()
    text = text.replace(b"Question 12?", b"Question \xc3(12?")
    (tmp_path / "arr.json").write_bytes(text)
    out = list(read_source(DataSource(path=str(tmp_path / "arr.json"), format="llava"), check=False))
    bad = [r for r in out if isinstance(r, Rejection)]
    assert len(out) == 20 and len(bad) == 1 and bad[0].reason == "parse_error" and "not UTF-8" in bad[0].detail


def test_one_line_array_rejections_name_the_element(tmp_path):
    records = [record(i) for i in range(30)]
    records[17] = {"id": "bad", "conversations": "not a list"}
    records[23]["conversations"] = [{"from": "human", "value": "only a question"}]
    (tmp_path / "min.json").write_text(json.dumps(records))  # one line
    out = list(read_source(DataSource(path=str(tmp_path / "min.json"), format="llava"), check=False))
    bad = {r.location.rsplit("/", 1)[-1]: r.reason for r in out if isinstance(r, Rejection)}
    assert bad == {"min.json:1[#17]": "parse_error", "min.json:1[#23]": "bad_roles"}
    assert len(out) == 30 and out[0].location.endswith("min.json:1[#0]")


def test_deep_nesting_is_rejected_per_record_and_other_sources_are_prepared(tmp_path):
    deep = "[" * 200_000 + "]" * 200_000
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "deep.jsonl").write_text(json.dumps(record(0)) + "\n" + deep + "\n" + json.dumps(record(2)) + "\n")
    (raw / "deep_array.json").write_text("[" + json.dumps(record(10)) + ", " + deep + ", " + json.dumps(record(12)) + "]")
    (raw / "good.jsonl").write_text("".join(json.dumps(record(i)) + "\n" for i in range(20, 25)))
    result = prepare(
        tmp_path,
        DataSource(path=str(raw / "deep.jsonl"), format="llava"),
        DataSource(path=str(raw / "deep_array.json"), format="llava"),
        DataSource(path=str(raw / "good.jsonl"), format="llava"),
    )
    assert result.kept == 2 + 2 + 5 and result.rejected == {"too_deep": 2}
    by_source = {s["name"]: s for s in result.manifest["sources"]}
    assert by_source["good.jsonl"]["kept"] == 5
    locations = sorted(r["location"].rsplit("/", 1)[-1] for r in rejected(tmp_path))
    assert locations == ["deep.jsonl:2", "deep_array.json:1[#1]"]


def test_oversized_records_are_too_large_and_reading_goes_on(tmp_path, monkeypatch):
    from vlmctl.data.formats import _json

    monkeypatch.setattr(_json, "MAX_RECORD_BYTES", 2000)
    monkeypatch.setattr(_json, "CHUNK_CHARS", 256)
    big = record(1)
    big["conversations"][1]["value"] = "x" * 10_000
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in (record(0), big, record(2))) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([record(0), big, record(2)], indent=1))
    for name in ("a.jsonl", "b.json"):
        out = list(read_source(DataSource(path=str(tmp_path / name), format="llava"), check=False))
        assert [getattr(x, "reason", "kept") for x in out] == ["kept", "too_large", "kept"], name


def test_source_below_min_kept_fraction_fails_prepare(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "mostly_bad.jsonl").write_text("".join(json.dumps(record(i)) + "\n" if i < 3 else "{oops\n" for i in range(10)))
    (raw / "good.jsonl").write_text("".join(json.dumps(record(i)) + "\n" for i in range(10, 14)))
    sources = [DataSource(path=str(raw / "mostly_bad.jsonl"), format="llava"), DataSource(path=str(raw / "good.jsonl"), format="llava")]
    with pytest.raises(DataError) as exc:
        prepare(tmp_path, *sources)
    msg = exc.value.message
    assert "mostly_bad.jsonl: kept 3 of 10 records" in msg and "parse_error 7" in msg and "good.jsonl" not in msg
    assert "data.min_kept_fraction" in exc.value.hint
    assert not (tmp_path / "prepared").exists() and not list(tmp_path.glob(".prepared.tmp-*"))
    assert prepare(tmp_path, *sources, min_kept_fraction=0.0).kept == 7


# ------------------------------------------------------------------------------------------------ files and images


def test_non_files_are_refused_before_reading(tmp_path):
    with pytest.raises(ImageError) as exc:
        read_ref(Path("/dev/zero"))
    assert exc.value.reason == "not_a_file" and "character device" in exc.value.detail
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    with pytest.raises(ImageError) as exc:
        read_ref(fifo)  # would block forever if it were opened for reading
    assert exc.value.reason == "not_a_file" and "FIFO" in exc.value.detail
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(ImageError) as exc:
        read_ref(tmp_path / "folder.png")
    assert exc.value.reason == "missing_image" and "folder" in exc.value.detail
    with pytest.raises(DataError, match="not a regular file"):  # a FIFO as a data source is refused too
        list(read_source(DataSource(path=str(fifo), format="llava")))
    big = tmp_path / "big.png"
    big.write_bytes(b"\0" * 5000)
    with pytest.raises(ImageError) as exc:
        read_ref(big, max_bytes=4096)
    assert exc.value.reason == "image_too_large" and "MiB" in exc.value.detail


def test_dev_zero_as_an_image_is_rejected_per_sample(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({**record(0), "image": "/dev/zero"}) + "\n" + json.dumps(record(1)) + "\n")
    src = DataSource(path=str(tmp_path / "d.jsonl"), format="llava")
    out = list(read_source(src, media_roots=["/dev"]))
    assert out[0].reason == "not_a_file" and isinstance(out[1], Rejection) is False
    assert list(read_source(src))[0].reason == "outside_root"  # without media_roots it is not even looked at


def _png_header_only(width: int, height: int) -> bytes:
    import struct
    import zlib

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_huge_images_are_refused_from_the_header_without_a_bomb_warning(tmp_path, capfd):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for w, h in ((12_000, 12_000), (20_000, 20_000)):  # 144 MP (Pillow warns), 400 MP (Pillow refuses)
            with pytest.raises(ImageError) as exc:
                normalize_image(_png_header_only(w, h), max_pixels=64_000_000)
            assert exc.value.reason == "image_too_large"
        buf = io.BytesIO()
        Image.new("RGB", (100, 100)).save(buf, "PNG")
        with pytest.raises(ImageError, match="over data.max_image_pixels=5,000") as exc:
            normalize_image(buf.getvalue(), max_pixels=5000)
        assert normalize_image(buf.getvalue(), max_pixels=10_000).width == 100
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert "DecompressionBomb" not in "".join(capfd.readouterr())


def test_max_image_pixels_setting_through_prepare(tmp_path):
    png(tmp_path / "raw" / "img" / "a.png", size=(100, 100))
    (tmp_path / "raw" / "t.jsonl").write_text(json.dumps({**record(0), "image": "img/a.png"}) + "\n" + json.dumps(record(1)) + "\n")
    src = DataSource(path=str(tmp_path / "raw" / "t.jsonl"), format="llava")
    result = prepare(tmp_path, src, max_image_pixels=5000)
    assert result.rejected == {"image_too_large": 1} and result.kept == 1


# ------------------------------------------------------------------------------------------------ confinement


def test_paths_outside_the_data_are_refused(tmp_path):
    data = tmp_path / "data"
    png(data / "img" / "inside.png")
    outside = png(tmp_path / "elsewhere" / "outside.png", color=(0, 0, 200))
    (data / "img" / "link.png").symlink_to(outside)
    (data / "img" / "link_in.png").symlink_to(data / "img" / "inside.png")
    refs = {
        "inside": "img/inside.png", "abs_inside": str(data / "img" / "inside.png"), "link_in": "img/link_in.png",
        "dotdot": "../../../../../../../../etc/passwd", "abs": "/etc/passwd", "abs_png": str(outside),
        "file_url": f"file://{outside}", "link": "img/link.png",
    }
    (data / "t.jsonl").write_text("".join(json.dumps({**record(0), "id": k, "image": v}) + "\n" for k, v in refs.items()))
    src = DataSource(path=str(data / "t.jsonl"), format="llava")
    out = {x.id: x for x in read_source(src)}
    assert {k for k, x in out.items() if not isinstance(x, Rejection)} == {"inside", "abs_inside", "link_in"}
    for key in ("dotdot", "abs", "abs_png", "file_url", "link"):
        assert out[key].reason == "outside_root", key
        assert "add the folder to data.media_roots" in out[key].detail
    assert "symbolic link" in out["link"].detail
    # a folder listed in data.media_roots is allowed (symlinks resolved into it too)
    out = {x.id: x for x in read_source(src, media_roots=[tmp_path / "elsewhere"])}
    assert {k for k, x in out.items() if not isinstance(x, Rejection)} == {"inside", "abs_inside", "link_in", "abs_png", "file_url", "link"}


def test_media_roots_config_key_applies_to_prepare(tmp_path, capsys, write_config):
    outside = png(tmp_path / "shared" / "pic.png")
    (tmp_path / "proj" / "raw").mkdir(parents=True)
    (tmp_path / "proj" / "raw" / "t.jsonl").write_text(json.dumps({**record(0), "image": str(outside)}) + "\n" + json.dumps(record(1)) + "\n")
    cfg = write_config("data:\n  sources: [{path: raw/t.jsonl}]\n  val_ratio: 0\n  media_roots: [../shared]\n", tmp_path / "proj")
    code, out, err = run(["-c", str(cfg), "data", "prepare", "--num-proc", "1", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["totals"]["kept"] == 2
    code, out, err = run(["-c", str(cfg), "data", "prepare", "--num-proc", "1", "--json", "data.media_roots=[]"], capsys)
    assert code == 0, err
    assert json.loads(out)["totals"]["rejected"] == {"outside_root": 1}


# ------------------------------------------------------------------------------------------------ splits, duplicates


def test_prepare_with_every_sample_rejected_is_an_error(tmp_path, capsys, write_config):
    png(tmp_path / "proj" / "raw" / "img" / "a.png")
    (tmp_path / "proj" / "raw" / "t.jsonl").write_text("".join(json.dumps({**record(i), "image": "a.png"}) + "\n" for i in range(4)))
    cfg = write_config("data:\n  sources: [{path: raw/t.jsonl, image_root: raw/wrong}]\n  val_ratio: 0\n  min_kept_fraction: 0\n", tmp_path / "proj")
    code, out, err = run(["-c", str(cfg), "data", "prepare", "--num-proc", "1"], capsys)
    assert code == 1 and "every one of the 4 samples read was rejected (missing_image 4)" in err
    assert "train 0 samples" not in out and not (tmp_path / "proj" / "data" / "prepared").exists()


def test_duplicate_ids_are_flagged_and_name_the_earlier_sample(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    rows = [record(0), record(1), {**record(2), "id": "r0000"}, record(3), record(1)]  # id repeat; exact repeat
    (raw / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (raw / "other.jsonl").write_text(json.dumps({**record(9), "id": "r0000"}) + "\n")  # ids are per source
    sources = [DataSource(path=str(raw / "t.jsonl"), format="llava"), DataSource(path=str(raw / "other.jsonl"), format="llava")]
    result = prepare(tmp_path, *sources)
    assert result.rejected == {"duplicate": 1, "duplicate_id": 1} and result.kept == 4
    by_reason = {r["reason"]: r for r in rejected(tmp_path)}
    assert by_reason["duplicate_id"]["location"].endswith("t.jsonl:3") and "t.jsonl:1)" in by_reason["duplicate_id"]["detail"]
    assert by_reason["duplicate"]["location"].endswith("t.jsonl:5") and "t.jsonl:2)" in by_reason["duplicate"]["detail"]

    kept = prepare(tmp_path, *sources, duplicate_ids="keep")
    assert kept.rejected == {"duplicate": 1} and kept.kept == 5
    assert kept.manifest["totals"]["flagged"] == {"duplicate_id": 1}
    assert kept.manifest["sources"][0]["flagged"] == {"duplicate_id": 1}

    report = validate_data(DataSection(dedup=True), paths=[raw / "t.jsonl"], num_proc=1, progress=False)
    assert report.counts == {"duplicate_id": 1, "duplicate": 1}
    assert "earlier sample of this source (" in report.examples["duplicate_id"][0]["detail"]
    assert report.examples["duplicate_id"][0]["detail"].endswith("t.jsonl:1)")


def test_every_reason_code_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "formats.md").read_text()
    missing = [r for r in REASONS if f"`{r}`" not in doc]
    assert not missing, f"reason codes missing from docs/formats.md: {missing}"


# ------------------------------------------------------------------------------------------------ leftovers


def test_stale_temporary_folders_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".prepared.tmp-{dead.pid}"
    (stale / "train").mkdir(parents=True)
    (stale / "train" / "train-00000.parquet").write_bytes(b"x" * 1000)
    live = tmp_path / f".prepared.tmp-{os.getppid()}"  # a prepare still running elsewhere: left alone
    live.mkdir()
    (tmp_path / "raw.jsonl").write_text(json.dumps(record(0)) + "\n")
    prepare(tmp_path, DataSource(path=str(tmp_path / "raw.jsonl"), format="llava"))
    assert not stale.exists() and live.exists()


def test_disk_full_names_the_path_and_free_space(tmp_path, monkeypatch):
    from vlmctl.data import prepare as prep

    (tmp_path / "raw.jsonl").write_text(json.dumps(record(0)) + "\n")
    src = DataSource(path=str(tmp_path / "raw.jsonl"), format="llava")
    prepare(tmp_path, src)
    before = sorted(p.name for p in (tmp_path / "prepared").rglob("*"))

    def full(self, sample):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prep.ShardWriter, "add", full)
    with pytest.raises(DataError) as exc:
        prepare(tmp_path, src)
    assert "disk full while writing" in exc.value.message and "GiB free" in exc.value.message
    assert str(tmp_path) in exc.value.message
    assert sorted(p.name for p in (tmp_path / "prepared").rglob("*")) == before  # previous output intact
    assert not list(tmp_path.glob(".prepared.tmp-*"))


# ------------------------------------------------------------------------------------------------ tars, config


def test_tar_members_deep_or_too_large_are_rejected_alone(tmp_path, monkeypatch):
    from vlmctl.data.formats import webdataset

    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    conv = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        add(tar, "a.json", json.dumps(conv).encode())
        add(tar, "b.json", b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}")
        add(tar, "c.txt", b"caption")
        add(tar, "c.png", b"\x89PNG" + b"\0" * 3000)
        add(tar, "d.json", json.dumps(conv).encode())
    monkeypatch.setattr(webdataset, "MAX_MEMBER_BYTES", 2048)
    out = list(read_source(DataSource(path=str(tmp_path / "s.tar"), format="webdataset"), check=False))
    assert [getattr(x, "reason", "kept") for x in out] == ["kept", "too_deep", "too_large", "kept"]


def test_config_errors_never_echo_a_token():
    token = "hf_" + "aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bC1dE3"
    with pytest.raises(ConfigError) as exc:
        validate_config({"train": {"max_steps": token}, "data": {"val_ratio": "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MGFiY2RlZg=="}})
    msg = exc.value.message
    assert token not in msg and "Zm9vYmFy" not in msg
    assert "train.max_steps = '<hidden: 36 characters>'" in msg and "data.val_ratio" in msg
    with pytest.raises(ConfigError) as exc:  # plain values are still shown
        validate_config({"train": {"max_steps": "many"}})
    assert "train.max_steps = 'many'" in exc.value.message


# ------------------------------------------------------------------------------------------------ worker processes


@pytest.mark.skipif(sys.platform != "linux", reason="forked workers inherit the patched check (Linux's start method)")
def test_a_worker_process_that_dies_is_a_data_error_naming_the_samples_in_flight(tmp_path, monkeypatch):
    """A worker killed while checking (the kernel's OOM killer, a decoder crashing on a sample) reads as one DataError
    naming the samples that were being checked and the way to find the culprit, not the pool's exception."""
    from vlmctl.data import pipeline

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(record(i)) + "\n" for i in range(5 * pipeline.BATCH_SIZE)))
    real = pipeline.check_images

    def dies_on_one_sample(sample, **limits):
        if getattr(sample, "id", "") == "r0070":
            os._exit(9)  # as a process killed mid-sample ends: no exception, no cleanup
        return real(sample, **limits)

    monkeypatch.setattr(pipeline, "check_images", dies_on_one_sample)
    data = DataSection(sources=[DataSource(path=str(path))], prepared_dir=tmp_path / "prepared", val_ratio=0.0)
    with pytest.raises(DataError, match="a worker process checking samples died") as err:
        prepare_data(data, num_proc=2, progress=False)
    assert f"{path}:" in err.value.message and "data.num_proc=1" in err.value.hint
    assert not (tmp_path / "prepared").exists() or not any((tmp_path / "prepared").glob("*.parquet"))
