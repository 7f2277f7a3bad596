"""What the processor makes of a request's prompt and media: the model's input tensors (`_model_inputs`), and the
audio clips and videos read as the data pipeline reads them for training (`audio_inputs`, `video_inputs`,
`read_video`). Used by the decoding engine, `vlmctl.serve` and GRPO's rollouts.

Audio clips (`GenerationRequest.audios`, audio families such as qwen2_audio) go through the data pipeline's audio
unit (`vlmctl.data.modalities.audio.AudioUnit.processor_inputs`): decoded with soundfile, down-mixed to mono and
resampled with soxr to the feature extractor's rate (16 kHz for Whisper-style extractors), then handed to the
processor's `audio=`, exactly as training hands them over; the processor returns `input_features` and
`feature_attention_mask`.

Videos (`GenerationRequest.videos`, Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA-OneVision) go through the data pipeline's
video unit (`vlmctl.data.modalities.video`): a video file is checked and sampled by the `data.video` settings passed
as `video=` (`normalize_video`: frames per second, frame and pixel bounds; defaults when None), a stored clip
(prepared shards, `read_video`'s output) is used as it is, as training uses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from vlmctl.config.data import DataVideo

# torch, the data pipeline's media units and vlmctl's error types are imported inside the functions that use them:
# importing vlmctl (the CLI's start-up) must not pay for numpy, soundfile or PyAV.


def audio_inputs(processor, clips: list[bytes]) -> dict[str, Any]:
    """The processor call's audio keywords for encoded `clips`: `audio=` (mono float32 waveforms [n] at the feature
    extractor's rate) and `sampling_rate=`, through the data pipeline's audio unit; {} without clips. Raises
    DataError for a clip that does not decode (the unit's AudioError, with its reason)."""
    if not clips:
        return {}
    from vlmctl.data.modalities import get_unit
    from vlmctl.data.modalities.audio import AudioError
    from vlmctl.errors import DataError

    try:
        return get_unit("audio").processor_inputs(list(clips), processor)
    except AudioError as exc:
        raise DataError(f"an audio clip cannot be read ({exc.reason}): {exc.detail}",
                        hint="use WAV, FLAC, MP3 or OGG clips (pip install 'vlmctl[audio]' for the decoders)") from None


def read_video(video: bytes | str | Path, settings: "DataVideo | None" = None) -> bytes:
    """A video as the data pipeline stores a clip (`vlmctl.data.modalities.video.normalize_video`: the frames
    sampled by `settings`, `data.video` defaults when None, as Motion JPEG in Matroska). `video`: a path or encoded
    bytes of any container and codec FFmpeg decodes. A stored clip (prepared shards' clips, this function's output)
    is returned as it is: its frames are the ones training uses, so they are not sampled again.

    Raises DataError naming the file (or the clip) when it is missing, not a video, has a codec FFmpeg cannot
    decode, is shorter than `settings.min_frames` frames or longer than `settings.max_seconds` (the video unit's
    reason codes).
    """
    from vlmctl.data.modalities.video import MAX_VIDEO_FILE_BYTES, VideoError, normalize_video, probe
    from vlmctl.errors import DataError

    name = "a video clip" if isinstance(video, (bytes, bytearray)) else str(video)
    hint = "use a video file FFmpeg decodes (MP4, WebM, MKV, MOV...; pip install 'vlmctl[video]' for PyAV)"
    if not isinstance(video, (bytes, bytearray)):
        path = Path(video).expanduser()
        if not path.is_file():
            raise DataError(f"{path}: no such video file", hint="check the path (relative to the folder vlmctl started in)")
        if path.stat().st_size > MAX_VIDEO_FILE_BYTES:
            raise DataError(f"{path}: {path.stat().st_size / 2**30:,.1f} GiB, over the limit of {MAX_VIDEO_FILE_BYTES >> 30} GiB "
                            "per video file", hint="cut the video into shorter clips")
        video = path.read_bytes()
    try:
        if probe(bytes(video)).tagged:
            return bytes(video)
        return normalize_video(bytes(video), settings).data
    except VideoError as exc:
        if exc.reason in ("video_too_short", "video_too_long"):
            hint = "change data.video (min_frames, max_seconds) in the project, or cut the video"
        raise DataError(f"{name}: {exc.detail} ({exc.reason})", hint=hint) from None


def video_inputs(videos: Sequence[bytes | str | Path], settings: "DataVideo | None" = None) -> dict[str, Any]:
    """The processor call's video keywords for `videos` (paths or encoded bytes, read by `read_video` with
    `settings`): `videos=` (frames [T, H, W, 3] uint8 per clip), `video_metadata=` (the sampled frame count and
    rate per clip) and `do_sample_frames=False`, from the data pipeline's video unit; {} without videos. Raises
    DataError as `read_video` does."""
    if not videos:
        return {}
    from vlmctl.data.modalities import get_unit

    return get_unit("video").processor_inputs([read_video(v, settings) for v in videos])


def processor_inputs(processor, texts: list[str], images: list, audios: list[bytes] = (), videos: Sequence = (),
                     video: "DataVideo | None" = None) -> dict[str, Any]:
    """The processor's tensors for rendered prompts (padded on the tokenizer's padding side), on the host as the
    processor returns them. `audios`: the encoded clips of the prompts' audio parts, in order (`audio_inputs`);
    `videos`: those of their video parts (`video_inputs`, sampled by `video`)."""
    media = {"images": images} if images else {}
    return dict(processor(text=texts, **media, **audio_inputs(processor, list(audios)), **video_inputs(list(videos), video),
                          padding=True, return_tensors="pt", add_special_tokens=False))


def to_device(value, device):
    """`value` (a host tensor, any shape and dtype) on `device` without waiting for the work queued there: on CUDA it
    is staged in page-locked memory and copied asynchronously. A copy from ordinary (pageable) host memory first waits
    for the stream to drain (CUDA runtime API, "API synchronization behavior"), which would stall a decode step in
    flight behind the host's work; torch's pinned-memory cache keeps the staging block until the copy has run.
    Anything else (another device, a value that is not a tensor but has `.to`): a plain `.to`."""
    import torch

    if not isinstance(value, torch.Tensor) or torch.device(device).type != "cuda" or value.device.type != "cpu":
        return value.to(device)
    return value.pin_memory().to(device, non_blocking=True)


def to_host(value, buffer=None):
    """`value` (a tensor, any shape and dtype) copied to the host without waiting for the work queued after it: on
    CUDA into `buffer` (page-locked, `value`'s shape and dtype; a new one where None) with a CUDA event recorded after
    the copy, whose `synchronize()` waits for that copy alone; elsewhere a copy made at once and no event. A copy into
    pageable memory would wait for the whole stream (`to_device`'s reason, the other way). Returns (host tensor,
    event or None); the host tensor holds the values only once the event is reached."""
    import torch

    if value.device.type != "cuda":
        return value.clone(), None
    if buffer is None:
        buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    buffer.copy_(value, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return buffer, event


def to_model(model, inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` (`processor_inputs`) on the model's device (`to_device`: nothing waits for the device's queued work);
    floating image, video and audio-feature tensors in the model's dtype."""
    device = next(model.parameters()).device
    inputs = {k: (to_device(v, device) if hasattr(v, "to") else v) for k, v in inputs.items()}
    for key in ("pixel_values", "pixel_values_videos", "input_features"):
        if key in inputs and inputs[key].is_floating_point():
            inputs[key] = inputs[key].to(model.dtype)
    return inputs


SEQUENCE_KEYS = {"input_ids": None, "attention_mask": 0, "token_type_ids": 0, "mm_token_type_ids": 0}
"""The processor outputs laid out [1, T] per prompt, and what pads them on the right (None: the tokenizer's pad id)."""


def collate_inputs(items: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any] | None:
    """One batch from the processor's outputs for single prompts (`processor_inputs` of one prompt each, on the
    host), laid out as the processor lays out the same prompts in one call with right padding: the sequence keys
    (`SEQUENCE_KEYS`, [1, T_i] each) padded on the right to the longest prompt and stacked, every other tensor
    concatenated along dim 0 in the prompts' order (images' patches or pictures, their grids and sizes, audio
    features). None when that layout cannot be had by concatenation alone: a key some prompts lack, a value that is
    not a tensor, or tensors whose shapes past dim 0 differ (the processor would have padded them); the caller then
    calls the processor on the prompts together. For the families where concatenation is the processor's batching,
    tests compare the two (tests/unit/test_engine.py)."""
    import torch

    if not items or any(set(item) != set(items[0]) for item in items):
        return None
    width = max(int(item["input_ids"].shape[-1]) for item in items) if "input_ids" in items[0] else 0
    out: dict[str, Any] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        if not all(isinstance(v, torch.Tensor) for v in values):
            return None
        if key in SEQUENCE_KEYS:
            if any(v.ndim != 2 or v.shape[0] != 1 for v in values):
                return None
            fill = pad_token_id if SEQUENCE_KEYS[key] is None else SEQUENCE_KEYS[key]
            batch = torch.full((len(values), width), fill, dtype=values[0].dtype)
            for row, v in enumerate(values):
                batch[row, : v.shape[1]] = v[0]
            out[key] = batch
        elif any(v.ndim == 0 or v.shape[1:] != values[0].shape[1:] or v.dtype != values[0].dtype for v in values):
            return None
        else:
            out[key] = torch.cat(values, dim=0)
    return out


def collate_positions(items: Sequence[Any], width: int) -> Any | None:
    """Position ids computed for single prompts (each [..., 1, T_i], the family's `FamilySpec.prompt_positions` of
    one prompt, e.g. Qwen-VL's [3, 1, T_i] multimodal RoPE positions) as one batch [..., B, width] laid out as
    `collate_inputs` lays out the prompts' tokens: each row's positions from index 0, 0 past its tokens. The batch
    computation gives the same positions at every row's tokens (a row's positions depend on its own tokens and media
    only); past them it may fill others, which nothing attends to. None when the rows' leading dims or dtypes differ,
    or a row is longer than `width`."""
    import torch

    if not items or any(not isinstance(v, torch.Tensor) or v.ndim < 2 or v.shape[-2] != 1 for v in items):
        return None
    lead, dtype = tuple(items[0].shape[:-2]), items[0].dtype
    if any(tuple(v.shape[:-2]) != lead or v.dtype != dtype or v.shape[-1] > width for v in items):
        return None
    out = torch.zeros(*lead, len(items), width, dtype=dtype)
    for row, v in enumerate(items):
        out[..., row, : v.shape[-1]] = v[..., 0, :]
    return out


def _model_inputs(model, processor, texts: list[str], images: list, audios: list[bytes] = (), videos: Sequence = (),
                  video: "DataVideo | None" = None) -> dict[str, Any]:
    """`processor_inputs` moved to the model's device (`to_model`)."""
    return to_model(model, processor_inputs(processor, texts, images, audios, videos, video))


__all__ = ["SEQUENCE_KEYS", "_model_inputs", "audio_inputs", "collate_inputs", "collate_positions", "processor_inputs", "read_video", "to_device",
           "to_model", "video_inputs"]
