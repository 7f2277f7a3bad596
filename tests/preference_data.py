"""Preference records written like the upstream examples (LLaMA-Factory data/README.md and dpo_en_demo.json; TRL
docs "Dataset formats", preference; ms-swift docs "Custom dataset", RLHF), and helpers to write them with images."""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path

from PIL import Image

from vlmctl.data.sample import Sample


def png(color=(200, 30, 30), size=(40, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def write(path: Path, records: list, jsonl: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "images").mkdir(exist_ok=True)
    for i, color in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        (path.parent / "images" / f"{i}.png").write_bytes(png(color))
    text = "\n".join(json.dumps(r) for r in records) + "\n" if jsonl else json.dumps(records, indent=2)
    path.write_text(text)
    return path


def answers(s: Sample) -> tuple[str, str]:
    text = lambda m: " ".join(p["text"] for p in m["content"] if p["type"] == "text")  # noqa: E731
    return text(s.messages[-1]), text(s.rejected)


LLAMAFACTORY = [
    {"conversations": [{"from": "human", "value": "<image>What color is the square?"}],
     "chosen": {"from": "gpt", "value": "Red."}, "rejected": {"from": "gpt", "value": "Blue."}, "images": ["images/0.png"]},
    {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}, {"from": "human", "value": "Again."}],
     "chosen": {"from": "gpt", "value": "Hi again."}, "rejected": {"from": "gpt", "value": "No."}, "system": "Be kind."},
]
TRL = [
    {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the square?"}]}],
     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "Green."}]}],
     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}], "images": ["images/1.png"]},
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},  # standard (string) form
    {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],  # implicit prompt
     "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]},
]
SWIFT = [
    {"messages": [{"role": "system", "content": "You are a helpful assistant"},
                  {"role": "user", "content": "<image>What color is the square?"}, {"role": "assistant", "content": "Blue."}],
     "rejected_response": "Green.", "images": ["images/2.png"]},
    {"messages": [{"role": "user", "content": "<image>Color?"}, {"role": "assistant", "content": "Red."}], "images": ["images/0.png"],
     "rejected_messages": [{"role": "user", "content": "<image>Color?"}, {"role": "assistant", "content": "Pink."}],
     "rejected_images": ["images/0.png"]},
]


def pair_samples(n: int) -> list[Sample]:
    """`n` preference pairs about a coloured picture: chosen = its colour, rejected = another colour, answers of
    different lengths."""
    colors = [("red", (200, 30, 30)), ("green", (30, 200, 30)), ("blue", (30, 30, 200))]
    out = []
    for i in range(n):
        name, rgb = colors[i % 3]
        wrong = colors[(i + 1) % 3][0] + " or maybe " * (i % 2) + colors[(i + 2) % 3][0] * (i % 2)
        user = {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What color is the square?"}]}
        out.append(Sample(id=f"pair{i}", messages=[user, {"role": "assistant", "content": [{"type": "text", "text": name}]}],
                          images=[png(rgb)], rejected={"role": "assistant", "content": [{"type": "text", "text": wrong}]}))
    return out


def write_pair_shards(folder: Path, n: int) -> None:
    """`n` shapes-VQA samples as preference shards (`folder/prepared/train`): chosen = the generated answer, rejected
    = the next different answer of the same question type in generation order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.sample import Sample, arrow_schema
    from vlmctl.data.synthetic import generate_shapes_vqa

    records = json.loads(generate_shapes_vqa(folder / "raw", num_samples=n, image_size=64).read_text())
    by_type: dict[str, list[str]] = defaultdict(list)
    for rec in records:
        answer = rec["conversations"][1]["value"]
        if answer not in by_type[rec["id"].split("-")[0]]:
            by_type[rec["id"].split("-")[0]].append(answer)
    samples = []
    for rec in records:
        answer = rec["conversations"][1]["value"]
        options = by_type[rec["id"].split("-")[0]]
        wrong = options[(options.index(answer) + 1) % len(options)]
        if wrong == answer:
            continue
        text = lambda t: {"role": "assistant", "content": [{"type": "text", "text": t}]}  # noqa: E731
        user = {"role": "user", "content": [{"type": "image", "index": 0},
                                            {"type": "text", "text": rec["conversations"][0]["value"].replace("<image>\n", "")}]}
        samples.append(Sample(id=rec["id"], messages=[user, text(answer)], images=[(folder / "raw" / rec["image"]).read_bytes()],
                              source="pairs", rejected=text(wrong)))
    out = folder / "prepared" / "train"
    out.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([s.to_row() for s in samples], schema=arrow_schema(preference=True)),
                   out / "shard-00000.parquet")
