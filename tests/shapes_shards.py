"""Prepared training shards of generated shapes-VQA samples, for tests that train without `vlmctl data prepare`."""

from __future__ import annotations

import json
from pathlib import Path


def write_shapes_shards(folder: Path, n: int, *, text_only_every: int = 3) -> None:
    """`n` generated shapes-VQA samples (64 px images) as `folder/prepared/train/shard-00000.parquet`; with
    `text_only_every` k > 0, every k-th sample (indices k-1, 2k-1, ...) is text-only (the question without its
    image). The generator's raw files stay in `folder/raw`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.sample import Sample, arrow_schema
    from vlmctl.data.synthetic import generate_shapes_vqa

    raw = generate_shapes_vqa(folder / "raw", num_samples=n, image_size=64)
    samples = []
    for i, rec in enumerate(json.loads(raw.read_text())):
        question = rec["conversations"][0]["value"].replace("<image>\n", "")
        answer = {"role": "assistant", "content": [{"type": "text", "text": rec["conversations"][1]["value"]}]}
        if text_only_every and i % text_only_every == text_only_every - 1:
            user = {"role": "user", "content": [{"type": "text", "text": question}]}
            samples.append(Sample(id=rec["id"], messages=[user, answer], source="text_only"))
        else:
            user = {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": question}]}
            img = (folder / "raw" / rec["image"]).read_bytes()
            samples.append(Sample(id=rec["id"], messages=[user, answer], images=[img], source="shapes_vqa.json"))
    out = folder / "prepared" / "train"
    out.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([s.to_row() for s in samples], schema=arrow_schema()), out / "shard-00000.parquet")


def build_tiny_models(root: Path, n: int, presets=("tiny-qwen2.5-vl", "tiny")) -> Path:
    """`n` shapes-VQA samples as shards under `root/data` (every third text-only) and each preset of `presets` built
    in fp32 with random weights under `root/<preset>`; returns `root`."""
    from convert_helpers import TEXTS
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    write_shapes_shards(root / "data", n)
    for preset in presets:
        build_model(ModelSection(preset=preset, init="random", output_dir=root / preset, dtype="fp32"), tokenizer_texts=TEXTS)
    return root


def packed_rows(folder: Path, data: Path, n: int, per_row: int | None = None):
    """`n` packed rows of `per_row` shard samples each (default: the shards split evenly), as the trainer builds them:
    its collator, the family's batch hook applied."""
    import torch

    from vlmctl.data.collate import PackedCollator
    from vlmctl.data.loader import ShardDataset
    from vlmctl.models import load_model

    model, processor, family = load_model(folder, dtype=torch.float32)
    hook = family.position_hook(model, getattr(model.config, "image_token_id", None))
    dataset = ShardDataset.from_dir(data / "prepared" / "train")
    collate = PackedCollator(processor, family, tokens_per_batch=10**6)
    per_row = per_row or len(dataset) // n
    rows = [collate([dataset[i] for i in range(k * per_row, (k + 1) * per_row)]) for k in range(n)]
    return [hook(r) if hook else r for r in rows]
