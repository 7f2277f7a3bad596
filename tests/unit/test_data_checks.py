"""Every reason code planted in one source, every odd image mode converted correctly, valid samples intact."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmctl.config.data import DataSection, DataSource
from vlmctl.data.checks import REASONS, DigestSet, build_sample, is_val
from vlmctl.data.images import ImageError, normalize_image
from vlmctl.data.prepare import prepare_data
from vlmctl.data.sample import Sample


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def png16(arr: np.ndarray) -> bytes:
    """A 16-bit PNG (gray, gray+alpha, RGB or RGBA by channel count) written by hand: Pillow cannot write 48-bit."""
    h, w, c = arr.shape
    color_type = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def gradient(w: int = 48, h: int = 40) -> np.ndarray:
    x = np.linspace(0, 255, w)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h)[:, None].repeat(w, 1)
    return np.stack([x, y, 255 - x], -1).round().astype(np.uint8)


def odd_images() -> dict[str, tuple[bytes, np.ndarray, int]]:
    """name -> (encoded bytes, expected RGB pixels, tolerance)."""
    rgb = gradient()
    out: dict[str, tuple[bytes, np.ndarray, int]] = {}
    # CMYK JPEG: expected = Pillow's CMYK->RGB of the decoded CMYK pixels (no ICC profile embedded)
    cmyk = Image.fromarray(rgb).convert("CMYK")
    data = encode(cmyk, "JPEG", quality=100)
    out["cmyk_jpeg"] = (data, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), 3)
    # palette PNG with a transparent entry: transparent pixels must become white
    pal = Image.new("P", (40, 32))
    pal.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    arr = np.zeros((32, 40), np.uint8)
    arr[:, 20:] = 1
    pal.putdata(arr.flatten().tolist())
    expected = np.zeros((32, 40, 3), np.uint8)
    expected[:, :20] = (255, 255, 255)  # index 0 is transparent
    expected[:, 20:] = (0, 0, 255)
    out["palette_png"] = (encode(pal, "PNG", transparency=0), expected, 0)
    # RGBA: half-transparent red over white = (255, 127/128, 127/128); fully transparent = white
    rgba = np.zeros((32, 40, 4), np.uint8)
    rgba[:, :20] = (255, 0, 0, 128)
    rgba[:, 20:] = (0, 255, 0, 0)
    expected = np.zeros((32, 40, 3), np.uint8)
    expected[:, :20] = (255, 127, 127)
    expected[:, 20:] = (255, 255, 255)
    out["rgba_png"] = (encode(Image.fromarray(rgba, "RGBA"), "PNG"), expected, 1)
    # grayscale L
    gray = rgb[..., 0]
    out["gray_png"] = (encode(Image.fromarray(gray, "L"), "PNG"), np.repeat(gray[..., None], 3, -1), 0)
    # 16-bit grayscale PNG: v8 = round(v16 / 257); a naive convert("RGB") would give white
    g16 = (np.arange(32 * 40).reshape(32, 40, 1) * 51).astype(np.uint16)
    g8 = np.rint(g16[..., 0] / 257.0).astype(np.uint8)
    out["gray16_png"] = (png16(g16), np.repeat(g8[..., None], 3, -1), 0)
    # 16-bit RGB PNG: stored 8-bit afterwards, high byte kept
    c16 = rgb.astype(np.uint16) * 257
    out["rgb16_png"] = (png16(c16), rgb, 0)
    return out


def test_normalize_keeps_8bit_rgb_bytes_and_converts_odd_modes():
    rgb = gradient()
    for fmt in ("JPEG", "PNG", "WEBP"):
        data = encode(Image.fromarray(rgb), fmt)
        norm = normalize_image(data)
        assert norm.data == data and norm.conversion is None and (norm.width, norm.height) == (48, 40)
    for name, (data, expected, tol) in odd_images().items():
        norm = normalize_image(data)
        assert norm.conversion is not None, name
        out = Image.open(io.BytesIO(norm.data))
        assert out.mode == "RGB" and ";16" not in str(out.tile[0].args), name
        got = np.asarray(out).astype(int)
        assert got.shape == expected.shape, name
        assert np.abs(got - expected.astype(int)).max() <= tol, name


def test_exif_orientation_is_applied():
    im = Image.fromarray(gradient(48, 30))
    exif = im.getexif()
    exif[0x0112] = 6  # rotated 90 degrees clockwise
    data = encode(im, "JPEG", exif=exif.tobytes())
    norm = normalize_image(data)
    assert (norm.width, norm.height) == (30, 48) and "EXIF" in norm.conversion


@pytest.mark.parametrize("data", [b"", b"definitely not an image", None])
def test_corrupt_images_are_reason_coded(data):
    if data is None:  # a truncated JPEG: the header parses, full decoding must fail
        full = encode(Image.fromarray(gradient(200, 200)), "JPEG")
        data = full[: len(full) // 2]
    with pytest.raises(ImageError) as exc:
        normalize_image(data)
    assert exc.value.reason == "corrupt_image"


def test_build_sample_prepends_images_without_placeholders():
    s = build_sample([("human", "Describe."), ("gpt", "A cat.")], images=[b"x"], id="a", source="s", location="f:1")
    assert isinstance(s, Sample)
    assert s.messages[0]["content"] == [{"type": "image", "index": 0}, {"type": "text", "text": "Describe."}]
    r = build_sample([("user", "<image><image> two?"), ("assistant", "one")], images=[b"x"], id="b", source="s", location="f:2")
    assert r.reason == "placeholder_mismatch" and "2 <image>" in r.detail


def test_digest_set_and_split_are_deterministic():
    seen = DigestSet(capacity=4)
    digests = [bytes([i % 256, i // 256]) * 8 for i in range(1000)]
    assert all(seen.add(d) for d in digests)  # grows past its initial capacity
    assert not any(seen.add(d) for d in digests) and len(seen) == 1000
    frac = sum(is_val(d, 0.25) for d in (bytes([i]) * 16 for i in range(256))) / 256
    assert 0.15 < frac < 0.35


def _write_defect_source(root: Path) -> tuple[DataSource, dict[str, str], dict[str, np.ndarray]]:
    """A LLaVA JSON with one sample per defect and one valid sample per odd image mode.

    Returns the source, {id: expected reason} for the planted defects, and {id: expected pixels} for valid ones.
    """
    img = root / "img"
    img.mkdir(parents=True)
    good = gradient()
    (img / "good.png").write_bytes(encode(Image.fromarray(good), "PNG"))
    (img / "tiny.png").write_bytes(encode(Image.fromarray(gradient(20, 60)), "PNG"))
    full = encode(Image.fromarray(gradient(200, 200)), "JPEG")
    (img / "truncated.jpg").write_bytes(full[: len(full) // 2])
    (img / "text.jpg").write_bytes(b"this is a text file with a .jpg name")
    expected_pixels = {"good": good}
    records = [
        {"id": "good", "image": "img/good.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Good."}]},
        {"id": "missing", "image": "img/nope.png", "conversations": [{"from": "human", "value": "<image> A?"}, {"from": "gpt", "value": "B."}]},
        {"id": "truncated", "image": "img/truncated.jpg", "conversations": [{"from": "human", "value": "<image> A?"}, {"from": "gpt", "value": "B."}]},
        {"id": "notimage", "image": "img/text.jpg", "conversations": [{"from": "human", "value": "<image> A?"}, {"from": "gpt", "value": "B."}]},
        {"id": "small", "image": "img/tiny.png", "conversations": [{"from": "human", "value": "<image> A?"}, {"from": "gpt", "value": "B."}]},
        {"id": "mismatch", "image": "img/good.png", "conversations": [{"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "B."}]},
        {"id": "empty", "image": "img/good.png", "conversations": [{"from": "human", "value": "<image> A?"}, {"from": "gpt", "value": "   "}]},
        {"id": "endsuser", "conversations": [{"from": "human", "value": "A?"}, {"from": "gpt", "value": "B."}, {"from": "human", "value": "C?"}]},
        {"id": "twice", "conversations": [{"from": "human", "value": "A?"}, {"from": "human", "value": "B?"}, {"from": "gpt", "value": "C."}]},
        {"id": "dup", "image": "img/good.png", "conversations": [{"from": "human", "value": "<image>\n  What?"}, {"from": "gpt", "value": "Good."}]},
        {"id": "noplaceholder", "image": "img/good.png", "conversations": [{"from": "human", "value": "Describe it."}, {"from": "gpt", "value": "A gradient."}]},
        {"id": "badshape", "conversations": "not a list"},
    ]
    expected_pixels["noplaceholder"] = good
    for name, (data, pixels, _tol) in odd_images().items():
        ext = "jpg" if "jpeg" in name else "png"
        (img / f"{name}.{ext}").write_bytes(data)
        records.append({"id": name, "image": f"img/{name}.{ext}", "conversations": [{"from": "human", "value": f"<image> {name}?"}, {"from": "gpt", "value": "yes"}]})
        expected_pixels[name] = pixels
    text = json.dumps(records, indent=1)
    (root / "train.json").write_text(text)
    # JSONL with a malformed line: parse_error at file:line, reading goes on
    (root / "extra.jsonl").write_text(
        json.dumps({"id": "jl1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}) + "\n"
        + '{"id": "broken", "conversations": [\n'
        + json.dumps({"id": "jl3", "conversations": [{"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye"}]}) + "\n"
    )
    reasons = {
        "missing": "missing_image", "truncated": "corrupt_image", "notimage": "corrupt_image", "small": "image_too_small",
        "mismatch": "placeholder_mismatch", "empty": "empty_turn", "endsuser": "bad_roles", "twice": "bad_roles",
        "dup": "duplicate", "badshape": "parse_error",
    }
    return DataSource(path=str(root / "train.json"), format="llava"), reasons, expected_pixels


def test_prepare_rejects_every_planted_defect_and_keeps_correct_pixels(tmp_path):
    import datasets

    src, reasons, pixels = _write_defect_source(tmp_path / "raw")
    jsonl = DataSource(path=str(tmp_path / "raw" / "extra.jsonl"), format="llava")
    data = DataSection(sources=[src, jsonl], prepared_dir=tmp_path / "prepared", val_ratio=0.0,
                       min_kept_fraction=0.0)  # most records are planted defects
    result = prepare_data(data, num_proc=1, progress=False)

    rejected = [json.loads(line) for line in (tmp_path / "prepared" / "rejected.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r for r in rejected if r["id"]}
    assert {i: by_id[i]["reason"] for i in reasons} == reasons
    assert set(by_id) == set(reasons)  # nothing valid was rejected
    parse = [r for r in rejected if r["location"].endswith("extra.jsonl:2")]
    assert len(parse) == 1 and parse[0]["reason"] == "parse_error"
    assert by_id["badshape"]["location"].split(":")[-1].isdigit()
    assert all(r["reason"] in REASONS for r in rejected)
    assert result.manifest["totals"]["rejected"]["corrupt_image"] == 2

    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "prepared"), split="train")
    rows = {r["id"]: r for r in ds}
    assert set(rows) == set(pixels) | {"jl1", "jl3"}
    for sid, expected in pixels.items():
        got = np.asarray(rows[sid]["images"][0]).astype(int)
        tol = 3 if "jpeg" in sid else 1
        assert rows[sid]["images"][0].mode == "RGB", sid
        assert got.shape == expected.shape and np.abs(got - expected.astype(int)).max() <= tol, sid
    # the no-placeholder sample got its image prepended to the first user turn
    first = rows["noplaceholder"]["messages"][0]["content"]
    assert first[0]["type"] == "image" and first[1]["text"] == "Describe it."
    # original bytes of an 8-bit RGB PNG are kept as they are
    raw = pq_first_image(tmp_path / "prepared", "good")
    assert raw == (tmp_path / "raw" / "img" / "good.png").read_bytes()


def pq_first_image(prepared: Path, sid: str) -> bytes:
    import pyarrow.parquet as pq

    for f in sorted((prepared / "train").glob("*.parquet")):
        for row in pq.read_table(f).to_pylist():
            if row["id"] == sid:
                return Sample.from_row(row).images[0]
    raise KeyError(sid)
