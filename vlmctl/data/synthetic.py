"""Synthetic data: a procedurally generated visual question-answering set (colored shapes, questions about them),
and random chat samples for throughput measurements (`image_chat`, at the end).

The shapes set is used by the `tiny` template and `vlmctl demo`: it needs no download, is deterministic for a
seed, and a model can only answer it well by looking at the image. Written in the LLaVA format (`{id, image,
conversations}`) so it goes through the real readers.

Each picture is a 2 x 2 grid of cells (`image_size / 2` pixels each) on a plain or noisy light background; every
object fills one cell, so at the tiny template's resolution (32 px input, 8 px patches) each object covers 2 x 2
visual tokens and its shape shows in which of them are fully or partly painted. By default a scene holds only the
objects its question is about (`max_distractors=0`): large, local, unambiguous features that a model trained from
scratch on a CPU learns to read within a few minutes (with one-patch objects among distractors it stays blind).
Scenes are built for their question, so that answers are balanced and unambiguous:

- `color`: "What color is the triangle?" -> one of COLORS (the shape appears once)
- `shape`: "What shape is the red object?" -> one of SHAPES (the color appears once)
- `count`: "How many circles are there?" -> "1".."3" (uniform; no zero counts; identical shapes, one per cell)
- `position`: "Is the square on the left or the right?" -> "left" | "right" (the shape appears once, in the
  left or the right column)

The blind baseline (the most common answer per question type, what a model gets without looking) is therefore
1/4 for color, 1/3 for shape and count and 1/2 for position; ~0.35 over the balanced mix.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from vlmctl.data.sample import Sample

# numpy and PIL are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not pay
# for them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTION_TYPES = ("color", "shape", "count", "position")
GRID = 2  # cells per side


def _draw_shape(draw, shape: str, box: tuple[int, int, int, int], fill: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _place(rng: random.Random, specs: list[tuple[str, str]], cell: int, columns: list[int] | None = None) -> list[dict]:
    """Put each (shape, color) in its own grid cell; `columns` pins the first objects' grid columns."""
    free = [(cx, cy) for cx in range(GRID) for cy in range(GRID)]
    rng.shuffle(free)
    margin = max(1, cell // 8)
    objects = []
    for i, (shape, color) in enumerate(specs):
        if columns is not None and i < len(columns):
            cx, cy = columns[i], rng.randrange(GRID)
            free.remove((cx, cy))
        else:
            cx, cy = free.pop()
        # Jitter inside the cell only: an object never crosses into a neighbouring cell (or patch).
        x0 = cx * cell + rng.randint(0, margin)
        y0 = cy * cell + rng.randint(0, margin)
        side = cell - 1 - margin
        objects.append({"shape": shape, "color": color, "column": cx, "box": (x0, y0, x0 + side, y0 + side)})
    return objects


def _scene(rng: random.Random, qtype: str, cell: int, max_distractors: int) -> tuple[list[dict], str, str]:
    """(objects, question, answer) for one sample of `qtype`, with 0..`max_distractors` other objects."""
    colors = list(COLORS)
    n_extra = rng.randint(0, max_distractors)
    if qtype == "color":
        shape, color = rng.choice(SHAPES), rng.choice(colors)
        others = [s for s in SHAPES if s != shape]
        specs = [(shape, color)] + [(rng.choice(others), rng.choice(colors)) for _ in range(n_extra)]
        return _place(rng, specs, cell), f"What color is the {shape}?", color
    if qtype == "shape":
        shape, color = rng.choice(SHAPES), rng.choice(colors)
        others = [c for c in colors if c != color]
        specs = [(shape, color)] + [(rng.choice(SHAPES), rng.choice(others)) for _ in range(n_extra)]
        return _place(rng, specs, cell), f"What shape is the {color} object?", shape
    if qtype == "count":
        shape, n = rng.choice(SHAPES), rng.randint(1, 3)
        others = [s for s in SHAPES if s != shape]
        specs = [(shape, rng.choice(colors)) for _ in range(n)]
        specs += [(rng.choice(others), rng.choice(colors)) for _ in range(min(n_extra, 4 - n))]
        return _place(rng, specs, cell), f"How many {shape}s are there?", str(n)
    shape = rng.choice(SHAPES)
    others = [s for s in SHAPES if s != shape]
    side = rng.choice(("left", "right"))
    column = rng.randrange(GRID // 2) + (0 if side == "left" else GRID // 2)
    specs = [(shape, rng.choice(colors))] + [(rng.choice(others), rng.choice(colors)) for _ in range(n_extra)]
    return _place(rng, specs, cell, columns=[column]), f"Is the {shape} on the left or the right?", side


def _render(rng: random.Random, objects: list[dict], size: int):
    import numpy as np
    from PIL import Image, ImageDraw

    if rng.random() < 0.5:
        shade = rng.randint(225, 255)
        img = Image.new("RGB", (size, size), (shade, shade, shade))
    else:
        noise = np.random.default_rng(rng.randint(0, 2**31)).integers(215, 256, size=(size, size), dtype=np.uint8)
        img = Image.fromarray(noise, "L").convert("RGB")
    draw = ImageDraw.Draw(img)
    for o in objects:
        _draw_shape(draw, o["shape"], o["box"], COLORS[o["color"]])
    return img


def _is_new(seen: set[bytes], question: str, answer: str, image) -> bool:
    """Record the sample's text and pixels in `seen`; False when they were there already."""
    key = hashlib.blake2b(f"{question}\0{answer}\0".encode() + image.tobytes(), digest_size=16).digest()
    if key in seen:
        return False
    seen.add(key)
    return True


def generate_shapes_vqa(out_dir: Path, num_samples: int = 3000, seed: int = 0, image_size: int = 64,
                        max_distractors: int = 0) -> Path:
    """Write `num_samples` samples (PNG images + `shapes_vqa.json` in LLaVA format) under `out_dir`.

    Returns the path of the JSON file. Deterministic for (`num_samples`, `seed`, `image_size`). Question types are
    balanced round-robin and the sample id is `<question type>-<index>`; each scene has the objects its question
    needs plus 0..`max_distractors` others. No two samples have the same question, answer and pixels (the set
    passes `vlmctl data validate`). Images are `image_size` x `image_size` RGB PNGs in `out_dir/images/`
    (`image_size` >= 16).

    Raises ValueError when `max_distractors` does not fit the grid (at most GRID * GRID - 1 = 3).
    """
    if not 0 <= max_distractors < GRID * GRID:
        raise ValueError(f"max_distractors must be in 0..{GRID * GRID - 1} (a {GRID} x {GRID} grid), got {max_distractors}")
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cell = image_size // GRID
    records = []
    seen: set[bytes] = set()
    for i in range(num_samples):
        qtype = QUESTION_TYPES[i % len(QUESTION_TYPES)]
        objects, question, answer = _scene(rng, qtype, cell, max_distractors)
        sid = f"{qtype}-{i:05d}"
        name = f"images/{sid}.png"
        image = _render(rng, objects, image_size)
        # A plain background with the same objects at the same offsets repeats an earlier sample exactly, which
        # `vlmctl data validate` reports as a duplicate: draw the same scene on other backgrounds (from a generator
        # of this sample's own, so the samples after it stay as they were) until it is new.
        attempt = 0
        while not _is_new(seen, question, answer, image):
            attempt += 1
            image = _render(random.Random(f"{seed}:{i}:{attempt}"), objects, image_size)
        image.save(out_dir / name, optimize=False)
        records.append({
            "id": sid,
            "image": name,
            "conversations": [
                {"from": "human", "value": f"<image>\n{question} Answer with one word."},
                {"from": "gpt", "value": answer},
            ],
        })
    return write_records(out_dir / "shapes_vqa.json", records)


def media_question(sid: str, media: str, name: str, question: str, answer: str) -> dict:
    """One ShareGPT record (LLaMA-Factory's layout) of a generated set: the user asks `question` about the file
    `name` (a path relative to the JSON file) of modality `media` ("video", "audio": the `<video>` / `<audio>`
    placeholder and the `videos` / `audios` list), the assistant answers `answer` in one word."""
    return {
        "id": sid,
        "messages": [
            {"role": "user", "content": f"<{media}>{question} Answer with one word."},
            {"role": "assistant", "content": answer},
        ],
        f"{media}s": [name],
    }


def write_records(path: Path, records: list[dict]) -> Path:
    """Write a generated set's records as one JSON array to `path` (through a temporary file, renamed). Returns
    `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Random chat samples: the workload of `vlmctl bench` (vlmctl.bench), encoded by the model's own processor
# ---------------------------------------------------------------------------------------------------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def random_image(side: int, seed: int | tuple[int, ...]) -> bytes:
    """A `side` x `side` px RGB PNG of uniform random pixels, deterministic for `seed`. Stored without compression:
    noise does not compress, and a level-0 PNG is written and decoded fastest. Returns the encoded bytes."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG", compress_level=0)
    return out.getvalue()


def word_texts(num_texts: int = 400, words_per_text: int = 24, vocabulary: int = 64, seed: int = 0) -> list[str]:
    """`num_texts` lines of `words_per_text` pseudo-words drawn from `vocabulary` random lowercase words (3 to 5
    letters): text to train a tokenizer on where a random-init model has none (a few distinct, frequent words, so
    most of them become one token each). Deterministic for `seed`."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5))) for _ in range(vocabulary)]
    return [" ".join(rng.choice(words) for _ in range(words_per_text)) for _ in range(num_texts)]


def single_token_words(tokenizer, limit: int = 4096) -> list[str]:
    """Up to `limit` strings of a space and two or more lowercase ASCII letters (" word") that `tokenizer` (a
    transformers tokenizer) encodes as exactly one token, in vocabulary order. Concatenated, n of them encode as n
    tokens with byte-level BPE and SentencePiece tokenizers, whose pre-tokenizers split before each space. Returns an
    empty list for a vocabulary without such tokens."""
    import re

    pattern = re.compile(r" [a-z]{2,}")
    special = set(tokenizer.all_special_ids)
    words = []
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if index in special:
            continue
        text = tokenizer.convert_tokens_to_string([token])
        if pattern.fullmatch(text) and len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1:
            words.append(text)
            if len(words) >= limit:
                break
    return words


def random_text(words: list[str], num_words: int, rng: random.Random) -> str:
    """`num_words` words drawn from `words` (e.g. `single_token_words`: then `num_words` tokens), joined as they
    are: each word keeps its leading space, the first one too, so that it stays the one token it was chosen as."""
    return "".join(rng.choice(words) for _ in range(num_words))


def image_chat(sample_id: str, answer: str, image: bytes) -> Sample:
    """One user turn holding one image and one assistant turn answering with `answer` (the tokens the trainer's
    collator labels): the shape of every sample `vlmctl bench` trains on."""
    return Sample(
        id=sample_id,
        messages=[
            {"role": "user", "content": [{"type": "image", "index": 0}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        images=[image],
        source="synthetic",
    )
