"""Tiny real videos for the video tests, encoded with PyAV in the test itself: a square moving across the frame,
plus defective files, one per reason code."""

from __future__ import annotations

import io

import numpy as np


def moving_square(frames: int = 8, width: int = 64, height: int = 48, fps: int = 8, *, codec: str = "libx264",
                  container: str = "mp4") -> bytes:
    """An encoded clip of `frames` frames [height, width]: a red 16 px square moving right one step per frame on
    black (yuv420p, so sides must be even)."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as c:
        stream = c.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(square_frame(i, frames, width, height), format="rgb24")):
                c.mux(packet)
        for packet in stream.encode():
            c.mux(packet)
    return out.getvalue()


def square_frame(i: int, frames: int, width: int, height: int) -> np.ndarray:
    """Frame `i` of `moving_square`: [height, width, 3] uint8."""
    a = np.zeros((height, width, 3), np.uint8)
    x = i * (width - 16) // max(1, frames - 1)
    a[8:24, x:x + 16] = (255, 0, 0)
    return a


def square_x(frame: np.ndarray) -> float:
    """Horizontal centre (in fractions of the width) of the red square of a decoded frame [H, W, 3]."""
    red = (frame[..., 0].astype(int) > 128) & (frame[..., 1].astype(int) < 100)
    cols = np.nonzero(red.any(axis=0))[0]
    return float(cols.mean() + 0.5) / frame.shape[1]


def unknown_codec() -> bytes:
    """A Matroska file whose video track names a codec FFmpeg has no decoder for (its codec id patched)."""
    data = moving_square(container="matroska", codec="mpeg4")
    assert b"V_MPEG4/ISO/ASP" in data
    return data.replace(b"V_MPEG4/ISO/ASP", b"V_XYZW4/ISO/ASP")


def png_bytes(side: int = 32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (0, 128, 0)).save(buf, "PNG")
    return buf.getvalue()


def rotated(data: bytes, quarter_turns_clockwise: int = 1) -> bytes:
    """An MP4 clip whose track header's display matrix says: show the frames turned 90 degrees clockwise (what
    phones write for portrait video). ISO/IEC 14496-12 `tkhd`: the 3x3 matrix (16.16 fixed point) sits 44 bytes
    after the box type of a version-0 box."""
    import struct

    assert quarter_turns_clockwise == 1
    out = bytearray(data)
    at = out.find(b"tkhd")
    assert at > 0 and out[at + 4] == 0
    out[at + 44:at + 80] = struct.pack(">9i", 0, 0x10000, 0, -0x10000, 0, 0, 0, 0, 0x40000000)
    return bytes(out)
