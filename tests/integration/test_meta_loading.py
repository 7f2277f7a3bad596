"""Weights read once per run: under fsdp and ddp on 2 CPU ranks (gloo), rank 0 alone reads the tiny model's weights
and rank 1 builds it on the meta device, then holds only its shards (fsdp); training and the final export give
exactly what every rank loading the full model gave (the path before `setup.rank0_loads`).

Run as a script (`torchrun --nproc_per_node 2 tests/integration/test_meta_loading.py MODEL_DIR OUT VARIANT...`) this
file is the worker: for each variant it trains one step on the probe batch with the worker's own steps
(`load_model_for_training`, `wrap_model`, `export_final`), then again with every rank loading the full model, and
writes what each rank saw to OUT/VARIANT/rank<r>.json and both exports to OUT/VARIANT/{new,old}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
VARIANTS = {  # train section overrides per variant
    "fsdp-full": {"strategy": "fsdp", "stage": "full"},
    "fsdp-lora": {"strategy": "fsdp", "stage": "finetune", "activation_checkpointing": "full",
                  "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
    "ddp-full": {"strategy": "ddp", "stage": "full"},
}


# --------------------------------------------------------------------------------------------------------------------
# Worker (runs under torchrun)


def _config(model_dir: Path, out: Path, variant: str):
    import yaml

    from vlmctl.config import load_config

    train = {"precision": "fp32", "learning_rate": 1e-3, "warmup_ratio": 0.0, "packing": False, "max_grad_norm": 1.0,
             "activation_checkpointing": "off", **VARIANTS[variant]}
    cfg = {"project": {"name": "meta"}, "model": {"preset": "tiny", "init": "random", "output_dir": str(model_dir)},
           "train": train}
    path = out / f"config-{os.environ['RANK']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(model) -> int:
    """Bytes of parameter storage this rank holds (its shards under FSDP2; nothing for meta tensors)."""
    return sum(_local(p).numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def _step(wrapped, batch) -> tuple[float, float]:
    """(loss before, loss after) one optimizer step of the engine `wrapped` on `batch`."""
    import torch

    from vlmctl.train.objectives import SFTObjective

    objective = SFTObjective()
    batch = {**batch, "num_label_tokens": int((batch["labels"][:, 1:] != -100).sum())}  # as the collators count them
    loss = wrapped.forward(objective, batch).loss
    wrapped.backward(loss, 1.0)
    wrapped.step(False)
    with torch.no_grad():
        return float(loss), float(wrapped.forward(objective, batch).loss)


def _old_export(out: Path, cfg, model, *, source: str, trainable: set[str], rank: int) -> None:
    """`export_final` as it was when every rank loaded the full model: the full state dict gathered on rank 0, loaded
    into a freshly loaded fp32 model of the source, LoRA merged in fp32, saved in fp32 (training ran in fp32)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from vlmctl.convert import merge_lora_model
    from vlmctl.train.setup import apply_lora, load_source, model_parts

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        fresh, processor, family = load_source(source, cfg, dtype=torch.float32)
        if cfg.train.lora is not None:
            fresh = apply_lora(fresh, cfg.train.lora, model_parts(fresh, family), trainable)
        fresh.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        if cfg.train.lora is not None:
            fresh = merge_lora_model(fresh, torch.float32)
        fresh.save_pretrained(out / "final")


