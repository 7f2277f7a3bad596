"""Synthetic audio data: a procedurally generated audio question-answering set (beeps and tones), for
`vlmctl demo --modality audio`.

Like the shapes set of `vlmctl.data.synthetic`, it needs no download, is deterministic for a seed, and can only be
answered well by listening: every question of a type is worded the same, so the text says nothing about the
answer. Clips are real audio files written with soundfile (16-bit WAV or FLAC, mono, 16 kHz, the rate of
Whisper-style feature extractors, so `data prepare` keeps FLAC clips as they are and converts the WAV ones), listed
in the ShareGPT format (`{id, messages, audios}` with an `<audio>` placeholder), so they go through the real readers
and the audio checks.

Every clip lasts `seconds` (1 s by default: 25 audio tokens of the tiny Qwen2-Audio) over a little white noise, the
sound at a random place in it. Question types (answers balanced within each type):

- `beeps`: "How many beeps are there?" -> "1".."4": beeps of `BEEP_SECONDS` each at one pitch (300 to 2,000 Hz),
  with gaps of at least `GAP_SECONDS`
- `pitch`: "Is the tone low, medium or high?" -> low | medium | high: one steady tone in one of the `PITCH_BANDS`
  (Hz), 0.3 to 0.7 s long
- `glide`: "Does the tone go up, go down or stay level?" -> up | down | level: a tone of 0.5 to 0.8 s gliding over
  three octaves (exponentially, from 250-500 Hz up to 2,000-4,000 Hz, or the reverse) or holding one pitch (250 to
  4,000 Hz). Over two octaves, the demo told up from down less often (58% of the glides right, 75% over three).

The blind baseline (the most common answer per question type, what a model gets without listening) is therefore
1/4 for beeps and 1/3 for pitch and glide; 0.31 over the balanced mix.
"""

from __future__ import annotations

import hashlib
import io
import math
import random
from pathlib import Path

from vlmctl.data.synthetic import media_question, write_records

# numpy is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# soundfile (an optional dependency) is imported only where used, so the rest works without it.

QUESTION_TYPES = ("beeps", "pitch", "glide")
SAMPLING_RATE = 16_000
BEEP_COUNTS = ("1", "2", "3", "4")
BEEP_SECONDS, GAP_SECONDS = 0.08, 0.08
PITCH_BANDS = {"low": (200.0, 350.0), "medium": (700.0, 1000.0), "high": (2500.0, 4000.0)}
"""Pitch answer -> the band (Hz) its tones are drawn from, log-uniformly; the bands are an octave or more apart."""
GLIDES = ("up", "down", "level")
GLIDE_RATIO = 8.0
"""Last over first frequency of an upward glide (three octaves); a downward glide is one played backwards."""
QUESTIONS = {"beeps": "How many beeps are there?", "pitch": "Is the tone low, medium or high?",
             "glide": "Does the tone go up, go down or stay level?"}


