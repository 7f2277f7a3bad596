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

Reading is guarded (docs/security.md): `resolve_ref` with `MediaRoots` confines local paths, symlinks resolved, to
the folders a source may use (else reason `outside_root`); `read_ref` stats a path before opening it and reads only
regular files up to `MAX_IMAGE_FILE_BYTES` (`not_a_file`, `image_too_large`); `normalize_image` compares the
header's pixel count with `max_pixels` before decoding (`image_too_large`).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

# numpy and PIL are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not pay
# for them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

KEEP_FORMATS = ("JPEG", "PNG", "WEBP")
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""The Pillow formats vlmctl decodes (`Image.open(..., formats=IMAGE_FORMATS)`): the formats of `IMAGE_EXTENSIONS`
(Pillow's JPEG opener also reads MPO, the JPEG variant phones write). No other plugin is ever tried, so a file of another format under an image
name (e.g. PostScript as `.jpg`, which Pillow's EPS plugin hands to Ghostscript) is refused as corrupt_image
without running anything."""
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
MAX_IMAGE_FILE_BYTES = 512 << 20
"""Largest image file read (bytes): larger files are refused as image_too_large before reading. A 64-megapixel
image stored uncompressed in 16-bit RGB is 384 MiB."""


class ImageError(Exception):
    """A reason-coded image failure: `reason` is `missing_image`, `outside_root`, `not_a_file`, `corrupt_image` or
    `image_too_large`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class MissingRef:
    """An image reference that cannot be read locally (remote URL, unsupported scheme: `missing_image`; a path
    outside the allowed folders: `outside_root`). Reported with `reason` when checked."""

    ref: str
    detail: str
    reason: str = "missing_image"


@dataclass(frozen=True)
class MediaRoots:
    """Where the media paths of a source are resolved from (`base`) and the folders they may resolve into
    (`allowed`: real paths, symlinks resolved).

    `MediaRoots.of(base, [file's folder, image_root, *data.media_roots])` resolves every folder once.
    """

    base: Path
    allowed: tuple[Path, ...]

    @classmethod
    def of(cls, base: Path, folders: Iterable[Path | str | None]) -> "MediaRoots":
        allowed: list[Path] = []
        for folder in folders:
            if folder is None:
                continue
            real = Path(os.path.realpath(Path(folder).expanduser()))
            if real not in allowed:
                allowed.append(real)
        return cls(Path(base), tuple(allowed))

    def confine(self, path: Path, shown: str) -> Path | MissingRef:
        """The real path of `path` when it lies inside an allowed folder, else a MissingRef with reason
        outside_root whose detail says how to allow it. `shown` is the reference as the record wrote it."""
        real = Path(os.path.realpath(path))
        if any(real == root or real.is_relative_to(root) for root in self.allowed):
            return real
        via = f" (through a symbolic link: {path} -> {real})" if real != Path(os.path.abspath(path)) else ""
        return MissingRef(
            shown,
            f"{shown} resolves to {real}{via}, outside the source's folders ({', '.join(map(str, self.allowed))}); "
            f"add the folder to data.media_roots to allow it (e.g. data.media_roots: [{real.parent}])",
            "outside_root",
        )


@dataclass
class NormalizedImage:
    data: bytes  # encoded 8-bit RGB image
    width: int  # pixels
    height: int  # pixels
    conversion: str | None  # None when the original bytes were kept; else what was done, e.g. "CMYK->RGB"


def resolve_ref(value: str, base: Path | MediaRoots) -> bytes | Path | MissingRef:
    """Turn an image reference from a record into bytes (data: URL), a local Path, or a MissingRef.

    Accepts paths relative to the base folder, absolute paths, `file://` URLs and base64 `data:` URLs (RFC 2397).
    Invalid base64 gives empty bytes, which the check stage reports as corrupt_image. With `MediaRoots` local
    paths must resolve (symlinks included) inside its allowed folders: the real path is returned, or a MissingRef
    with reason outside_root; with a plain Path there is no confinement.
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
    roots = base if isinstance(base, MediaRoots) else None
    folder = roots.base if roots is not None else Path(base)
    problem = _unusable_path(value)
    if problem:
        return MissingRef(ascii(value), f"the path {ascii(value)} {problem}")
    if value.startswith("file://"):
        from urllib.parse import unquote, urlparse

        path = Path(unquote(urlparse(value).path))
    elif "://" in value:
        return MissingRef(value, f"remote image {value} is not downloaded; download it and reference the local file")
    else:
        path = Path(value).expanduser()
        path = path if path.is_absolute() else folder / path
    problem = _unusable_path(str(path))
    if problem:
        return MissingRef(ascii(value), f"the path {ascii(str(path))} {problem}")
    return roots.confine(path, value) if roots is not None else path


def _unusable_path(text: str) -> str | None:
    """Why `text` cannot name a file (a NUL byte, a character the file system encoding cannot hold), or None."""
    if "\0" in text:
        return "holds a NUL byte, which no file name can"
    try:
        os.fsencode(text)
    except UnicodeError:
        return "holds a character no file name can (a lone surrogate)"
    return None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO (named pipe)"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _too_big(what: str, size: int, limit: int) -> ImageError:
    return ImageError("image_too_large", f"{what} is {size / 2**20:,.1f} MiB, over the limit of {limit >> 20} MiB per image file")


def read_ref(ref: bytes | Path | MissingRef, *, max_bytes: int = MAX_IMAGE_FILE_BYTES) -> bytes:
    """Bytes of a resolved reference.

    A path is checked before it is read (`os.stat`): it must be a regular file of at most `max_bytes`; it is then
    opened without blocking and checked again on the open file, so a device, FIFO or socket is never read.
    Raises ImageError: missing_image (no such file, a folder, unreadable), not_a_file (device, FIFO, socket),
    image_too_large (over `max_bytes`), or the MissingRef's reason.
    """
    if isinstance(ref, (bytes, bytearray, memoryview)):
        if len(ref) > max_bytes:
            raise _too_big("the embedded image", len(ref), max_bytes)
        return bytes(ref)
    if isinstance(ref, MissingRef):
        raise ImageError(ref.reason, ref.detail)
    path = Path(ref)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise ImageError("missing_image", f"{ref} does not exist") from None
    except OSError as exc:
        raise ImageError("missing_image", f"{ref} cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ImageError("missing_image", f"{ref} is a folder, not an image file")
    if not stat.S_ISREG(st.st_mode):
        raise ImageError("not_a_file", f"{ref} is a {_kind(st.st_mode)}, not a regular file")
    if st.st_size > max_bytes:
        raise _too_big(str(ref), st.st_size, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise ImageError("missing_image", f"{ref} cannot be read: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())  # the file actually opened (it may have been replaced since the stat)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError("not_a_file", f"{ref} is a {_kind(st.st_mode)}, not a regular file")
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ImageError("missing_image", f"{ref} cannot be read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise _too_big(str(ref), len(data), max_bytes)
    return data


def open_image(data: bytes):
    """`PIL.Image.open` on the bytes `data`, trying only the formats of `IMAGE_FORMATS`. Raises
    PIL.UnidentifiedImageError for anything else."""
    from PIL import Image

    return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)


def normalize_image(data: bytes, *, max_pixels: int | None = None) -> NormalizedImage:
    """Fully decode `data` and return 8-bit RGB encoded bytes with the picture's size.

    `max_pixels` (width x height, from the header, checked before decoding): larger images raise
    ImageError(image_too_large). Pillow's DecompressionBombWarning is silenced (this limit decides); its hard
    limit (2x `PIL.Image.MAX_IMAGE_PIXELS`, about 179 megapixels) also gives image_too_large.
    Raises ImageError(corrupt_image) for bytes that are not an image, truncated or otherwise undecodable files.
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("corrupt_image", "empty file")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = open_image(data)
            fmt = im.format
            width, height = im.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageError(
                    "image_too_large",
                    f"{width}x{height} = {width * height / 1e6:,.1f} megapixels, over data.max_image_pixels={max_pixels:,}",
                )
            # The raw mode of the first tile tells the stored bit depth (e.g. "RGB;16B" for a 48-bit PNG); it is
            # gone after load().
            args = im.tile[0].args if im.tile else None
            rawmode = str(args[0] if isinstance(args, tuple) and args else args or "")
            im.load()
        except ImageError:
            raise
        except UnidentifiedImageError:
            raise ImageError("corrupt_image", f"not an image in a format vlmctl reads ({', '.join(IMAGE_FORMATS)})") from None
        except Image.DecompressionBombError as exc:
            raise ImageError("image_too_large", f"too many pixels: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any decoder failure (OSError, struct.error, IndexError, ...) costs one sample
            raise ImageError("corrupt_image", f"cannot decode: {type(exc).__name__}: {exc}") from None

    orientation = _orientation(im)
    sixteen = ";16" in rawmode or rawmode.endswith("16")
    if fmt in KEEP_FORMATS and im.mode == "RGB" and orientation in (0, 1) and not sixteen and not getattr(im, "is_animated", False):
        return NormalizedImage(data, im.width, im.height, None)

    mode = im.mode
    conversion = f"{mode}{' 16-bit' if sixteen else ''}->RGB"
    frames = getattr(im, "n_frames", 1)
    if getattr(im, "is_animated", False) and frames > 1:  # reported in the manifest's `converted` counts
        conversion = f"animated {conversion}, the first of {frames} frames kept"
    try:
        if orientation not in (0, 1):
            from PIL import ImageOps

            im = ImageOps.exif_transpose(im)
            conversion += f", EXIF orientation {orientation}"
        rgb = to_rgb(im)
    except Exception as exc:  # noqa: BLE001 - one sample, never the run
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

