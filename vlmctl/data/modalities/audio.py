"""The audio unit: clips decoded with soundfile (libsndfile, https://python-soundfile.readthedocs.io), checked with
reason codes, stored as 16-bit mono FLAC at `data.audio.sampling_rate`, and handed to the processor's `audio=`.

What `data prepare` stores for a clip (docs/formats.md, "Audio", says why): the waveform down-mixed to mono (the
mean of the channels, as transformers' and librosa's `to_mono`), resampled with soxr (https://github.com/dofuuz/python-soxr,
quality HQ, librosa's default resampler) to `data.audio.sampling_rate` (16 kHz by default: the rate of Whisper-family
feature extractors), and written as FLAC with 16-bit samples. A FLAC input that is already 16-bit mono at that rate
is kept byte for byte (preparing prepared shards again changes nothing). Training decodes the FLAC back to float32
samples in [-1, 1] and resamples once more only when the model's feature extractor takes another rate.

Reason codes (`AudioError.reason`, see `vlmctl.data.checks`): `missing_audio` (no such file), `corrupt_audio` (not an
audio file libsndfile reads, a truncated file, samples that do not decode), `unsupported_audio` (a container
libsndfile has no decoder for: MP4/M4A/AAC, WebM/Matroska, WMA, AMR), `audio_too_short` (no samples, or shorter
than `data.audio.min_seconds`), `audio_too_long` (over `data.audio.max_seconds` by the header, or a file over
`MAX_AUDIO_FILE_BYTES`).

    stored = normalize_audio(data, cfg.data.audio)         # original bytes -> stored FLAC (raises AudioError)
    wave = decode_audio(stored.data, 16_000)               # float32 [samples], mono, at 16 kHz
    AudioUnit().processor_inputs([stored.data], processor) # {"audio": [wave], "sampling_rate": 16000}
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from vlmctl.config.data import DataAudio
from vlmctl.data.modalities.base import ModalityUnit
from vlmctl.errors import DataError
from vlmctl.families.encoders import AUDIO_KEYS  # the data keys of the encoders that take audio
from vlmctl.families.qwen2_audio import RESAMPLE_QUALITY  # soxr_hq (librosa's default); token rules count with it too

# torch is imported inside the function that uses it: reading and storing audio must not pay for it.
# soundfile and soxr (optional dependencies) are imported only where used, so the rest works without them.

STORED_FORMAT = "FLAC"
STORED_SUBTYPE = "PCM_16"
"""Stored clips: FLAC (lossless, about half the size of PCM WAV for speech) with 16-bit samples."""
MAX_AUDIO_FILE_BYTES = 1 << 30
"""Largest audio file read (bytes): larger files are rejected as audio_too_long before they are read (a 30 s
stereo 96 kHz 32-bit WAV is 23 MiB)."""
AUDIO_EXTENSIONS = ("wav", "flac", "mp3", "ogg", "oga", "opus", "aiff", "aif", "au", "caf", "w64")
"""File extensions taken as audio members of a WebDataset tar (formats libsndfile decodes)."""
"""Processor outputs of the audio unit (transformers' Qwen2-Audio processor: log-mel features [N, mel bins, frames]
and their frame mask [N, frames])."""
EXACT_LENGTH_FORMATS = ("WAV", "WAVEX", "RF64", "W64", "FLAC", "AIFF", "CAF")
"""Containers whose header gives the exact sample count: decoding fewer samples means a truncated file."""
UNKNOWN_LENGTH = 1 << 36
"""A header length at or above this is "unknown": FLAC's STREAMINFO holds the length in 36 bits, 0 meaning unknown,
which libsndfile reports as 2**63 - 1 frames. Such a clip is measured by decoding it (`decode_samples`)."""
DUMMY_SECONDS = 0.1
"""Length of the silent dummy clip of ranks without audio (two encoder tokens under Whisper-style feature
extractors)."""


class AudioError(Exception):
    """A reason-coded audio failure: `reason` is one of missing_audio, corrupt_audio, unsupported_audio,
    audio_too_short, audio_too_long (or outside_root / not_a_file from reading the file)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class AudioInfo:
    """What a clip's header says: libsndfile's `format` and `subtype` names (e.g. WAV, PCM_16), `sampling_rate` (Hz),
    `channels`, `frames` (samples per channel) and `seconds` (frames / sampling_rate)."""

    format: str
    subtype: str
    sampling_rate: int
    channels: int
    frames: int

    @property
    def seconds(self) -> float:
        """Seconds from the header; 0.0 when the header does not give the length (`known_length`)."""
        return self.frames / self.sampling_rate if self.sampling_rate and self.known_length else 0.0

    @property
    def known_length(self) -> bool:
        return self.frames < UNKNOWN_LENGTH


