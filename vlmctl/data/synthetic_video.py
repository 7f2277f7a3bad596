"""Synthetic video data: a procedurally generated video question-answering set (objects moving, or not, across
a few frames), for `vlmctl demo --modality video`.

Like the shapes set of `vlmctl.data.synthetic`, it needs no download, is deterministic for a seed, and can only be
answered well by looking at the frames in order: no single frame tells which way something moves or whether it
moves at all, and the color an object turns is the one it shows last. Clips are real H.264 MP4 files written with
PyAV (the library `data prepare` decodes them with), listed in the ShareGPT format (`{id, messages, videos}` with a
`<video>` placeholder), so they go through the real readers and the video checks.

Each clip has `frames` frames (4 by default, at 4 fps: 1 s) of `size` x `size` pixels on a plain or noisy light
background. Question types (answers balanced within each type):

- `direction`: "Which way does the square move?" -> left | right | up | down. One shaded square of `size / 3`
  pixels (red rising from its left side to its right, blue from its top to its bottom) moving `size / 28` pixels
  per frame (less in a clip too long for that path to stay inside the frame): the shading makes the motion show
  inside every patch the square covers (each pixel turns less red when it moves right, more blue when it moves
  up, ...), not only along its edges, which is what a video encoder trained from scratch on a CPU learns to read
  within minutes (with flat colors, where only the edges change, it answers blind for hundreds of steps).
- `motion`: "Does the square move or stay still?" -> moving | still. The same shaded square, moving as above or not.
- `turn`: "What color does the circle turn?" -> one of COLORS. One still, flat object (circle, square or triangle)
  of `size / 3` pixels that shows another color in the first half of the clip and the answer's in the second half.

The blind baseline (the most common answer per question type, what a model gets without looking) is therefore
1/4 for direction and turn and 1/2 for motion; 1/3 over the balanced mix.

(A question that binds a color to motion, "What color is the moving object?" with a second, still object, was at
20-43% (blind: 25%) after 250-350 steps of the demo's model, when direction and motion were at 100%;
docs/benchmarks.md has the measurements.)
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from vlmctl.data.synthetic import COLORS, SHAPES, _draw_shape, media_question, write_records

# numpy and PIL are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not pay
# for them.
# av (an optional dependency) is imported only where used, so the rest works without it.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

QUESTION_TYPES = ("direction", "motion", "turn")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
"""Answer -> unit step (dx, dy) in image coordinates (y grows downwards)."""
MOTIONS = ("moving", "still")
SHADED = "shaded"
"""The color of the shaded square (`_shaded_square`) in an object's `colors`."""


def _track(rng: random.Random, size: int, side: int, step: tuple[int, int], frames: int) -> list[tuple[int, int]]:
    """Top-left corners, one per frame, of an object of `side` px moving by `step` px per frame, placed so that
    the whole path stays inside the frame. A path longer than the frame allows (a long clip) is shortened to the
    frame: the object then moves by the frame's free span spread evenly over the clip (some frames by a pixel
    less, or none), always in the same direction."""
    free = size - side
    span_x, span_y = min(abs(step[0]) * (frames - 1), free), min(abs(step[1]) * (frames - 1), free)
    sx, sy = (step[0] > 0) - (step[0] < 0), (step[1] > 0) - (step[1] < 0)
    x = rng.randint(0, free - span_x) + (span_x if sx < 0 else 0)
    y = rng.randint(0, free - span_y) + (span_y if sy < 0 else 0)
    last = max(frames - 1, 1)
    return [(x + sx * round(t * span_x / last), y + sy * round(t * span_y / last)) for t in range(frames)]


