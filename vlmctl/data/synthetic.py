"""A procedurally generated visual question-answering set: colored shapes, questions about them.

Used by the `tiny` template and `vlmctl demo`: it needs no download, is deterministic for a seed, and a model can
only answer it well by looking at the image (the blind baseline, the most common answer per question type, is
low). Written in the LLaVA format (`{id, image, conversations}`) so it goes through the real readers.

Question types (the prefix of each sample's `id`):
- `color`: "What color is the triangle?" -> one of COLORS
- `shape`: "What shape is the red object?" -> one of SHAPES
- `count`: "How many circles are there?" -> "0".."3"
- `position`: "Is the square left of the circle?" -> "yes" | "no"
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30), "purple": (150, 60, 190)}
SHAPES = ("circle", "square", "triangle")
QUESTION_TYPES = ("color", "shape", "count", "position")


def _draw_shape(draw, shape: str, box: tuple[int, int, int, int], fill: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _scene(rng: random.Random, n_objects: int, size: int, obj: int) -> list[dict]:
    """Place `n_objects` non-overlapping objects on a `size` grid; each {shape, color, box}."""
    cells = [(cx, cy) for cx in range(size // obj) for cy in range(size // obj)]
    rng.shuffle(cells)
    objects = []
    for cx, cy in cells[:n_objects]:
        jitter = max(1, obj // 8)
        x0 = cx * obj + rng.randint(0, jitter)
        y0 = cy * obj + rng.randint(0, jitter)
        side = obj - 2 * jitter
        objects.append({"shape": rng.choice(SHAPES), "color": rng.choice(list(COLORS)), "box": (x0, y0, x0 + side, y0 + side)})
    return objects


def _render(rng: random.Random, objects: list[dict], size: int):
    import numpy as np
    from PIL import Image, ImageDraw

    if rng.random() < 0.5:
        shade = rng.randint(225, 255)
        img = Image.new("RGB", (size, size), (shade, shade, shade))
    else:
        noise = np.random.default_rng(rng.randint(0, 2**31)).integers(200, 256, size=(size, size), dtype=np.uint8)
        img = Image.fromarray(noise, "L").convert("RGB")
    draw = ImageDraw.Draw(img)
    for o in objects:
        _draw_shape(draw, o["shape"], o["box"], COLORS[o["color"]])
    return img


def _question(rng: random.Random, qtype: str, objects: list[dict]) -> tuple[str, str] | None:
    shapes = [o["shape"] for o in objects]
    colors = [o["color"] for o in objects]
    if qtype == "color":
        unique = [o for o in objects if shapes.count(o["shape"]) == 1]
        if not unique:
            return None
        o = rng.choice(unique)
        return f"What color is the {o['shape']}?", o["color"]
    if qtype == "shape":
        unique = [o for o in objects if colors.count(o["color"]) == 1]
        if not unique:
            return None
        o = rng.choice(unique)
        return f"What shape is the {o['color']} object?", o["shape"]
    if qtype == "count":
        shape = rng.choice(SHAPES)
        return f"How many {shape}s are there?", str(shapes.count(shape))
    unique = [o for o in objects if shapes.count(o["shape"]) == 1]
    if len(unique) < 2:
        return None
    a, b = rng.sample(unique, 2)
    if abs(a["box"][0] - b["box"][0]) < 4:
        return None
    return f"Is the {a['shape']} left of the {b['shape']}?", "yes" if a["box"][0] < b["box"][0] else "no"


def generate_shapes_vqa(out_dir: Path, num_samples: int = 3000, seed: int = 0, image_size: int = 64) -> Path:
    """Write `num_samples` samples (PNG images + `shapes_vqa.json` in LLaVA format) under `out_dir`.

    Returns the path of the JSON file. Deterministic for (`num_samples`, `seed`, `image_size`). Question types are
    balanced round-robin. Images are `image_size` x `image_size` RGB PNGs in `out_dir/images/`.
    """
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    obj = image_size // 4
    records = []
    i = 0
    while len(records) < num_samples:
        qtype = QUESTION_TYPES[len(records) % len(QUESTION_TYPES)]
        objects = _scene(rng, rng.randint(1 if qtype != "position" else 2, 4), image_size, obj)
        qa = _question(rng, qtype, objects)
        i += 1
        if qa is None:
            continue
        question, answer = qa
        sid = f"{qtype}-{len(records):05d}"
        name = f"images/{sid}.png"
        _render(rng, objects, image_size).save(out_dir / name, optimize=False)
        records.append({
            "id": sid,
            "image": name,
            "conversations": [
                {"from": "human", "value": f"<image>\n{question} Answer with one word."},
                {"from": "gpt", "value": answer},
            ],
        })
    path = out_dir / "shapes_vqa.json"
    path.write_text(json.dumps(records, indent=1))
    return path
