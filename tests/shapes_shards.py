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