@dataclass
class NormalizedAudio:
    """A stored clip (FLAC bytes) and what the check stage records: `seconds` of audio, the original
    `sampling_rate` (Hz) and `channels`, and `conversion` (None when the input was kept byte for byte)."""

    data: bytes
    seconds: float
    sampling_rate: int
    channels: int
    conversion: str | None


# ------------------------------------------------------------------------------------------------- reading


def _sf():
    try:
        import soundfile
    except ImportError:  # the optional extra
        raise AudioError("unsupported_audio", "soundfile is not installed: install vlmctl's audio extra (pip install 'vlmctl[audio]')") from None
    return soundfile


_UNSUPPORTED = (
    (lambda d: d[4:8] == b"ftyp", "an MP4/M4A container (AAC or ALAC audio)"),
    (lambda d: d[:4] == b"\x1a\x45\xdf\xa3", "a WebM/Matroska container"),
    (lambda d: d[:8] == b"\x30\x26\xb2\x75\x8e\x66\xcf\x11", "an ASF/WMA container"),
    (lambda d: d[:5] == b"#!AMR", "AMR audio"),
    (lambda d: len(d) > 1 and d[0] == 0xFF and d[1] & 0xF6 == 0xF0, "raw AAC (ADTS)"),
)
"""Containers libsndfile does not decode, told by their first bytes (ISO/IEC 14496-12 `ftyp`, the EBML magic, the
ASF header GUID, RFC 4867's AMR magic, the ADTS sync word with layer 0)."""


def probe(data: bytes) -> AudioInfo:
    """Header facts of an encoded clip, without decoding its samples (`AudioInfo`).

    Raises AudioError: corrupt_audio (empty, not an audio file libsndfile reads, or a WAV whose data chunk is
    shorter than its header declares), unsupported_audio (a container libsndfile has no decoder for).
    """
    sf = _sf()
    if not data:
        raise AudioError("corrupt_audio", "empty file")
    try:
        info = sf.info(io.BytesIO(data))
    except (RuntimeError, sf.LibsndfileError, TypeError, ValueError) as exc:
        for test, what in _UNSUPPORTED:
            if test(data):
                raise AudioError("unsupported_audio", f"{what}, which libsndfile does not decode: convert it to FLAC or WAV") from None
        raise AudioError("corrupt_audio", f"not a readable audio file ({_message(exc)})") from None
    if info.samplerate <= 0 or info.channels <= 0:
        raise AudioError("corrupt_audio", f"the header says {info.samplerate} Hz and {info.channels} channel(s)")
    short = _riff_shortfall(data)
    if short is not None:
        raise AudioError("corrupt_audio", short)
    return AudioInfo(str(info.format), str(info.subtype), int(info.samplerate), int(info.channels), int(info.frames))


def _message(exc: Exception) -> str:
    text = str(exc).strip()
    return text.split(": ", 1)[-1] if text.startswith("Error opening") else text or type(exc).__name__


