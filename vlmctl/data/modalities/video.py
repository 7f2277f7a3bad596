"""The video unit: clips decoded with PyAV (FFmpeg's libraries, https://pyav.basswood-io.com), frames sampled by
`data.video`, checked with reason codes, stored as pre-sampled clips, and handed to the processor's `videos=`.

What `data prepare` stores for a clip is not the original file but the frames training will use (docs/formats.md,
"Video", says why): `normalize_video` decodes the original once, samples `n` frames uniformly over the clip
(`n = round(seconds x data.video.fps)`, within [`min_frames`, `max_frames`] and the clip's own frame count, rounded
down to an even number), scales them into [`min_pixels`, `max_pixels`] pixels keeping the aspect ratio (FFmpeg's
swscale, bicubic), turns them upright when the stream has a display rotation (phone videos), and encodes them as
Motion JPEG in Matroska at the sampled rate (every frame a JPEG of its own, so a training worker decodes exactly the
`n` frames it uses and nothing else). Such a clip is a playable video file;
`decode_clip` reads it back as frames [T, H, W, 3] uint8 with its rate (frames per second of the sampled clip,
which Qwen2.5-VL's processor turns into `second_per_grid_ts` = temporal_patch_size / fps seconds per temporal
patch, and Qwen3-VL's into a timestamp text per temporal patch).

Reason codes (`VideoError.reason`, see `vlmctl.data.checks`): `missing_video` (no such file), `corrupt_video` (not a
video container, truncated, undecodable packets, no frame decodes, a still image), `unsupported_codec` (FFmpeg has
no decoder for the stream), `video_too_short` (fewer than `data.video.min_frames` frames), `video_too_long` (over
`data.video.max_seconds` by the header, or a file over `MAX_VIDEO_FILE_BYTES`).

    stored = normalize_video(data, cfg.data.video)        # original bytes -> stored clip (raises VideoError)
    clip = decode_clip(stored.data)                      # clip.frames [T, H, W, 3] uint8, clip.fps
    VideoUnit().processor_inputs([stored.data])          # {"videos": [frames], "video_metadata": [...], ...}
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vlmctl.config.data import DataVideo
from vlmctl.data.modalities.base import ModalityUnit
from vlmctl.families.encoders import VIDEO_KEYS  # the data keys of the encoders that take videos

# numpy and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not
# pay for them.
# av (an optional dependency) is imported only where used, so the rest works without it.
# Light vlmctl modules are imported next to their use as well.

CLIP_FORMAT = "matroska"
CLIP_CODEC = "mjpeg"
CLIP_PIXEL_FORMAT = "yuvj444p"  # full-range, no chroma subsampling (as images are re-encoded: subsampling=0)
CLIP_QSCALE = 2  # MJPEG quantizer (1 best .. 31): about JPEG quality 95, the quality images are re-encoded at
CLIP_TAG = "VLMCTL_CLIP"
"""Container tag of the clips `encode_clip` writes; its value is the format version."""
CLIP_VERSION = "1"
FRAME_MULTIPLE = 2
"""Frame counts are rounded down to a multiple of this: video encoders take frames in temporal patches of 2
(transformers' Qwen2-VL video processor repeats the last frame to fill an odd count)."""
MAX_VIDEO_FILE_BYTES = 2 << 30
"""Largest video file read (bytes): larger files are rejected as video_too_long before they are read."""
VIDEO_EXTENSIONS = ("mp4", "m4v", "mov", "mkv", "webm", "avi", "mpg", "mpeg", "ogv", "flv", "wmv", "3gp", "ts")
"""File extensions taken as video members of a WebDataset tar."""
"""Processor outputs of the video unit (transformers' Qwen2-VL processor: patches [P, C*t*p*p], grids [N, 3],
seconds per temporal patch [N])."""


class VideoError(Exception):
    """A reason-coded video failure: `reason` is one of missing_video, corrupt_video, unsupported_codec,
    video_too_short, video_too_long (or outside_root / not_a_file from reading the file)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class VideoInfo:
    """What a clip's header and packets say: `codec`, `width` x `height` (pixels), `frames` (packets of the video
    stream: frames, without decoding), `seconds` (duration), `container` (FFmpeg's demuxer name), `fps` (the stream's
    rate, frames per second, as `decode_clip` reads it)."""

    codec: str
    width: int
    height: int
    frames: int
    seconds: float
    container: str
    tagged: bool = False  # a clip written by `encode_clip`
    fps: float = 1.0
    declared: float | None = None  # the header's duration when the packets' timestamps contradict it (then `seconds` is theirs)


@dataclass
class Clip:
    """Decoded frames [T, H, W, 3] uint8 (RGB) and the clip's rate `fps` (frames per second); `seconds` = T / fps."""

    frames: Any
    fps: float

    @property
    def seconds(self) -> float:
        return len(self.frames) / self.fps

    def metadata(self) -> dict[str, Any]:
        """transformers' `VideoMetadata` fields of the clip (`video_utils.VideoMetadata`): the frames are already
        sampled, so `total_num_frames` is T, `fps` the sampled rate (`sampled_fps`) and `frames_indices` 0..T-1 (frame
        i at i / fps seconds: Qwen3-VL's processor writes timestamps from them)."""
        t, h, w = (int(x) for x in self.frames.shape[:3])
        return {"total_num_frames": t, "fps": float(self.fps), "width": w, "height": h, "duration": t / float(self.fps),
                "video_backend": "pyav", "frames_indices": list(range(t))}


