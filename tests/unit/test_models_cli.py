"""`vlmctl model build` on a tiny project: summary table, --json, --force."""

from __future__ import annotations

import json

from vlmctl.models.summary import memory_per_gpu, trained_parts
from cli_runner import run_cli as run




def _project(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.sample import Sample, arrow_schema

    (tmp_path / "vlmctl.yaml").write_text(
        "project: {name: t}\nmodel: {preset: tiny, init: random, dtype: fp32}\n"
        "train: {stage: align, strategy: fsdp, nproc_per_node: 2}\n"
    )
    rows = [Sample(id=f"s{i}", messages=[
        {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What color is the square?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "green"}]},
    ], images=[b"x"]).to_row() for i in range(10)]
    (tmp_path / "data" / "prepared" / "train").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema()), tmp_path / "data" / "prepared" / "train" / "s-0.parquet")
    return tmp_path / "vlmctl.yaml"


def test_model_build_cli(tmp_path, capsys):
    cfg = _project(tmp_path)
    code, out, err = run(["-c", str(cfg), "model", "build"], capsys)
    assert code == 0, err
    assert "vision tower" in out and "projector" in out and "language model" in out
    assert "Visual tokens per image: 64 at 64x64 px" in out and "fsdp, 2 GPU(s)" in out
    assert (tmp_path / "outputs" / "model" / "config.json").is_file()
    code, out, err = run(["-c", str(cfg), "model", "build"], capsys)
    assert code == 1 and "already exists" in err and "--force" in err
    code, out, err = run(["-c", str(cfg), "model", "build", "--force", "--json", "train.stage=finetune"], capsys)
    assert code == 0, err
    data = json.loads(out)
    s = data["summary"]
    assert s["trained"] == {"vision": False, "projector": True, "llm": True}
    assert s["trainable_parameters"] == data["parameters"]["projector"] + data["parameters"]["llm"]
    assert data["visual_tokens_per_image"] == 64


def test_memory_estimate_follows_sharding():
    params = {"vision": 400, "projector": 100, "llm": 1500, "total": 2000}
    full = trained_parts("full")
    ddp = memory_per_gpu(params, full, strategy="ddp", num_gpus=4)
    assert ddp["total"] == 16 * 2000
    assert memory_per_gpu(params, full, strategy="zero3", num_gpus=4)["total"] == 16 * 2000 // 4
    z2 = memory_per_gpu(params, full, strategy="zero2", num_gpus=4)
    assert z2["weights"] == 2 * 2000 and z2["optimizer"] == 12 * 2000 // 4
    align = memory_per_gpu(params, trained_parts("align"), strategy="ddp", num_gpus=1)
    assert align["total"] == 2 * 2000 + 14 * 100
    assert trained_parts("full", freeze=["vision"]) == {"vision": False, "projector": True, "llm": True}