def _riff_shortfall(data: bytes) -> str | None:
    """Why a RIFF/WAVE file is truncated (its `data` chunk declares more bytes than the file holds), else None.
    libsndfile reads such a file without error, returning the samples present (Microsoft's RIFF layout: 4-byte
    chunk id, little-endian 32-bit size)."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    at = 12
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        if chunk == b"data":
            present = len(data) - at - 8
            if size not in (0, 0xFFFFFFFF) and present < size:  # 0 / -1: a streamed header without the size
                return f"truncated: the data chunk declares {size:,} bytes, {present:,} are present"
            return None
        at += 8 + size + (size & 1)
    return None


def decode_samples(data: bytes, info: AudioInfo | None = None, max_frames: int | None = None):
    """All samples of an encoded clip as float32 [frames, channels] in [-1, 1], with `info` (`probe` when None).

    A clip whose header does not give its length (`AudioInfo.known_length`) is decoded in blocks, stopping after
    `max_frames` + 1 frames when `max_frames` is given (the caller then sees it is too long).
    Raises AudioError(corrupt_audio) when a block does not decode, a sample is NaN or infinite (float WAV), or, for
    containers with exact lengths (`EXACT_LENGTH_FORMATS`), fewer samples decode than the header lists; and the
    reasons of `probe`.
    """
    sf = _sf()
    info = probe(data) if info is None else info
    try:
        if info.known_length:
            samples, _ = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        else:
            samples = _decode_unknown_length(data, info, max_frames)
    except AudioError:
        raise
    except Exception as exc:  # noqa: BLE001 - libsndfile, numpy or a decoder library: this clip only
        raise AudioError("corrupt_audio", f"does not decode ({_message(exc)})") from None
    if info.known_length and info.format in EXACT_LENGTH_FORMATS and len(samples) < info.frames:
        raise AudioError("corrupt_audio", f"truncated: {len(samples):,} of the {info.frames:,} samples its header lists decode")
    if info.subtype in ("FLOAT", "DOUBLE") or info.format not in EXACT_LENGTH_FORMATS:
        bad = int(np.count_nonzero(~np.isfinite(samples)))
        if bad:
            raise AudioError("corrupt_audio", f"{bad:,} sample(s) are NaN or infinite")
    return samples


def _flac_with_length(data: bytes, frames: int) -> bytes:
    """`data` (a FLAC stream) with STREAMINFO's total-samples field set to `frames`. STREAMINFO is the first
    metadata block; the field is the 36 bits after sample rate, channels and bits per sample, bytes 21.5-26 of
    the file (https://xiph.org/flac/format.html#metadata_block_streaminfo)."""
    out = bytearray(data)
    out[21] = (out[21] & 0xF0) | ((frames >> 32) & 0x0F)
    out[22:26] = (frames & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(out)


def _flac_audio_offset(data: bytes) -> int:
    """Where the audio frames of a FLAC stream start: after the last metadata block (each has a 4-byte header: a
    last-block flag, 7 bits of type, 24 bits of length)."""
    at = 4
    while at + 4 <= len(data):
        last, size = data[at] & 0x80, int.from_bytes(data[at + 1:at + 4], "big")
        at += 4 + size
        if last:
            break
    return at


def _decode_unknown_length(data: bytes, info: AudioInfo, max_frames: int | None):
    """The samples of a FLAC whose STREAMINFO gives the length as unknown (0). libsndfile stops with an error when
    asked for more samples than a FLAC holds, and it asks for the header's count, so the length is found by
    decoding with trial lengths written into the header: doubling from 65,536 samples (up to `max_frames` + 1, the
    first length that is too long), then bisecting. A stream that ends after its metadata has no samples."""
    sf = _sf()
    if info.format != "FLAC" or len(data) < 42 or data[:4] != b"fLaC":
        raise AudioError("corrupt_audio", f"the {info.format} header does not give the length, which libsndfile cannot decode")
    if _flac_audio_offset(data) >= len(data):
        return np.zeros((0, info.channels), np.float32)

    def decode(frames: int):
        try:
            return sf.read(io.BytesIO(_flac_with_length(data, frames)), dtype="float32", always_2d=True)[0]
        except Exception:  # noqa: BLE001 - more samples asked for than the stream holds
            return None

    limit = min(max_frames + 1 if max_frames is not None else UNKNOWN_LENGTH - 1, UNKNOWN_LENGTH - 1)
    good, bad = 0, None
    trial = min(1 << 16, limit)
    while True:
        if decode(trial) is None:
            bad = trial
            break
        good = trial
        if trial == limit:
            break
        trial = min(trial * 2, limit)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if decode(mid) is not None else (good, mid)
    samples = decode(good) if good else None
    if samples is None:
        raise AudioError("corrupt_audio", "the FLAC header does not give the length and no sample decodes")
    return samples


def to_mono(samples):
    """float32 [frames, channels] -> [frames]: the mean of the channels (transformers' and librosa's down-mix)."""
    return np.ascontiguousarray(samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0])


def resample(wave, rate: int, target: int):
    """Mono float32 samples [n] at `rate` Hz -> [round(n * target / rate)] at `target` Hz (soxr, `RESAMPLE_QUALITY`);
    unchanged when the rates are equal."""
    if rate == target:
        return wave

    try:
        import soxr
    except ImportError:  # the optional extra
        raise AudioError("unsupported_audio", f"resampling {rate} Hz to {target} Hz needs soxr: install vlmctl's audio extra "
                         "(pip install 'vlmctl[audio]')") from None
    return np.asarray(soxr.resample(wave, rate, target, quality=RESAMPLE_QUALITY), dtype=np.float32)


def encode_flac(wave, rate: int) -> bytes:
    """Mono float32 samples [n] -> FLAC bytes with 16-bit samples at `rate` Hz (values clipped to [-1, 1] first, so
    resampling overshoot cannot wrap around). The same samples always give the same bytes."""
    sf = _sf()
    out = io.BytesIO()
    sf.write(out, np.clip(wave, -1.0, 1.0), rate, format=STORED_FORMAT, subtype=STORED_SUBTYPE)
    return out.getvalue()


def normalize_audio(data: bytes, settings: DataAudio | None = None) -> NormalizedAudio:
    """Check an encoded clip and turn it into the stored FLAC training reads (module docstring).

    In order: the file size (audio_too_long), the header (corrupt_audio, unsupported_audio), the duration against
    `settings.max_seconds` (from the header, before decoding: audio_too_long), every sample must decode
    (corrupt_audio), then the length against `settings.min_seconds` (audio_too_short; an empty clip always). A
    16-bit mono FLAC at `settings.sampling_rate` is kept byte for byte. Raises AudioError.
    """
    settings = settings if settings is not None else DataAudio()
    if len(data) > MAX_AUDIO_FILE_BYTES:
        raise AudioError("audio_too_long", f"the file is {len(data) / 2**20:,.1f} MiB, over the limit of {MAX_AUDIO_FILE_BYTES >> 20} MiB per audio file")
    info = probe(data)
    if info.seconds > settings.max_seconds:
        raise AudioError("audio_too_long", f"{info.seconds:,.2f} s, over data.audio.max_seconds={settings.max_seconds:g}")
    # no limit (chat's clips, cut by the model's window instead): decode the whole clip
    limit = settings.max_seconds * info.sampling_rate
    samples = decode_samples(data, info, max_frames=int(limit) if limit != float("inf") else None)
    seconds = len(samples) / info.sampling_rate
    if len(samples) == 0:
        raise AudioError("audio_too_short", "no samples (an empty clip)")
    if seconds > settings.max_seconds:  # a header without the length: measured while decoding
        raise AudioError("audio_too_long", f"over {settings.max_seconds:g} s (data.audio.max_seconds; the header does not give the length)")
    if seconds < settings.min_seconds:
        raise AudioError("audio_too_short", f"{seconds:.3f} s, under data.audio.min_seconds={settings.min_seconds:g}")
    if info.known_length and (info.format, info.subtype, info.channels, info.sampling_rate) == (STORED_FORMAT, STORED_SUBTYPE, 1, settings.sampling_rate):
        return NormalizedAudio(data, seconds, info.sampling_rate, 1, None)
    wave = resample(to_mono(samples), info.sampling_rate, settings.sampling_rate)
    layout = "mono" if info.channels == 1 else f"{info.channels} channels"
    conversion = f"{info.format} {info.subtype} {info.sampling_rate} Hz {layout} -> FLAC PCM_16 {settings.sampling_rate} Hz mono"
    return NormalizedAudio(encode_flac(wave, settings.sampling_rate), seconds, info.sampling_rate, info.channels, conversion)


def audio_shape(data: bytes) -> tuple[int, int]:
    """(samples, sampling rate in Hz) of a stored clip, from its header. Raises AudioError."""
    info = probe(data)
    return info.frames, info.sampling_rate


def decode_audio(data: bytes, rate: int | None = None):
    """A stored clip as mono float32 samples [n] in [-1, 1], resampled to `rate` Hz when given and different.
    Raises AudioError (corrupt_audio)."""
    info = probe(data)
    wave = to_mono(decode_samples(data, info))
    return resample(wave, info.sampling_rate, rate) if rate else wave


# ------------------------------------------------------------------------------------------------- the unit


def feature_rate(processor: Any, default: int | None = None) -> int | None:
    """The sampling rate (Hz) of `processor`'s feature extractor (a processor, a feature extractor, or a dict of the
    settings a saved processor_config.json holds), else `default`."""
    extractor = processor.get("feature_extractor", processor) if isinstance(processor, dict) else getattr(processor, "feature_extractor", processor)
    rate = extractor.get("sampling_rate") if isinstance(extractor, dict) else getattr(extractor, "sampling_rate", None)
    return int(rate) if isinstance(rate, (int, float)) and rate else default


def concat_audio(inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Audio tensors of a batch: every key concatenated along dim 0 in row order (features [N, mel bins, frames],
    frame masks [N, frames]), as transformers' Qwen2-Audio processor batches several clips; the model pairs them
    with the audio tokens of `input_ids` in row-major order."""
    import torch

    keys = sorted({k for inp in inputs for k in inp})
    return {k: torch.cat([inp[k] for inp in inputs if k in inp], dim=0) for k in keys}


class AudioUnit(ModalityUnit):
    """Audio: `{"type": "audio", "index": i}` parts, the processor's `audio=` (mono float32 waveforms at the feature
    extractor's rate, with `sampling_rate`); it owns `AUDIO_KEYS`. Runs through its own encoder (the audio tower), so
    a rank whose micro-batch has no audio gets a silent dummy clip (`dummy_input`).

    An audio part is written into the conversation as the family's audio prompt (`FamilySpec.prompt("audio")`, e.g.
    Qwen2-Audio's `<|audio_bos|><|AUDIO|><|audio_eos|>`), so chat templates that render image parts only (vlmctl's
    ChatML of random-init presets) still place it. `needs_processor`: `processor_inputs` takes the processor (the
    feature extractor's rate), see `vlmctl.data.collate`.
    """

    name = "audio"
    processor_kwarg = "audio"
    encoder = "audio"
    needs_processor = True

    def owns(self, key: str) -> bool:
        return key in AUDIO_KEYS

    def template_part(self, processor: Any = None, family: Any = None) -> dict[str, Any]:
        """The family's audio prompt as a text part when a processor is given, else `{"type": "audio"}`. Raises
        DataError when the family takes no audio."""
        return self.prompt_part(processor, family, takers="Qwen2-Audio")

    def decode(self, parts: list[bytes]) -> list:
        """Stored clips -> mono float32 waveforms [n] at their stored rate."""
        return [decode_audio(data) for data in parts]

    def processor_inputs(self, parts: list[bytes], processor: Any = None) -> dict[str, Any]:
        """`audio=` (mono float32 waveforms [n], resampled to the feature extractor's rate of `processor` where it
        differs from the stored rate) and `sampling_rate=` (Hz)."""
        rate = feature_rate(processor)
        waves = [decode_audio(data, rate) for data in parts]
        if rate is None:
            rate = audio_shape(parts[0])[1] if parts else None
        return {"audio": waves, **({"sampling_rate": rate} if rate else {})}

    def call_kwargs(self, processor: Any) -> dict[str, Any]:
        """Keywords of a processor call next to `audio=` of `dummy_input`: the feature extractor's `sampling_rate`."""
        rate = feature_rate(processor)
        return {"sampling_rate": rate} if rate else {}

    def num_tokens(self, data: bytes, family: Any, processor: Any) -> int:
        """`family.num_audio_tokens(samples, sampling_rate, processor)` of a stored clip (its header only). Raises
        DataError when the family has no audio-token rule."""
        rule = getattr(family, "num_audio_tokens", None)
        if rule is None:
            raise DataError(f"family {getattr(family, 'name', family)} has no audio-token rule",
                            hint="train audio with a family that takes audio (qwen2_audio)")
        samples, rate = audio_shape(data)
        return int(rule(samples, rate, processor))

    def dummy_input(self, processor: Any):
        """`DUMMY_SECONDS` of silence, float32 [n] at the feature extractor's rate (16 kHz without one)."""
        rate = feature_rate(processor, 16_000)
        return np.zeros(int(rate * DUMMY_SECONDS), np.float32)

    def collate(self, inputs: list[dict[str, Any]], *, packed: bool) -> dict[str, Any]:
        return concat_audio(inputs)
