"""Video clips for benchmarks/video_train_vs_bench.sh: N real H.264 MP4 clips over every (frames, size) pair (round
robin), listed in ShareGPT format (`{id, messages, videos}` with a `<video>` placeholder), written in parallel.

`vlmctl.data.synthetic_video.generate_moving_shapes` cannot make long clips: its square moves `size / 28` px per
frame and must stay inside the frame, so past ~20 frames it raises ValueError (empty range in `_track`). Here the
shaded square moves 1-4 px per frame and wraps around the frame's edges, on a static noisy light background, and
the clips go through the same encoder (`encode_mp4`: libx264, yuv420p, crf 18).

    python benchmarks/video_clips.py OUT_DIR N FRAMES SIZES FPS   # e.g. clips 480 16,32,48,64 224,336,448 8
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def render(i: int, frames: int, size: int):
    """Frames [frames, size, size, 3] uint8 of clip `i` and its answer (the direction the square moves)."""
    import numpy as np

    rng = np.random.default_rng(i)
    answer = list(DIRECTIONS)[i % len(DIRECTIONS)]
    dx, dy = DIRECTIONS[answer]
    speed = int(rng.integers(1, 5))
    background = np.repeat(rng.integers(215, 256, size=(size, size, 1), dtype=np.uint8), 3, axis=2)
    side = size // 3
    ramp = np.linspace(0, 255, side)
    square = np.full((side, side, 3), 60, np.uint8)
    square[..., 0], square[..., 2] = ramp[None, :], ramp[:, None]
    x0, y0 = (int(v) for v in rng.integers(0, size, 2))
    out = np.empty((frames, size, size, 3), np.uint8)
    rows, cols = np.arange(side), np.arange(side)
    for t in range(frames):
        out[t] = background
        x, y = (x0 + dx * speed * t) % size, (y0 + dy * speed * t) % size
        out[t][np.ix_((y + rows) % size, (x + cols) % size)] = square  # wraps around the edges
    return out, answer


def write_clip(args) -> dict:
    out_dir, i, frames, size, fps = args
    from vlmctl.data.synthetic_video import encode_mp4

    clip, answer = render(i, frames, size)
    name = f"videos/{frames}x{size}-{i:05d}.mp4"
    (Path(out_dir) / name).write_bytes(encode_mp4(clip, fps))
    return {"id": f"{frames}x{size}-{i:05d}",
            "messages": [{"role": "user", "content": "<video>Which way does the square move? Answer with one word."},
                         {"role": "assistant", "content": answer}],
            "videos": [name]}


def main(out_dir: str, n: str, frames: str, sizes: str, fps: str) -> None:
    pairs = [(int(f), int(s)) for f in frames.split(",") for s in sizes.split(",")]
    (Path(out_dir) / "videos").mkdir(parents=True, exist_ok=True)
    jobs = [(out_dir, i, *pairs[i % len(pairs)], int(fps)) for i in range(int(n))]
    jobs.sort(key=lambda j: -j[2] * j[3] ** 2)  # the longest clips first: the pool's last jobs are short
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        records = sorted(pool.map(write_clip, jobs, chunksize=1), key=lambda r: r["id"])
    Path(out_dir, "all.json").write_text(json.dumps(records))
    print(f"{len(records)} clips: {frames} frames x {sizes} px at {fps} fps")


if __name__ == "__main__":
    main(*sys.argv[1:])