@dataclass
class NormalizedVideo:
    """A stored clip (`encode_clip` bytes) and what the check stage records about it: sampled `frames`, frame
    `width` x `height` (pixels), `seconds` of the original, and `conversion` (None when the input was already a
    stored clip that fits the settings and was kept byte for byte)."""

    data: bytes
    frames: int
    width: int
    height: int
    seconds: float
    conversion: str | None


# ------------------------------------------------------------------------------------------------- reading


def _av():
    try:
        import av
    except ImportError:  # the optional extra
        raise VideoError("unsupported_codec", "PyAV is not installed: install vlmctl's video extra (pip install 'vlmctl[video]')") from None
    return av


def _open(data: bytes):
    """The PyAV input container of `data` and its first video stream. Raises VideoError."""
    av = _av()
    if not data:
        raise VideoError("corrupt_video", "empty file")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.error.FFmpegError as exc:
        raise VideoError("corrupt_video", f"not a readable video container ({_ffmpeg_message(exc)})") from None
    demuxer = container.format.name
    if demuxer == "image2" or demuxer.endswith("_pipe"):  # FFmpeg opens a still image as a one-frame "video"
        container.close()
        raise VideoError("corrupt_video", f"a still image ({demuxer.removesuffix('_pipe')}), not a video")
    if not container.streams.video:
        container.close()
        raise VideoError("corrupt_video", f"the {demuxer} container has no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        container.close()
        raise VideoError("unsupported_codec", f"FFmpeg has no decoder for the codec of the video stream (container {demuxer})")
    return container, stream


def _ffmpeg_message(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def probe(data: bytes) -> VideoInfo:
    """Header and packet facts of an encoded clip, without decoding (`VideoInfo`).

    `frames` counts the video stream's packets (FFmpeg's demuxer: one per frame); `seconds` is the stream's duration,
    else the container's, else frames / average rate. Raises VideoError: corrupt_video (not a video, no frames, or
    fewer packets than the header's frame count: a truncated file), unsupported_codec.
    """
    av = _av()
    container, stream = _open(data)
    try:
        seconds = _seconds(container, stream)
        frames, first, last = 0, None, None  # packet timestamps (stream time base): the clip's real span
        try:
            for packet in container.demux(stream):
                if packet.size:
                    frames += 1
                    if packet.pts is not None:
                        end = packet.pts + (packet.duration or 0)
                        first = packet.pts if first is None else min(first, packet.pts)
                        last = end if last is None else max(last, end)
        except av.error.FFmpegError as exc:
            raise VideoError("corrupt_video", f"unreadable after {frames} frames ({_ffmpeg_message(exc)})") from None
        if frames == 0:
            raise VideoError("corrupt_video", f"the video stream of the {container.format.name} container holds no frames")
        if stream.frames and frames < stream.frames:  # the header's count (MP4 has one) is what a whole file holds
            raise VideoError("corrupt_video", f"truncated: {frames} of the {stream.frames} frames its header lists are present")
        if seconds is None:
            rate = stream.average_rate or stream.guessed_rate
            seconds = frames / float(rate) if rate else 0.0
        declared = None
        if first is not None and stream.time_base is not None and last > first:
            span = float((last - first) * stream.time_base)
            if abs(span - seconds) > max(1.0, 0.25 * span):  # a header that contradicts the frames: trust the frames
                declared, seconds = float(seconds), span
        return VideoInfo(codec=stream.codec_context.name, width=int(stream.width), height=int(stream.height), frames=frames,
                         seconds=float(seconds), container=container.format.name,
                         tagged=container.metadata.get(CLIP_TAG) == CLIP_VERSION, fps=_rate(stream), declared=declared)
    finally:
        container.close()


def _rate(stream) -> float:
    """The stream's rate (frames per second): its average rate, else FFmpeg's guess, else 1."""
    rate = stream.average_rate or stream.guessed_rate
    return float(rate) if rate else 1.0


def _seconds(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
        return float(stream.duration * stream.time_base)
    if container.duration is not None and container.duration > 0:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def frame_indices(total: int, seconds: float, settings: DataVideo) -> list[int]:
    """Which of a clip's `total` frames to keep (0-based, in order): `n` = round(seconds x fps) within
    [min_frames, max_frames] and at most `total`, rounded down to a multiple of `FRAME_MULTIPLE`, spread uniformly as
    transformers' `Qwen2VLVideoProcessor.sample_frames` spreads them (floor(k x total / n)).

    Raises VideoError(video_too_short) when the clip has fewer than `settings.min_frames` frames.
    """
    if total < settings.min_frames:
        raise VideoError("video_too_short", f"{total} frame(s) ({seconds:.2f} s); data.video.min_frames is {settings.min_frames}")
    n = min(max(round(seconds * settings.fps), settings.min_frames), settings.max_frames, total)
    n -= n % FRAME_MULTIPLE
    return [k * total // n for k in range(n)]


def frame_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) in pixels scaled into [min_pixels, max_pixels] pixels keeping the aspect ratio (unchanged
    when already inside; each side at least 1)."""
    area = width * height
    if min_pixels <= area <= max_pixels:
        return width, height
    scale = math.sqrt((max_pixels if area > max_pixels else min_pixels) / area)
    fit = math.floor if area > max_pixels else math.ceil
    return max(1, fit(width * scale)), max(1, fit(height * scale))


def sample_clip(data: bytes, settings: DataVideo, info: VideoInfo | None = None) -> Clip:
    """Decode `data` once and keep the frames `frame_indices` picks, scaled by `frame_size` (RGB, bicubic).

    Returns a Clip of frames [n, H, W, 3] uint8 at n / seconds frames per second. Raises VideoError
    (corrupt_video when a packet does not decode or fewer frames decode than the header promised, and the reasons
    of `probe` / `frame_indices`).
    """
    import numpy as np

    av = _av()
    info = probe(data) if info is None else info
    keep = frame_indices(info.frames, info.seconds, settings)
    wanted = set(keep)
    width, height = frame_size(info.width, info.height, settings.min_pixels, settings.max_pixels)
    container, stream = _open(data)
    stream.thread_type = "AUTO"
    frames, index = [], 0
    try:
        for frame in container.decode(stream):
            if index in wanted:
                pixels = frame.reformat(width=width, height=height, format="rgb24", interpolation="BICUBIC").to_ndarray()
                frames.append(_upright(pixels, frame.rotation))
            index += 1
            if len(frames) == len(keep):
                break
    except av.error.FFmpegError as exc:
        raise VideoError("corrupt_video", f"frame {index} of {info.frames} does not decode ({_ffmpeg_message(exc)})") from None
    finally:
        container.close()
    if len(frames) < len(keep):
        what = "no frame decodes" if index == 0 else f"only {index} of {info.frames} frames decode"
        raise VideoError("corrupt_video", what)
    seconds = info.seconds if info.seconds > 0 else len(keep) / settings.fps
    return Clip(np.stack(frames), len(keep) / seconds)


def _upright(pixels, rotation: int):
    """Frame pixels [H, W, 3] turned as the stream's display matrix says (phone videos store portrait frames
    sideways): PyAV's `VideoFrame.rotation` is the counterclockwise angle the display applies, as FFmpeg's player
    rotates on playback."""
    import numpy as np

    turns = round(rotation / 90) % 4
    return np.ascontiguousarray(np.rot90(pixels, k=turns)) if turns else pixels


# ------------------------------------------------------------------------------------------------- stored clips


def encode_clip(clip: Clip) -> bytes:
    """A Clip as Motion JPEG in Matroska (one JPEG per frame, `CLIP_QSCALE`, 4:4:4) at the clip's rate, tagged
    `CLIP_TAG`; the same frames always give the same bytes. Frames [T, H, W, 3] uint8."""
    av = _av()
    rate = Fraction(clip.fps).limit_denominator(1_000_000)
    out = io.BytesIO()
    t, h, w = (int(x) for x in clip.frames.shape[:3])
    # bitexact: no random segment id, date or library version in the file, so equal frames give equal bytes
    # (deterministic shards, and dedup by content)
    with av.open(out, mode="w", format=CLIP_FORMAT, options={"fflags": "+bitexact"}) as container:
        container.metadata[CLIP_TAG] = CLIP_VERSION
        stream = container.add_stream(CLIP_CODEC, rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, CLIP_PIXEL_FORMAT
        stream.codec_context.options = {"flags": "+bitexact", "qmin": str(CLIP_QSCALE), "qmax": str(CLIP_QSCALE)}
        for i in range(t):
            frame = av.VideoFrame.from_ndarray(clip.frames[i], format="rgb24").reformat(format=CLIP_PIXEL_FORMAT)
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def decode_clip(data: bytes) -> Clip:
    """Every frame of a clip (a stored clip: all of it is used) as frames [T, H, W, 3] uint8 and its rate (the
    stream's average rate, frames per second). Raises VideoError (corrupt_video, unsupported_codec)."""
    import numpy as np

    av = _av()
    container, stream = _open(data)
    try:
        rate = _rate(stream)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    except av.error.FFmpegError as exc:
        raise VideoError("corrupt_video", f"does not decode ({_ffmpeg_message(exc)})") from None
    finally:
        container.close()
    if not frames:
        raise VideoError("corrupt_video", "no frame decodes")
    return Clip(np.stack(frames), rate)


def clip_shape(data: bytes) -> tuple[int, int, int]:
    """(frames, width, height) of a stored clip from its packets and header, without decoding. Raises VideoError."""
    info = probe(data)
    return info.frames, info.width, info.height


def normalize_video(data: bytes, settings: DataVideo | None = None) -> NormalizedVideo:
    """Check an encoded video and turn it into the stored clip training reads (module docstring).

    In order: the container and its codec (corrupt_video, unsupported_codec), the duration against
    `settings.max_seconds` (from the header, before decoding: video_too_long), the frame count (video_too_short), then
    every packet up to the last frame kept must decode (corrupt_video). A clip written by `encode_clip` whose frame count, size and rate already fit `settings` is kept
    byte for byte (preparing prepared shards again changes nothing). Raises VideoError.
    """
    settings = settings if settings is not None else DataVideo()
    if len(data) > MAX_VIDEO_FILE_BYTES:
        raise VideoError("video_too_long", f"the file is {len(data) / 2**30:,.1f} GiB, over the limit of {MAX_VIDEO_FILE_BYTES >> 30} GiB per video")
    info = probe(data)
    if info.seconds > settings.max_seconds:
        raise VideoError("video_too_long", f"{info.seconds:,.1f} s, over data.video.max_seconds={settings.max_seconds:g}")
    if info.tagged and _fits(info, settings):
        return NormalizedVideo(data, info.frames, info.width, info.height, info.seconds, None)
    clip = sample_clip(data, settings, info)
    t, h, w = (int(x) for x in clip.frames.shape[:3])
    conversion = f"{info.codec} {info.width}x{info.height} {info.frames} frames -> {t} frames {w}x{h}"
    if info.declared is not None:  # reported: the header's duration was wrong
        conversion += f", duration {info.seconds:.2f} s from the frames' timestamps (the header says {info.declared:.2f} s)"
    return NormalizedVideo(encode_clip(clip), t, w, h, info.seconds, conversion)


def _fits(info: VideoInfo, settings: DataVideo) -> bool:
    keep = frame_indices(info.frames, info.seconds, settings)
    return (keep == list(range(info.frames)) and frame_size(info.width, info.height, settings.min_pixels, settings.max_pixels)
            == (info.width, info.height))


# ------------------------------------------------------------------------------------------------- the unit


def concat_videos(inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Video tensors of a batch: every key concatenated along dim 0 in row order (patches [P, D], grids [N, 3],
    seconds per temporal patch [N]), as transformers' Qwen2-VL processor batches several videos; per-clip stacks
    [N, T, C, H, W] (LLaVA-OneVision) likewise.

    Raises DataError when the tensors of one key differ beyond dim 0: clips of different frame counts, which a model
    taking one [videos, frames, ...] tensor cannot batch.
    """
    import torch

    keys = sorted({k for inp in inputs for k in inp})
    out = {}
    for k in keys:
        parts = [inp[k] for inp in inputs if k in inp]
        if len({tuple(p.shape[1:]) for p in parts}) > 1:
            from vlmctl.errors import DataError

            shapes = sorted({tuple(p.shape[1:]) for p in parts})
            raise DataError(f"the clips of one batch have {k} of different shapes {shapes} beyond dim 0 (different frame "
                            "counts): the model takes one tensor for all of them",
                            hint="set data.video.min_frames equal to data.video.max_frames so every clip keeps as many "
                            "frames, or train one video sample per micro-batch")
        out[k] = torch.cat(parts, dim=0)
    return out


class VideoUnit(ModalityUnit):
    """Videos: `{"type": "video", "index": i}` parts, the processor's `videos=` (frames [T, H, W, 3] uint8 per clip,
    with `video_metadata` so transformers never samples or fetches anything itself); it owns `VIDEO_KEYS`.

    A video part is written into the conversation as the family's video prompt (`FamilySpec.prompt("video")`, e.g.
    Qwen's `<|vision_start|><|video_pad|><|vision_end|>`, what its chat template writes for a video part), so chat
    templates that render image parts only (vlmctl's ChatML of random-init presets) still place it.
    """

    name = "video"
    processor_kwarg = "videos"
    encoder = "vision"

    def owns(self, key: str) -> bool:
        return key in VIDEO_KEYS

    def template_part(self, processor: Any = None, family: Any = None) -> dict[str, Any]:
        """The family's video prompt as a text part when a processor is given, else `{"type": "video"}`. Raises
        DataError when the family takes no video."""
        return self.prompt_part(processor, family, takers="Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision")

    def decode(self, parts: list[bytes]) -> list:
        """Stored clips -> frame arrays [T, H, W, 3] uint8."""
        return [decode_clip(data).frames for data in parts]

    def processor_inputs(self, parts: list[bytes]) -> dict[str, Any]:
        """`videos=` (frames [T, H, W, 3] uint8 per clip), `video_metadata=` (one dict per clip: the sampled frame
        count and rate) and `do_sample_frames=False`: the clips are sampled already."""
        clips = [decode_clip(data) for data in parts]
        return {"videos": [c.frames for c in clips], "video_metadata": [c.metadata() for c in clips], "do_sample_frames": False}

    def num_tokens(self, data: bytes, family: Any, processor: Any) -> int:
        """`family.num_video_tokens(frames, width, height, processor, fps=rate)` of a stored clip (header and packets
        only)."""
        info = probe(data)
        return int(family.num_video_tokens(info.frames, info.width, info.height, processor, fps=info.fps))

    def dummy_input(self, processor: Any) -> None:
        """None: videos run the same vision tower as images, whose dummy image keeps every rank in step."""
        return None

    def collate(self, inputs: list[dict[str, Any]], *, packed: bool) -> dict[str, Any]:
        return concat_videos(inputs)
