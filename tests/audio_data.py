"""Tiny real audio files for the audio tests, written with soundfile (and PyAV for a container libsndfile cannot
read) in the test itself: tones, plus defective files, one per reason code."""

from __future__ import annotations

import io

import numpy as np


def tone(seconds: float = 1.0, rate: int = 16_000, freq: float = 440.0, channels: int = 1, amplitude: float = 0.3) -> np.ndarray:
    """A sine of `freq` Hz, float32 [n] (mono) or [n, channels] where channel c has amplitude / (c + 1)."""
    t = np.arange(int(round(seconds * rate))) / rate
    wave = amplitude * np.sin(2 * np.pi * freq * t)
    if channels == 1:
        return wave.astype(np.float32)
    return np.stack([wave / (c + 1) for c in range(channels)], axis=1).astype(np.float32)


def encode(samples: np.ndarray, rate: int = 16_000, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """`samples` written by soundfile as `fmt` (WAV, FLAC, OGG, MP3, ...) with `subtype` (default: the format's)."""
    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def wav(seconds: float = 1.0, rate: int = 16_000, **kwargs) -> bytes:
    return encode(tone(seconds, rate, **kwargs), rate, "WAV", "PCM_16")


def flac(seconds: float = 1.0, rate: int = 16_000, **kwargs) -> bytes:
    return encode(tone(seconds, rate, **kwargs), rate, "FLAC", "PCM_16")


def m4a(seconds: float = 0.5, rate: int = 16_000) -> bytes:
    """AAC in an MP4 container (.m4a), encoded with PyAV: a format libsndfile has no decoder for."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate)
        stream.layout = "mono"
        wave = tone(seconds, rate)[None, :]
        frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    data = out.getvalue()
    assert data[4:8] == b"ftyp"
    return data


def dominant_hz(wave: np.ndarray, rate: int) -> float:
    """The frequency (Hz) of the largest FFT magnitude of mono samples [n]."""
    spectrum = np.abs(np.fft.rfft(wave))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[int(spectrum.argmax())])
