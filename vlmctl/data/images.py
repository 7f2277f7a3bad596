"""Image decoding and normalization to 8-bit RGB.

`normalize_image(data)` fully decodes one encoded image (so truncated files fail here, not in training) and
returns bytes that every consumer can decode to the same 8-bit RGB picture:

- 8-bit RGB JPEG/PNG/WebP without an EXIF rotation are kept byte for byte (no re-encoding, no quality loss);
- everything else is converted and re-encoded: JPEG sources as JPEG (quality 95, no chroma subsampling),
  all others as PNG (lossless).

Conversions (the cases where a plain `Image.convert("RGB")` is wrong or lossy):

| mode | conversion |
|---|---|
| `CMYK` | through the embedded ICC profile to sRGB when there is one, else Pillow's CMYK->RGB |
| `P`, `PA` | palette expanded; transparent entries composited on white |
| `RGBA`, `LA`, `RGBa`, `La` | alpha composited on white (transparent pixels become white, not black) |
| `L`, `1` | gray replicated to three channels |
| `I;16*`, `I` (16-bit gray PNG/TIFF) | scaled to 8 bit (`round(v / 257)`); `convert("RGB")` would clip to white |
| 16-bit RGB(A) PNG | Pillow reads the high byte; re-encoded so the stored file is 8-bit |
| `F` (float) | values in [0, 1] scaled by 255, others clipped to [0, 255] |
| EXIF orientation 2..8 | pixels transposed upright, orientation tag dropped |

Reference for the 16-bit scaling: the PNG specification, section 12.5 "Sample depth scaling"
(https://www.w3.org/TR/png/#13Sample-depth-rescaling): v8 = round(v16 * 255 / 65535).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path

KEEP_FORMATS = ("JPEG", "PNG", "WEBP")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")


class ImageError(Exception):
    """A reason-coded image failure: `reason` is `missing_image` or `corrupt_image`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class MissingRef:
    """An image reference that cannot be read locally (remote URL, unsupported scheme). Checked as missing_image."""

    ref: str
    detail: str


@dataclass
class NormalizedImage:
    data: bytes  # encoded 8-bit RGB image
    width: int  # pixels
    height: int  # pixels
    conversion: str | None  # None when the original bytes were kept; else what was done, e.g. "CMYK->RGB"


def resolve_ref(value: str, base: Path) -> bytes | Path | MissingRef:
    """Turn an image reference from a record into bytes (data: URL), a local Path, or a MissingRef.

    Accepts paths relative to `base`, absolute paths, `file://` URLs and base64 `data:` URLs (RFC 2397).
    Invalid base64 gives empty bytes, which the check stage reports as corrupt_image.
    """
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        if ";base64" not in header:
            from urllib.parse import unquote_to_bytes

            return unquote_to_bytes(payload)
        try:
            return base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError):
            return b""
    if value.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(value).path))
    if "://" in value:
        return MissingRef(value, f"remote image {value} is not downloaded; download it and reference the local file")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def read_ref(ref: bytes | Path | MissingRef) -> bytes:
    """Bytes of a resolved reference. Raises ImageError(missing_image)."""
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return bytes(ref)
    if isinstance(ref, MissingRef):
        raise ImageError("missing_image", ref.detail)
    try:
        return Path(ref).read_bytes()
    except FileNotFoundError:
        raise ImageError("missing_image", f"{ref} does not exist") from None
    except IsADirectoryError:
        raise ImageError("missing_image", f"{ref} is a folder, not an image file") from None
    except OSError as exc:
        raise ImageError("missing_image", f"{ref} cannot be read: {exc.strerror or exc}") from None