def _run_variant(model_dir: Path, out: Path, variant: str) -> None:
    import torch
    import torch.distributed as dist

    from vlmctl.convert import probe_inputs
    from vlmctl.train import setup
    from vlmctl.train.export import export_final
    from vlmctl.train.worker import load_model_for_training, wrap_model

    out = out / variant
    out.mkdir(parents=True, exist_ok=True)
    cfg = _config(model_dir, out, variant)
    ctx = setup.setup_run(cfg.train)
    rank = ctx.env.rank
    facts: dict = {"rank": rank}

    # the worker's path: rank 0 reads the weights, the other ranks build the model empty
    tm = load_model_for_training(cfg, ctx)
    facts["new_meta_params"] = sum(p.is_meta for p in tm.model.parameters())
    facts["params"] = len(list(tm.model.parameters()))
    facts["new_bytes_before_wrap"] = _storage_bytes(tm.model)
    facts["model_bytes"] = sum(p.numel() * p.element_size() for p in tm.model.parameters())
    facts["deferred"] = tm.deferred.source
    facts["rank0_state"] = tm.deferred.state is not None
    rng_new = torch.get_rng_state()
    new = wrap_model(tm, cfg.train, ctx, total_steps=1)
    facts["new_bytes_after_wrap"] = _storage_bytes(new.model)
    facts["meta_after_wrap"] = sum(p.is_meta for p in new.model.parameters())

    # every rank loads the full model (the path before rank 0 alone read the weights)
    setup.seed_everything(cfg.train.seed)
    model, _, family = setup.load_source(tm.source, cfg, dtype=ctx.stored)
    old_tm = setup.prepare_model(model, family, cfg.train, ctx.env.device, compute_dtype=ctx.dtype)
    facts["same_rng_after_load"] = torch.equal(rng_new, torch.get_rng_state())
    old = wrap_model(old_tm, cfg.train, ctx, total_steps=1)

    inputs = probe_inputs(tm.processor)
    batch = {**inputs, "labels": inputs["input_ids"].clone()}
    new_sd, old_sd = new.model.state_dict(), old.model.state_dict()
    facts["same_weights_before_step"] = all(torch.equal(_local(new_sd[k]), _local(old_sd[k])) for k in old_sd)
    facts["same_buffers"] = all(torch.equal(a, b) for (_, a), (_, b) in zip(new.model.named_buffers(), old.model.named_buffers()))
    facts["new_losses"], facts["old_losses"] = _step(new, batch), _step(old, batch)
    new_sd, old_sd = new.model.state_dict(), old.model.state_dict()
    facts["differing_after_step"] = [k for k in old_sd if not torch.equal(_local(new_sd[k]), _local(old_sd[k]))]
    inner = getattr(new.model, "module", new.model)
    facts["tied"] = inner.get_output_embeddings().weight is inner.get_input_embeddings().weight

    for name, wrapped, trained in (("new", new, tm), ("old", old, old_tm)):
        (out / name).mkdir(exist_ok=True)
        dist.barrier()
        if name == "new":
            export_final(out / name, cfg, engine=wrapped, source=tm.source, dtype=ctx.dtype, rank=rank,
                         lora=cfg.train.lora, parts_trainable=trained.trainable)
        else:
            _old_export(out / name, cfg, wrapped.model, source=tm.source, trainable=trained.trainable, rank=rank)
        dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(facts))


def _worker(model_dir: Path, out: Path, variants: list[str]) -> None:
    import torch.distributed as dist

    for variant in variants:
        _run_variant(model_dir, out, variant)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    from convert_helpers import make_tiny_model

    root = tmp_path_factory.mktemp("meta")
    model_dir = make_tiny_model(root / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(HERE.parent), str(HERE)])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(Path(__file__)),
           str(model_dir), str(root / "out"), *VARIANTS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return root / "out"