def _tone(freqs, rate: int, amplitude: float):
    """A sine whose instantaneous frequency follows `freqs` (Hz per sample, float [n]), with 5 ms fades at both
    ends (no clicks): float32 [n]."""
    import numpy as np

    phase = 2 * np.pi * np.cumsum(freqs) / rate
    wave = amplitude * np.sin(phase)
    fade = min(len(wave) // 2, int(0.005 * rate))
    if fade:
        ramp = np.linspace(0.0, 1.0, fade)
        wave[:fade] *= ramp
        wave[-fade:] *= ramp[::-1]
    return wave.astype(np.float32)


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _clip(rng: random.Random, qtype: str, answer: str, seconds: float, rate: int):
    """Samples float32 [seconds x rate] of one clip of `qtype` whose answer is `answer`."""
    import numpy as np

    n = int(round(seconds * rate))
    noise = np.random.default_rng(rng.randint(0, 2**31)).normal(0.0, rng.uniform(0.002, 0.01), n)
    out = noise.astype(np.float32)
    amplitude = rng.uniform(0.2, 0.5)
    if qtype == "beeps":
        count, beep, freq = int(answer), int(BEEP_SECONDS * rate), _log_uniform(rng, 300.0, 2000.0)
        # the spare time (clip minus the beeps and the shortest gaps) is spread at random before, between and after
        spare = n - count * beep - (count - 1) * int(GAP_SECONDS * rate)
        cuts = sorted(rng.randint(0, spare) for _ in range(count))
        for i in range(count):
            start = cuts[i] + i * (beep + int(GAP_SECONDS * rate))
            out[start:start + beep] += _tone(np.full(beep, freq), rate, amplitude)
        return out
    length = int(rng.uniform(0.3, 0.7) * rate) if qtype == "pitch" else int(rng.uniform(0.5, 0.8) * rate)
    start = rng.randint(0, n - length)
    if qtype == "pitch":
        freqs = np.full(length, _log_uniform(rng, *PITCH_BANDS[answer]))
    elif answer == "level":
        freqs = np.full(length, _log_uniform(rng, 250.0, 4000.0))
    else:
        low = _log_uniform(rng, 250.0, 500.0)
        freqs = low * np.exp(np.linspace(0.0, math.log(GLIDE_RATIO), length))
        if answer == "down":
            freqs = freqs[::-1]
    out[start:start + length] += _tone(freqs, rate, amplitude)
    return out


def encode_audio(samples, rate: int, fmt: str) -> bytes:
    """Mono float32 samples [n] -> a 16-bit `fmt` file (WAV or FLAC) at `rate` Hz, written by soundfile (values
    clipped to [-1, 1]). Returns the file's bytes."""
    import numpy as np
    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, np.clip(samples, -1.0, 1.0), rate, format=fmt, subtype="PCM_16")
    return out.getvalue()


def generate_tones(out_dir: Path, num_samples: int = 1200, seed: int = 0, seconds: float = 1.0) -> Path:
    """Write `num_samples` clips (WAV and FLAC files in `out_dir/audio/` + `tones.json` in ShareGPT format) under
    `out_dir`.

    Returns the path of the JSON file. Deterministic for (`num_samples`, `seed`, `seconds`). Question types are
    balanced round-robin, answers balanced within each type (cycled in shuffled order, so a type's blind baseline is
    its answer count's inverse); the sample id is `<question type>-<index>`. Every clip is `seconds` long, mono, 16
    kHz; every other one is a WAV file, the rest FLAC. No two clips have the same question, answer and samples.

    Raises ValueError when `seconds` is outside [1, 2] (four beeps and their gaps need 1 s; the tiny Qwen2-Audio's
    window is 2 s).
    """
    if not 1.0 <= seconds <= 2.0:
        raise ValueError(f"seconds must be in [1, 2], got {seconds}")
    out_dir = Path(out_dir)
    (out_dir / "audio").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    answers_of = {"beeps": BEEP_COUNTS, "pitch": tuple(PITCH_BANDS), "glide": GLIDES}
    seen: set[bytes] = set()
    records = []
    for i in range(num_samples):
        qtype = QUESTION_TYPES[i % len(QUESTION_TYPES)]
        nth = i // len(QUESTION_TYPES)
        answers = answers_of[qtype]
        order = random.Random(f"{seed}:{qtype}:{nth // len(answers)}").sample(answers, len(answers))
        answer = order[nth % len(answers)]
        while True:
            wave = _clip(rng, qtype, answer, seconds, SAMPLING_RATE)
            key = hashlib.blake2b(f"{qtype}\0{answer}\0".encode() + wave.tobytes(), digest_size=16).digest()
            if key not in seen:
                seen.add(key)
                break
        sid = f"{qtype}-{i:05d}"
        fmt = "WAV" if i % 2 == 0 else "FLAC"
        name = f"audio/{sid}.{fmt.lower()}"
        (out_dir / name).write_bytes(encode_audio(wave, SAMPLING_RATE, fmt))
        records.append(media_question(sid, "audio", name, QUESTIONS[qtype], answer))
    return write_records(out_dir / "tones.json", records)


__all__ = ["QUESTION_TYPES", "QUESTIONS", "BEEP_COUNTS", "PITCH_BANDS", "GLIDES", "GLIDE_RATIO", "SAMPLING_RATE", "generate_tones", "encode_audio"]
