"""`vlmctl train` end to end on GPUs: a real-size random-init LLaVA (SigLIP so400m/14 at 384 px + Qwen2.5-1.5B),
the generated shapes VQA set, torchrun over the visible GPUs, FSDP2 and ZeRO-3, bf16.

Usage (CUDA machine): python benchmarks/bench_train_gpu.py OUT_DIR [STRATEGY ...]   (default: fsdp zero3)
Environment: STEPS (50), MICRO_BATCH (8), NPROC (visible GPUs), OVERRIDES (extra section.key=value overrides).
Prints one RESULT line per strategy: steady-state step time, tokens/s (text + visual), MFU, peak memory, first and
last loss, and the wall time of the whole command (start-up, checkpoint at the last step and final export included).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def write_shards(root: Path, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.sample import Sample, arrow_schema
    from vlmctl.data.synthetic import generate_shapes_vqa

    raw = generate_shapes_vqa(root / "raw", num_samples=n, image_size=128)
    rows = []
    for rec in json.loads(raw.read_text()):
        question = rec["conversations"][0]["value"].replace("<image>\n", "")
        messages = [{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": question}]},
                    {"role": "assistant", "content": [{"type": "text", "text": rec["conversations"][1]["value"]}]}]
        rows.append(Sample(id=rec["id"], messages=messages, images=[(root / "raw" / rec["image"]).read_bytes()]).to_row())
    out = root / "prepared" / "train"
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema()), out / "shard-00000.parquet")


def main() -> None:
    root = Path(sys.argv[1]).resolve()
    strategies = sys.argv[2:] or ["fsdp", "zero3"]
    steps = int(os.environ.get("STEPS", 50))
    micro = int(os.environ.get("MICRO_BATCH", 8))
    import torch

    nproc = int(os.environ.get("NPROC", torch.cuda.device_count()))
    extra = os.environ.get("OVERRIDES", "").split()  # e.g. OVERRIDES="train.packing=false"
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (root / "prepared").is_dir():
        write_shards(root, 2048)
    if not (root / "model").is_dir():
        from vlmctl.config import ModelSection
        from vlmctl.models import build_model

        texts = [json.dumps(json.loads((root / "raw" / "shapes_vqa.json").read_text())[:200])]
        build_model(ModelSection(vision="siglip-so400m", llm="qwen2.5-1.5b", init="random", output_dir=root / "model"),
                    tokenizer_texts=texts)
    print(f"setup {time.perf_counter() - t0:.0f} s", flush=True)
    (root / "vlmctl.yaml").write_text(f"""
project: {{name: bench}}
data: {{prepared_dir: prepared, max_length: 2048}}
model: {{output_dir: model}}
train:
  stage: full
  precision: bf16
  learning_rate: 1.0e-4
  warmup_ratio: 0.1
  micro_batch_size: {micro}
  max_steps: {steps}
  save_steps: {steps}
  logging_steps: 1
  num_workers: 4
  output_dir: runs
""")
    for strategy in strategies:
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "vlmctl", "-c", str(root / "vlmctl.yaml"), "train", "--launcher", "torchrun",
               "--nproc-per-node", str(nproc), "--strategy", strategy, f"train.run_name={strategy}-{nproc}gpu", *extra]
        print("$", " ".join(cmd), flush=True)
        code = subprocess.run(cmd, cwd=root).returncode
        wall = time.perf_counter() - start
        log = root / "runs" / f"{strategy}-{nproc}gpu" / "metrics.jsonl"
        rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []
        steady = rows[10:] or rows
        if not steady:
            print(f"RESULT {strategy} failed (exit {code}) after {wall:.0f} s", flush=True)
            continue
        step_time = statistics.median(r["step_time_s"] for r in steady)
        print(f"RESULT {strategy} gpus={nproc} global_batch={micro * nproc} steps={len(rows)} exit={code} "
              f"step_time={step_time:.3f}s tokens/s={statistics.median(r['tokens_per_s'] for r in steady):.0f} "
              f"(text {statistics.median(r['text_tokens_per_s'] for r in steady):.0f}, "
              f"visual {statistics.median(r['visual_tokens_per_s'] for r in steady):.0f}) "
              f"mfu={statistics.median((r['mfu'] or 0) for r in steady):.3f} mem={max((r['memory_gib'] or 0) for r in rows):.1f}GiB "
              f"loss {rows[0]['loss']:.3f}->{rows[-1]['loss']:.3f} wall={wall:.0f}s", flush=True)


if __name__ == "__main__":
    main()
