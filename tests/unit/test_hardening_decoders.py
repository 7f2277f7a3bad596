"""Images are decoded with an explicit allow-list of Pillow formats: no plugin outside it runs (EPS would start
Ghostscript), and every decoder failure is one rejected sample with its reason code, never the end of the run."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from PIL import EpsImagePlugin, Image, ImageFile, UnidentifiedImageError

from vlmctl.config.data import DataSection, DataSource
from vlmctl.data.images import IMAGE_FORMATS, ImageError, normalize_image
from vlmctl.data.modalities.image import decode_images, image_size
from vlmctl.data.prepare import prepare_data

EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\n"
       b"newpath 0 0 moveto 32 32 lineto stroke\nshowpage\n%%EOF\n")


def encoded(fmt: str, mode: str = "RGB", size=(40, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 120).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture
def fake_ghostscript(tmp_path, monkeypatch) -> Path:
    """A `gs` on PATH that records every call: any use of Pillow's EPS plugin shows up in the log."""
    log = tmp_path / "gs-calls.log"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    gs = bindir / "gs"
    gs.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\nexit 1\n")
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)  # look for gs again
    return log


def test_eps_named_jpg_is_rejected_without_running_ghostscript(tmp_path, fake_ghostscript):
    raw = tmp_path / "raw"
    (raw / "images").mkdir(parents=True)
    (raw / "images" / "evil.jpg").write_bytes(EPS)
    records = [{"id": "evil", "image": "images/evil.jpg", "conversations": [{"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]}]
    for i in range(5):
        (raw / "images" / f"{i}.png").write_bytes(encoded("PNG", size=(40 + i, 32)))
        records.append({"id": f"ok{i}", "image": f"images/{i}.png", "conversations": [{"from": "human", "value": f"<image>\nq{i}"}, {"from": "gpt", "value": "a"}]})
    (raw / "data.json").write_text(json.dumps(records))
    data = DataSection(sources=[DataSource(path=str(raw / "data.json"), format="llava")], prepared_dir=tmp_path / "prepared", val_ratio=0.0)
    result = prepare_data(data, num_proc=1, progress=False)
    assert result.kept == 5 and result.rejected == {"corrupt_image": 1}
    (row,) = [json.loads(line) for line in (tmp_path / "prepared" / "rejected.jsonl").read_text().splitlines()]
    assert row["reason"] == "corrupt_image" and "format vlmctl reads" in row["detail"]
    assert not fake_ghostscript.exists(), "Pillow's EPS plugin started Ghostscript"


def test_every_reader_uses_the_allow_list(fake_ghostscript):
    with pytest.raises(UnidentifiedImageError):
        decode_images([EPS])
    with pytest.raises(UnidentifiedImageError):
        image_size(EPS)
    assert not fake_ghostscript.exists()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_allowed_formats_decode(fmt):
    assert fmt in IMAGE_FORMATS
    out = normalize_image(encoded(fmt))
    assert (out.width, out.height) == (40, 32)


@pytest.mark.parametrize("fmt", ["PPM", "TGA", "PCX", "ICO"])
def test_formats_outside_the_list_are_corrupt_image(fmt):
    with pytest.raises(ImageError) as err:
        normalize_image(encoded(fmt, size=(32, 32)))
    assert err.value.reason == "corrupt_image"


@pytest.mark.parametrize("exc", [IndexError("tile"), TypeError("bad"), MemoryError(), RuntimeError("decoder")])
def test_any_decoder_error_is_a_reason_coded_rejection(monkeypatch, exc):
    def broken(self):
        raise exc

    monkeypatch.setattr(ImageFile.ImageFile, "load", broken)
    with pytest.raises(ImageError) as err:
        normalize_image(encoded("PNG"))
    assert err.value.reason == "corrupt_image" and type(exc).__name__ in err.value.detail


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_an_unexpected_clip_decoder_error_is_that_samples_rejection(monkeypatch, kind):
    from vlmctl.data import checks
    from vlmctl.data.modalities import audio as audio_mod
    from vlmctl.data.modalities import video as video_mod
    from vlmctl.data.sample import Sample

    module = video_mod if kind == "video" else audio_mod

    def broken(data, settings=None):
        raise AssertionError("encoder invariant")  # e.g. libFLAC's assertion on a NaN sample

    monkeypatch.setattr(module, f"normalize_{kind}", broken)
    sample = Sample(id="s", messages=[{"role": "user", "content": [{"type": kind, "index": 0}, {"type": "text", "text": "q"}]},
                                      {"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
                    images=[], **{f"{kind}s": [b"\0" * 64]})
    out = checks.check_images(sample)
    assert isinstance(out, checks.Rejection) and out.reason == f"corrupt_{kind}" and "AssertionError" in out.detail


def test_an_animated_image_is_flagged_as_reduced_to_its_first_frame(tmp_path):
    frames = [Image.new("RGB", (40, 32), (i * 60, 0, 0)) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100)
    out = normalize_image(buf.getvalue())
    assert out.conversion.startswith("animated ") and "first of 3 frames" in out.conversion
    assert Image.open(io.BytesIO(out.data)).getpixel((0, 0)) == (0, 0, 0)  # frame 0
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.gif").write_bytes(buf.getvalue())
    (raw / "d.json").write_text(json.dumps([{"id": "a", "image": "a.gif", "conversations": [{"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]}]))
    data = DataSection(sources=[DataSource(path=str(raw / "d.json"), format="llava")], prepared_dir=tmp_path / "prepared", val_ratio=0.0)
    converted = prepare_data(data, num_proc=1, progress=False).manifest["images"]["converted"]
    assert converted == {"animated P->RGB": 1}


def test_a_video_whose_header_lies_about_its_duration_is_timed_by_its_frames():
    import struct

    pytest.importorskip("av")
    from video_data import moving_square

    from vlmctl.data import checks
    from vlmctl.data.modalities.video import normalize_video, probe
    from vlmctl.data.sample import Sample

    data = bytearray(moving_square(16, fps=8, container="matroska", codec="mpeg4"))  # 2 s
    at = data.find(b"\x44\x89")  # Matroska's Duration element (8-byte float, in TimestampScale units: ms)
    assert at > 0 and data[at + 2] == 0x88
    data[at + 3:at + 11] = struct.pack(">d", 600_000.0)  # the header now says 600 s
    info = probe(bytes(data))
    assert info.seconds == pytest.approx(2.0) and info.declared == pytest.approx(600.0)
    clip = normalize_video(bytes(data))
    assert clip.seconds == pytest.approx(2.0) and "the header says 600.00 s" in clip.conversion
    sample = Sample(id="v", messages=[{"role": "user", "content": [{"type": "video", "index": 0}, {"type": "text", "text": "q"}]},
                                      {"role": "assistant", "content": [{"type": "text", "text": "a"}]}], images=[], videos=[bytes(data)])
    _, info = checks.check_images(sample)
    assert info.videos[0].retimed and info.videos[0].seconds == pytest.approx(2.0)
