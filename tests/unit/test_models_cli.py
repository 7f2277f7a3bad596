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


def test_model_build_cli(tmp_path, capsys, monkeypatch):
    import vlmctl.models.summary

    monkeypatch.setattr(vlmctl.models.summary, "training_device", lambda launcher: "cuda")  # as on a GPU machine
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


def test_memory_estimate_splits_the_language_model_over_tensor_parallel_ranks():
    params = {"vision": 400, "projector": 100, "llm": 1500, "total": 2000}
    full = trained_parts("full")
    # 4 processes, TP=2 under FSDP2: the language model split over 2 ranks and sharded over the 2 data-parallel
    # ones (1/4 each); the vision tower and projector replicated over the tp ranks, sharded over dp only (1/2)
    tp = memory_per_gpu(params, full, strategy="fsdp", num_gpus=4, tensor_parallel=2)
    assert tp["total"] == 16 * 1500 // 4 + 16 * 500 // 2
    # one tensor-parallel group without data parallelism: only the language model is split
    alone = memory_per_gpu(params, full, strategy="ddp", num_gpus=2, tensor_parallel=2)
    assert alone["total"] == 16 * 1500 // 2 + 16 * 500


def test_memory_estimate_follows_device_and_precision(tmp_path, capsys, monkeypatch):
    # The tiny template's settings on a machine without a GPU: 2 CPU processes in fp32, not "2 GPU(s), bf16".
    import vlmctl.models.summary as summary

    monkeypatch.setattr(summary, "training_device", lambda launcher: "cpu")
    cfg = _project(tmp_path)
    code, out, err = run(["-c", str(cfg), "model", "build", "train.stage=full", "train.precision=auto"], capsys)
    assert code == 0, err
    text = " ".join(out.split())
    assert "Training memory per process (fsdp, 2 process(es) on CPU, fp32 + AdamW, without activations)" in text
    assert "GPU" not in text and "bf16" not in text
    code, out, err = run(["-c", str(cfg), "model", "build", "--force", "--json", "train.stage=full"], capsys)
    s = json.loads(out)["summary"]
    total = s["parameters"]["total"]
    assert (s["device"], s["num_processes"], s["num_gpus"], s["precision"]) == ("cpu", 2, 0, "fp32")
    assert s["bytes_per_parameter"] == {"weight": 4, "grad": 4, "optim": 8, "frozen": 4}
    assert s["memory_per_gpu_bytes"]["total"] == 16 * total // 2
    # The same project on GPUs: auto precision is bf16, and auto master weights bf16 (stochastic rounding): 8 bytes
    # per trained parameter; fp32 master weights set by hand double it.
    monkeypatch.setattr(summary, "training_device", lambda launcher: "cuda")
    code, out, err = run(["-c", str(cfg), "model", "build", "--force", "train.stage=full", "train.nproc_per_node=4"],
                         capsys)
    assert code == 0, err
    assert ("Training memory per GPU (fsdp, 4 GPU(s), bf16 weights + AdamW (stochastic rounding by default), without "
            "activations)") in " ".join(out.split())
    code, out, err = run(["-c", str(cfg), "model", "build", "--force", "--json", "train.stage=full",
                          "train.nproc_per_node=4", "train.master_weights=fp32"], capsys)
    s = json.loads(out)["summary"]
    assert s["bytes_per_parameter"] == {"weight": 4, "grad": 4, "optim": 8, "frozen": 2}
    assert s["master_weights"] == "fp32" and s["memory_per_gpu_bytes"]["total"] == 16 * total // 4
    # launcher none trains in this one process whatever nproc_per_node says
    code, out, err = run(["-c", str(cfg), "model", "build", "--force", "--json", "train.launcher=none"], capsys)
    assert json.loads(out)["summary"]["num_processes"] == 1


def test_memory_per_parameter_by_strategy_and_precision():
    from vlmctl.models.summary import ParamBytes, param_bytes, training_summary

    info = {"family": "llava", "parameters": {"vision": 4, "projector": 1, "llm": 15, "total": 20}}
    precision = lambda p, d: training_summary(info, stage="full", strategy="ddp", num_gpus=1, device=d, precision=p)["precision"]  # noqa: E731
    assert precision("auto", "cpu") == "fp32" and precision("auto", "cuda") == "bf16" and precision("fp16", "cpu") == "fp16"
    assert param_bytes("fsdp", "bf16") == ParamBytes(4, 4, 8, 2)  # fp32 master weights, bf16 compute, frozen in bf16
    assert param_bytes("ddp", "fp32") == ParamBytes(4, 4, 8, 4)
    assert param_bytes("fsdp", "bf16", "bf16") == ParamBytes(2, 2, 4, 2)  # pure bf16
    assert param_bytes("zero3", "bf16") == ParamBytes(2, 2, 12, 2)  # the ZeRO paper's mixed precision
    assert param_bytes("zero2", "fp32") == ParamBytes(4, 4, 8, 4)
    assert param_bytes("fsdp", "bf16", optimizer_in_backward=True).grad == 0
    params = {"vision": 400, "projector": 100, "llm": 1500, "total": 2000}
    info = {"family": "llava", "parameters": params}
    # align on 2 CPU processes with DDP: frozen parts in fp32 (4 B), the projector 16 B; nothing sharded
    s = training_summary(info, stage="align", strategy="ddp", num_gpus=2, device="cpu")
    assert s["memory_per_gpu_bytes"]["total"] == 4 * 1900 + 16 * 100
    # QLoRA: the frozen LLM in 4 bits, the rest in the compute dtype
    s = training_summary(info, stage="finetune", strategy="ddp", num_gpus=1, device="cuda", lora=True, quantize="4bit")
    assert s["memory_per_gpu_bytes"]["weights"] == 2 * 400 + 2 * 100 + 1500 // 2
    assert "4bit" in s["storage"]


def test_model_build_cli_reports_the_region_seeded_perceiver(tmp_path, capsys):
    cfg = _project(tmp_path)
    cfg.write_text("project: {name: t}\nmodel: {vision: tiny, llm: tiny, init: random, projector: perceiver, perceiver_queries: 16, "
                   "perceiver_depth: 1, perceiver_heads: 4, dtype: fp32}\ntrain: {stage: align}\n")
    code, out, err = run(["-c", str(cfg), "model", "build"], capsys)
    assert code == 0, err
    share = json.loads((tmp_path / "outputs" / "model" / "vlmctl_model.json").read_text())["resampler_own_cell_attention"]
    assert "Perceiver resampler seeded by region" in out and f"{share[0]:.0%}" in out
    code, out, err = run(["-c", str(cfg), "model", "build", "--force", "model.perceiver_init=random"], capsys)
    assert code == 0, err
    assert "seeded by region" not in out
    assert "resampler_own_cell_attention" not in json.loads((tmp_path / "outputs" / "model" / "vlmctl_model.json").read_text())