def _facts(runs: Path, variant: str) -> list[dict]:
    return [json.loads((runs / variant / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rank_1_builds_on_meta_and_trains_exactly_as_when_every_rank_loads(runs, variant):
    rank0, rank1 = _facts(runs, variant)
    # rank 0 read the weights; rank 1 built every parameter on the meta device (no storage at all)
    assert rank0["new_meta_params"] == 0 and rank0["new_bytes_before_wrap"] == rank0["model_bytes"] > 0
    assert rank1["new_meta_params"] == rank1["params"] and rank1["new_bytes_before_wrap"] == 0
    assert rank0["deferred"] == rank1["deferred"] == ("rank0" if variant.startswith("fsdp") else "ddp")
    assert rank0["rank0_state"] == variant.startswith("fsdp") and not rank1["rank0_state"]
    for facts in (rank0, rank1):
        assert facts["meta_after_wrap"] == 0
        if variant.startswith("fsdp"):  # only its shards materialised: about half of the model on each rank
            assert 0.45 < facts["new_bytes_after_wrap"] / facts["model_bytes"] < 0.55
        else:  # DDP replicates: rank 0's weights were broadcast into rank 1's storage
            assert facts["new_bytes_after_wrap"] == facts["model_bytes"]
        assert facts["same_rng_after_load"] and facts["same_buffers"] and facts["tied"]
        assert facts["same_weights_before_step"]
        assert facts["new_losses"] == facts["old_losses"] and facts["new_losses"][1] < facts["new_losses"][0]
        assert facts["differing_after_step"] == []


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_final_export_equals_the_export_of_every_rank_loading(runs, variant):
    import torch
    from safetensors.torch import load_file

    new, old = runs / variant / "new" / "final", runs / variant / "old" / "final"
    a, b = load_file(str(new / "model.safetensors")), load_file(str(old / "model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 50
    assert [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))] == []
    assert json.loads((new / "config.json").read_text()) == json.loads((old / "config.json").read_text())
    assert json.loads((new / "generation_config.json").read_text()) == json.loads((old / "generation_config.json").read_text())
    built = load_file(str(runs.parent / "model" / "model.safetensors"))
    assert any(not torch.equal(a[k], built[k]) for k in a if k in built)  # the export holds the trained weights


def _family_names() -> list[str]:
    from vlmctl.families import FAMILIES

    return sorted(name for name, spec in FAMILIES.items() if spec.tiny_preset)


@pytest.mark.slow
@pytest.mark.parametrize("name", _family_names())
def test_the_empty_build_is_the_loaded_model_without_its_weights(name, tmp_path):
    """Every family's tiny preset, in fp32 and bf16: `build_empty_model` has `load_model`'s parameters and buffers
    (names, shapes, dtypes; tied weights counted once), its buffers' values (computed, not read), its generation config
    and eval mode, and no parameter storage."""
    import torch

    from convert_helpers import TEXTS
    from vlmctl.config import ModelSection
    from vlmctl.families import get_family
    from vlmctl.models import build_model
    from vlmctl.models.load import build_empty_model, load_model

    folder = tmp_path / "model"
    build_model(ModelSection(preset=get_family(name).tiny_preset, init="random", output_dir=folder, dtype="fp32"),
                tokenizer_texts=TEXTS)
    for dtype in (torch.float32, torch.bfloat16):
        loaded, _, family = load_model(folder, dtype=dtype)
        empty, _, empty_family = build_empty_model(folder, dtype=dtype)
        assert empty_family is family
        layout = lambda m: [(n, tuple(t.shape), t.dtype) for n, t in [*m.named_parameters(), *m.named_buffers()]]  # noqa: E731
        assert layout(empty) == layout(loaded)
        assert all(p.is_meta for p in empty.parameters())
        assert all(not b.is_meta and torch.equal(b, a) for (_, a), (_, b) in zip(loaded.named_buffers(), empty.named_buffers()))
        assert empty.generation_config.to_dict() == loaded.generation_config.to_dict()
        assert empty.training is loaded.training is False


def test_ddp_in_one_process_trains_the_model_unwrapped(tmp_path, monkeypatch):
    """One rank under torchrun has nothing to reduce: `wrap_model` leaves the model as it is (DDP would add a bucket
    copy of every gradient), and a step on the probe batch lowers the loss."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from convert_helpers import make_tiny_model
    from vlmctl.convert import probe_inputs
    from vlmctl.distributed.env import free_port
    from vlmctl.train import setup
    from vlmctl.train.worker import load_model_for_training, wrap_model

    model_dir = make_tiny_model(tmp_path / "model")
    # torchrun's variables for one process, as `vlmctl train --nproc-per-node 1` sets them
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    cfg = _config(model_dir, tmp_path, "ddp-full")
    ctx = setup.setup_run(cfg.train)
    try:
        tm = load_model_for_training(cfg, ctx)
        wrapped = wrap_model(tm, cfg.train, ctx, total_steps=1)
        assert not isinstance(wrapped.model, DistributedDataParallel) and wrapped.model is tm.model
        inputs = probe_inputs(tm.processor)
        before, after = _step(wrapped, {**inputs, "labels": inputs["input_ids"].clone()})
        assert after < before
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