def _scene(rng: random.Random, qtype: str, size: int, frames: int, answer: str) -> tuple[list[dict], str]:
    """(objects, question) of one clip of `qtype` whose answer is `answer`; each object is {shape, colors (one per
    frame; SHADED: the shaded square), side, track}."""
    side = size // 3
    if qtype in ("direction", "motion"):
        speed = max(1, size // 28)
        if qtype == "direction":
            dx, dy = DIRECTIONS[answer]
            question = "Which way does the square move?"
        else:
            dx, dy = rng.choice(list(DIRECTIONS.values())) if answer == "moving" else (0, 0)
            question = "Does the square move or stay still?"
        track = _track(rng, size, side, (dx * speed, dy * speed), frames)
        return [{"shape": "square", "colors": [SHADED] * frames, "side": side, "track": track}], question
    shape, first = rng.choice(SHAPES), rng.choice([c for c in COLORS if c != answer])
    colors = [first] * (frames // 2) + [answer] * (frames - frames // 2)
    track = _track(rng, size, side, (0, 0), frames)
    return [{"shape": shape, "colors": colors, "side": side, "track": track}], f"What color does the {shape} turn?"


def _shaded_square(side: int):
    """The shaded square's pixels [side, side, 3] uint8: red rising from 0 at its left column to 255 at its right,
    blue from 0 at its top row to 255 at its bottom, green 60."""
    import numpy as np

    ramp = np.linspace(0, 255, side)
    square = np.full((side, side, 3), 60, np.uint8)
    square[..., 0] = ramp[None, :]
    square[..., 2] = ramp[:, None]
    return square


def _render(rng: random.Random, objects: list[dict], size: int, frames: int):
    """Frames [frames, size, size, 3] uint8: one background for the clip, the objects drawn at their track's
    corner in each frame (no antialiasing)."""
    import numpy as np
    from PIL import Image, ImageDraw

    if rng.random() < 0.5:
        shade = rng.randint(225, 255)
        background = Image.new("RGB", (size, size), (shade, shade, shade))
    else:
        noise = np.random.default_rng(rng.randint(0, 2**31)).integers(215, 256, size=(size, size), dtype=np.uint8)
        background = Image.fromarray(noise, "L").convert("RGB")
    out = np.empty((frames, size, size, 3), np.uint8)
    for t in range(frames):
        img = background.copy()
        draw = ImageDraw.Draw(img)
        for o in objects:
            x, y = o["track"][t]
            side = o["side"]
            if o["colors"][t] != SHADED:
                _draw_shape(draw, o["shape"], (x, y, x + side - 1, y + side - 1), COLORS[o["colors"][t]])
        out[t] = np.asarray(img)
        for o in objects:
            if o["colors"][t] == SHADED:
                x, y = o["track"][t]
                out[t, y:y + o["side"], x:x + o["side"]] = _shaded_square(o["side"])
    return out


def encode_mp4(frames, fps: int) -> bytes:
    """Frames [T, H, W, 3] uint8 RGB (H and W even) -> an H.264 MP4 clip at `fps` frames per second (yuv420p,
    constant quality 18: colors stay close to the drawn ones). Returns the file's bytes, the same for the same frames:
    one encoder thread (x264's threads can change a few bytes from run to run, and with them the val split, which
    hashes the bytes) and x264's plain C code (`asm=0`: with its SIMD code a side that is not a multiple of 16, as the
    demo's 56 px, still gave one of two encodings of the same frames, by the state of the process)."""
    import io

    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = int(frames.shape[2]), int(frames.shape[1]), "yuv420p"
        stream.options = {"crf": "18", "threads": "1", "x264-params": "asm=0"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def generate_moving_shapes(out_dir: Path, num_samples: int = 1200, seed: int = 0, size: int = 56, frames: int = 4,
                           fps: int = 4) -> Path:
    """Write `num_samples` clips (MP4 files in `out_dir/videos/` + `moving_shapes.json` in ShareGPT format) under
    `out_dir`.

    Returns the path of the JSON file. Deterministic for (`num_samples`, `seed`, `size`, `frames`, `fps`). Question
    types are balanced round-robin, answers balanced within each type (cycled, so a type's blind baseline is its
    answer count's inverse); the sample id is `<question type>-<index>`. Clips are `frames` frames of `size` x
    `size` pixels at `fps` frames per second (`frames` / `fps` seconds). No two clips have the same question, answer
    and frames.

    Raises ValueError for a `size` that is not an even number of at least 28 pixels (H.264 in yuv420p needs even
    sides; smaller frames leave no room for a moving object) or fewer than 2 `frames`.
    """
    if size < 28 or size % 2:
        raise ValueError(f"size must be an even number of pixels >= 28, got {size}")
    if frames < 2:
        raise ValueError(f"a clip needs at least 2 frames to show motion, got {frames}")
    out_dir = Path(out_dir)
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    answers_of = {"direction": tuple(DIRECTIONS), "motion": MOTIONS, "turn": tuple(COLORS)}
    seen: set[bytes] = set()
    records = []
    for i in range(num_samples):
        qtype = QUESTION_TYPES[i % len(QUESTION_TYPES)]
        nth = i // len(QUESTION_TYPES)
        # the n-th sample of a type takes its answers in a shuffled cycle: balanced, but not in a fixed order
        answers = answers_of[qtype]
        answer = random.Random(f"{seed}:{qtype}:{nth // len(answers)}").sample(answers, len(answers))[nth % len(answers)]
        while True:
            objects, question = _scene(rng, qtype, size, frames, answer)
            clip = _render(rng, objects, size, frames)
            key = hashlib.blake2b(f"{question}\0{answer}\0".encode() + clip.tobytes(), digest_size=16).digest()
            if key not in seen:  # a plain background can repeat a scene exactly: draw another
                seen.add(key)
                break
        sid = f"{qtype}-{i:05d}"
        name = f"videos/{sid}.mp4"
        (out_dir / name).write_bytes(encode_mp4(clip, fps))
        records.append(media_question(sid, "video", name, question, answer))
    return write_records(out_dir / "moving_shapes.json", records)


__all__ = ["QUESTION_TYPES", "DIRECTIONS", "MOTIONS", "SHADED", "generate_moving_shapes", "encode_mp4"]