def normalize_image(data: bytes) -> NormalizedImage:
    """Fully decode `data` and return 8-bit RGB encoded bytes with the picture's size.

    Raises ImageError(corrupt_image) for bytes that are not an image, truncated or otherwise undecodable files,
    and decompression bombs (more than 2x `PIL.Image.MAX_IMAGE_PIXELS`).
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("corrupt_image", "empty file")
    try:
        im = Image.open(io.BytesIO(data))
        fmt = im.format
        # The raw mode of the first tile tells the stored bit depth (e.g. "RGB;16B" for a 48-bit PNG); it is
        # gone after load().
        args = im.tile[0].args if im.tile else None
        rawmode = str(args[0] if isinstance(args, tuple) and args else args or "")
        im.load()
    except UnidentifiedImageError:
        raise ImageError("corrupt_image", "not an image (unknown file format)") from None
    except Image.DecompressionBombError as exc:
        raise ImageError("corrupt_image", f"too many pixels: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError("corrupt_image", f"cannot decode: {exc}") from None

    orientation = _orientation(im)
    sixteen = ";16" in rawmode or rawmode.endswith("16")
    if fmt in KEEP_FORMATS and im.mode == "RGB" and orientation in (0, 1) and not sixteen and not getattr(im, "is_animated", False):
        return NormalizedImage(data, im.width, im.height, None)

    mode = im.mode
    conversion = f"{mode}{' 16-bit' if sixteen else ''}->RGB"
    try:
        if orientation not in (0, 1):
            from PIL import ImageOps

            im = ImageOps.exif_transpose(im)
            conversion += f", EXIF orientation {orientation}"
        rgb = to_rgb(im)
    except (OSError, ValueError) as exc:
        raise ImageError("corrupt_image", f"cannot convert mode {mode} to RGB: {exc}") from None
    out = io.BytesIO()
    if fmt == "JPEG":
        rgb.save(out, "JPEG", quality=95, subsampling=0)
    else:
        # compress_level 1: these files are stored in shards that are compressed again; speed matters more.
        rgb.save(out, "PNG", compress_level=1)
    return NormalizedImage(out.getvalue(), rgb.width, rgb.height, conversion)


def to_rgb(im):
    """Convert a loaded PIL image of any mode to 8-bit RGB (see the module docstring for the rules)."""
    import numpy as np
    from PIL import Image

    mode = im.mode
    if mode == "RGB":
        return im
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        arr = np.asarray(im).astype(np.float64)
        # 16-bit samples (PNG, TIFF): scale 0..65535 to 0..255 (PNG spec 12.5). Pillow opens 16-bit PNGs as I;16
        # and some readers as I (32-bit); both hold 16-bit values.
        gray = np.clip(np.rint(arr * 255.0 / 65535.0), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, "L").convert("RGB")
    if mode == "F":
        arr = np.asarray(im).astype(np.float64)
        arr = arr * 255.0 if arr.size and np.nanmax(arr) <= 1.0 else arr
        return Image.fromarray(np.clip(np.nan_to_num(np.rint(arr)), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode == "CMYK":
        return _cmyk_to_rgb(im)
    if mode == "P" or mode == "PA":
        has_alpha = mode == "PA" or "transparency" in im.info
        im = im.convert("RGBA" if has_alpha else "RGB")
        return _on_white(im) if has_alpha else im
    if mode in ("RGBA", "LA", "RGBa", "La"):
        return _on_white(im.convert("RGBA"))
    if mode in ("L", "1"):
        if "transparency" in im.info:
            return _on_white(im.convert("RGBA"))
        return im.convert("L").convert("RGB")
    return im.convert("RGB")  # YCbCr, LAB, HSV: Pillow's conversions are exact enough


def _on_white(rgba):
    from PIL import Image

    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _cmyk_to_rgb(im):
    profile = im.info.get("icc_profile")
    if profile:
        try:
            from PIL import ImageCms

            src = ImageCms.ImageCmsProfile(io.BytesIO(profile))
            return ImageCms.profileToProfile(im, src, ImageCms.createProfile("sRGB"), outputMode="RGB")
        except Exception:  # noqa: BLE001 - a broken profile falls back to the plain conversion
            pass
    return im.convert("RGB")


def _orientation(im) -> int:
    try:
        return int(im.getexif().get(0x0112, 0) or 0)
    except Exception:  # noqa: BLE001 - unreadable EXIF: treat as upright
        return 0

