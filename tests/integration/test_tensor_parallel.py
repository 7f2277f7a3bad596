"""Tensor parallelism (`train.tensor_parallel`, `vlmctl.distributed.tensor_parallel`) on CPU gloo ranks.

- The mesh and the refusals: `dp = world / tp`, the tp ranks out of the data-parallel mesh, sizes that do not divide.
- Gradients: the tiny Qwen2.5-VL, LLaVA (SigLIP + Qwen2) and Qwen3-VL (per-head q/k norms, DeepStack) presets,
  prepared and wrapped as `vlmctl train` does (`prepare_model`, `wrap_model`), with TP=2 on 2 ranks (packed rows and
  a padded micro-batch) and TP=2 x FSDP2 on 4 ranks (two data-parallel groups, one packed row each): the loss and
  every parameter's full gradient equal one process's (TP=1) on the same rows, to fp32 rounding; with float8
  (`train.fp8`, emulated) to float8's rounding, every weight all-gathered with its whole weight's scale.
- Float8 checkpoints under TP=2 resume with fp8 off and back to the same weights, and export plain tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from float8_scales import weight_scales
from shapes_shards import build_tiny_models, packed_rows

pytestmark = pytest.mark.slow
TIMEOUT = 420  # seconds for a training run
PRESETS = ("tiny-qwen2.5-vl", "tiny", "tiny-qwen3-vl")


def test_the_mesh_leaves_tensor_parallel_ranks_out_of_data_parallelism():
    from vlmctl.distributed.mesh import ParallelDims

    dims = ParallelDims.for_strategy("fsdp", 8, sharding="full", ranks_per_node=8, tp=2)
    assert (dims.dp_shard, dims.tp, dims.dp_size, dims.grad_size) == (4, 2, 4, 4)
    assert dims.mesh_dims() == (("dp_shard", "tp"), (4, 2))
    alone = ParallelDims.for_strategy("ddp", 2, sharding="full", ranks_per_node=2, tp=2)
    assert alone.mesh_dims() == (("dp_shard", "tp"), (1, 2)) and alone.dp_size == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "fsdp", "world": 6, "tp": 4}, "does not divide the 6 processes"),
    ({"strategy": "ddp", "world": 4, "tp": 2}, "needs train.strategy=fsdp"),
    ({"strategy": "zero3", "world": 2, "tp": 2}, "DeepSpeed"),
    ({"strategy": "fsdp", "world": 4, "tp": 2, "sp": 2}, "not combined"),
])
def test_splits_the_mesh_cannot_hold_are_refused(kwargs, message):
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.errors import ConfigError

    world = kwargs.pop("world")
    with pytest.raises(ConfigError, match=message):
        ParallelDims.for_strategy(kwargs.pop("strategy"), world, sharding="full", ranks_per_node=world, **kwargs)


def test_sizes_that_do_not_divide_the_model_are_refused():
    from types import SimpleNamespace

    from vlmctl.distributed.tensor_parallel import check_tensor_parallel
    from vlmctl.errors import ConfigError
    from vlmctl.families import get_family

    text = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, intermediate_size=64)
    check_tensor_parallel(2, text, get_family("llava"), vocab=512)
    with pytest.raises(ConfigError, match="4 does not divide the language model's 2 key/value heads"):
        check_tensor_parallel(4, text, get_family("llava"), vocab=512)
    with pytest.raises(ConfigError, match="vocabulary"):
        check_tensor_parallel(2, text, get_family("llava"), vocab=511)
    with pytest.raises(ConfigError, match="no tensor-parallel plan"):
        check_tensor_parallel(2, text, get_family("idefics3"), vocab=512)


def test_the_train_section_refuses_what_tensor_parallelism_does_not_train():
    from pydantic import ValidationError

    from vlmctl.config.train import TrainSection

    with pytest.raises(ValidationError, match="tensor_parallel"):
        TrainSection(tensor_parallel=2, sequence_parallel=2)
    from vlmctl.config.plan import DeviceFacts, build_plan, check_plan
    from vlmctl.errors import ConfigError

    zero3 = TrainSection(tensor_parallel=2, strategy="zero3")
    with pytest.raises(ConfigError, match="fsdp"):
        check_plan(build_plan(zero3, DeviceFacts.here(cuda=False)), zero3)
    with pytest.raises(ValidationError, match="LoRA"):
        TrainSection(tensor_parallel=2, lora={"r": 8})
    with pytest.raises(ValidationError, match="whole logits"):
        TrainSection(tensor_parallel=2, objective="dpo", packing=True)


# --------------------------------------------------------------------------------------------------- gradients


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny presets, shapes-VQA shards (every third sample text-only) and, per preset, the batches the ranks
    read (`rows-<preset>.pt`: two packed rows and one padded micro-batch, as the trainer's collators make them)."""
    import torch

    root = build_tiny_models(tmp_path_factory.mktemp("tp"), 12, presets=PRESETS)
    for preset in PRESETS:
        torch.save({"packed": packed_rows(root / preset, root / "data", 2), "padded": padded_batch(root / preset, root / "data")},
                   root / f"rows-{preset}.pt")
    return root


def _train_section(packing: bool, fp8: str = "off"):
    from vlmctl.config.train import TrainSection

    return TrainSection(stage="full", strategy="fsdp", precision="fp32", packing=packing, tokens_per_batch=4096,
                        micro_batch_size=2, attn_implementation="sdpa", tensor_parallel=2,
                        activation_checkpointing="off", liger="off", compile_vision="off", balance="off",
                        learning_rate=1e-3, warmup_ratio=0.0, fp8=fp8, fp8_layers="all")


def padded_batch(folder: Path, data: Path, n: int = 2):
    """`n` shard samples as one padded micro-batch (the collator `train.packing: false` uses)."""
    import torch

    from vlmctl.data.collate import Collator
    from vlmctl.data.loader import ShardDataset
    from vlmctl.models import load_model

    _, processor, family = load_model(folder, dtype=torch.float32)
    dataset = ShardDataset.from_dir(data / "prepared" / "train")
    return Collator(processor, family)([dataset[i] for i in range(n)])


def _init_rank(rank: int, world: int, port: int):
    """This process as rank `rank` of `world` gloo ranks (`distributed.env.init_distributed`): its `DistEnv`."""
    import torch

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from vlmctl.distributed.env import init_distributed

    return init_distributed()


def _engine(env, folder: Path, train, world: int):
    """The model of `folder` prepared and wrapped as `vlmctl train` does (`prepare_model`, `wrap_model`) under
    `train` (planned here) with TP=2 over `world` ranks: (engine, objective, dims)."""
    import torch

    from vlmctl.config.plan import DeviceFacts, build_plan
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.models import load_model
    from vlmctl.train.setup import RunContext, prepare_model
    from vlmctl.train.worker import build_objective, wrap_model

    plan = build_plan(train, DeviceFacts.here(world))
    train = plan.train_section(train)
    dims = ParallelDims.for_strategy("fsdp", world, sharding="full", tp=2)
    dims.build_mesh("cpu")
    ctx = RunContext(env=env, dims=dims, dtype=torch.float32, stored=torch.float32, plan=plan)
    model, _, family = load_model(folder, dtype=torch.float32)
    tm = prepare_model(model, family, train, env.device, plan=plan)
    return wrap_model(tm, train, ctx, total_steps=4), build_objective(tm, train, ctx), dims


def _grads_rank(rank: int, world: int, port: int, root: str, out: str, fp8: str = "off") -> None:
    """One of `world` ranks: per preset and batch kind, the loss and full gradients of its data-parallel group; with
    an `fp8` recipe the language model's linears in float8 (emulated off CUDA, every aligned layer), packed rows
    only."""
    import torch
    import torch.distributed as dist

    from vlmctl.train.loop import to_device

    env = _init_rank(rank, world, port)
    root = Path(root)
    results = {}
    kinds = ("packed", "padded") if world == 2 and fp8 == "off" else ("packed",)
    for preset in PRESETS:
        for kind in kinds:
            engine, objective, dims = _engine(env, root / preset, _train_section(kind == "packed", fp8), world)
            batches = torch.load(root / f"rows-{preset}.pt", weights_only=True)
            if kind == "packed":
                rows = batches["packed"][:dims.dp_size]
                labelled = sum(int((r["labels"][0, 1:] != -100).sum()) for r in rows)
                mine = rows[dims.dp_rank]
            else:
                mine = batches["padded"]
                labelled = int((mine["labels"][:, 1:] != -100).sum())
            loss = engine.forward(objective, to_device(mine, env.device)).loss
            engine.backward(loss, dims.grad_size / labelled)
            total = loss.detach().clone()
            dist.all_reduce(total, group=dims.dp_group)  # the tp ranks of a group hold the same (whole) loss
            grads = {name: p.grad.full_tensor().detach().clone() for name, p in engine.module.named_parameters()
                     if p.grad is not None}
            split = sorted(name for name, p in engine.module.named_parameters() if "tp" in (p.device_mesh.mesh_dim_names or ()))
            float8 = sorted(name for name, m in engine.module.named_modules() if type(m).__name__ == "Float8Linear")
            results[f"{preset}/{kind}"] = {"loss": float(total) / labelled, "grads": grads, "rows": dims.dp_size,
                                           "split": split, "float8": float8, "scales": weight_scales(engine.module)}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def _reference(folder: Path, batches: dict, kind: str, n_rows: int, fp8: str = "off"):
    """One process, TP=1: the mean loss over the labelled tokens of `batches` and its gradients; with an `fp8`
    recipe every aligned linear of the language model in emulated float8 (`distributed.float8.convert`)."""
    import torch

    from vlmctl.data.collate import model_inputs
    from vlmctl.distributed import float8
    from vlmctl.models import load_model
    from vlmctl.train.kernels import token_losses
    from vlmctl.train.objectives import token_loss_sum

    model, _, family = load_model(folder, dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    if fp8 != "off":
        float8.convert(model, family, fp8, emulate=True)
    if kind == "packed":
        rows = batches["packed"][:n_rows]
        labelled = sum(int((r["labels"][0, 1:] != -100).sum()) for r in rows)
        total = sum(token_losses(model, {k: v for k, v in r.items() if k not in ("seq_lens",) and not k.startswith("num_")})[0].sum()
                    for r in rows)
    else:
        batch = batches["padded"]
        labelled = int((batch["labels"][:, 1:] != -100).sum())
        total = token_loss_sum(model(**model_inputs(batch), use_cache=False).logits, batch["labels"])
    (total / labelled).backward()
    return float(total.detach()) / labelled, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# TP=2 alone; TP=2 x FSDP2 (2 data-parallel groups); float8 in both, rowwise (no float8 all-gather) on TP=2 alone
@pytest.mark.parametrize("world, fp8", [(2, "off"), (4, "off"), (2, "tensorwise"), (4, "tensorwise"), (2, "rowwise")])
def test_loss_and_every_gradient_match_one_process(built, tmp_path, world, fp8):
    """With a train.fp8 recipe the tp ranks scale their parts of each tensor over the whole tensor (tensorwise: the
    float8 all-gather under FSDP2), so the float8 values, loss and gradients are one float8 process's (TP=1, the same
    layers converted)."""
    import torch

    from vlmctl.distributed.env import free_port

    from test_sequence_parallel import _run_ranks

    out = tmp_path / "grads.pt"
    code = ("import sys; from test_tensor_parallel import _grads_rank; "
            "_grads_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])")
    _run_ranks(code, world, [world, free_port(), built, out, fp8])
    results = torch.load(out)
    assert len(results) == len(PRESETS) * (2 if world == 2 and fp8 == "off" else 1)
    for case, got in results.items():
        preset, kind = case.split("/")
        ref_loss, ref_grads = _reference(built / preset, torch.load(built / f"rows-{preset}.pt", weights_only=True), kind,
                                         got["rows"], fp8)
        # float8 converted the language model's linears, the tp plan split them, and each rank casts its part of a
        # weight with the whole weight's scale (the tp ranks' amax reduced) from the first step on
        assert bool(got["float8"]) == (fp8 != "off") and set(got["float8"]) <= {n.rsplit(".", 1)[0] for n in got["split"]}, case
        assert set(got["scales"]) == (set(got["float8"]) if fp8 == "tensorwise" else set()), case
        for name, (scale, whole) in got["scales"].items():
            torch.testing.assert_close(scale, whole, msg=f"{case}: scale of {name}")
        # the language model's layers, embedding and head are split over the tp ranks, the vision tower is not
        assert any("q_proj" in n for n in got["split"]) and any("embed_tokens" in n for n in got["split"]), case
        assert not any("vision" in n or "visual" in n for n in got["split"]), case
        # float8: a value on a rounding boundary can round the other way (below), which moved LLaVA's loss by 2.2e-5
        assert got["loss"] == pytest.approx(ref_loss, rel=1e-5 if fp8 == "off" else 1e-4), case
        assert set(ref_grads) <= set(got["grads"]), case
        for name, grad in ref_grads.items():
            if fp8 == "off":
                torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=f"{case}: gradient of {name}")
                continue
            # float8: the fp32 partial sums of the row-split matmuls, added in another order, can move a value that
            # lies on a float8 rounding boundary to the next float8 value (1/8 of it). That moved gradients behind it
            # by up to 2.1% of their norm (LLaVA's vision k_proj, 4 ranks), so the bound is 10%: a partial sum
            # lost or counted twice parts by 50% or more. The loss parted by 1.5-2.3e-4 where the first step's
            # weights were scaled per tp rank (build_engine without its first scale_hook call).
            error = float((got["grads"][name] - grad).norm())
            assert error <= 0.1 * float(grad.norm()) + 1e-6, f"{case}: gradient of {name} parts by {error:.3g}"


def _resume_rank(rank: int, world: int, port: int, root: str, out: str) -> None:
    """One of 2 ranks (TP=2): a float8 step saved, resumed with fp8 off, a bf16 step saved, resumed with float8 on;
    rank 0 writes the full weights at each hand-over, the resumed float8 weights' scales and the export."""
    import torch
    import torch.distributed as dist

    from vlmctl.distributed import float8
    from vlmctl.train.loop import to_device

    env = _init_rank(rank, world, port)
    root, out = Path(root), Path(out)
    preset = PRESETS[0]
    row = to_device(torch.load(root / f"rows-{preset}.pt", weights_only=True)["packed"][0], env.device)

    def full(engine):  # every parameter whole, in high precision (collective)
        return {n: float8.high_precision(p.full_tensor()).detach().clone() for n, p in engine.module.named_parameters()}

    def step(engine, objective, folder):
        engine.backward(engine.forward(objective, row).loss, 1.0)
        engine.step(skip=False)
        engine.save(folder, step=1)
        return full(engine)

    on, objective, _ = _engine(env, root / preset, _train_section(True, "tensorwise"), world)
    saved_on = step(on, objective, out / "on")
    off, objective, _ = _engine(env, root / preset, _train_section(True, "off"), world)
    off.load(out / "on")
    loaded_off = full(off)
    saved_off = step(off, objective, out / "off")
    again, _, _ = _engine(env, root / preset, _train_section(True, "tensorwise"), world)
    again.load(out / "off")
    result = {"saved_on": saved_on, "loaded_off": loaded_off, "saved_off": saved_off, "loaded_on": full(again),
              "scales": weight_scales(again.module), "float8": len(float8.float8_layers(again.module)),
              "export": again.gather(0)}
    if rank == 0:
        torch.save(result, out / "resume.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_float8_checkpoints_under_tensor_parallelism_resume_with_float8_on_or_off(built, tmp_path):
    """train.fp8 is a compute format under TP too: a TP=2 float8 run's checkpoint resumes with fp8 off to the same
    weights and back, the resumed float8 weights are all-gathered with their loaded weights' scales, and the export
    holds plain tensors equal to the trained weights."""
    import torch

    from vlmctl.distributed.env import free_port

    from test_sequence_parallel import _run_ranks

    code = ("import sys; from test_tensor_parallel import _resume_rank; "
            "_resume_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])")
    _run_ranks(code, 2, [2, free_port(), built, tmp_path])
    got = torch.load(tmp_path / "resume.pt")
    assert got["float8"] > 0 and set(got["scales"]) and len(got["scales"]) == got["float8"]
    for name, (scale, whole) in got["scales"].items():
        torch.testing.assert_close(scale, whole, msg=f"scale of {name}")
    for name, value in got["saved_on"].items():
        assert torch.equal(got["loaded_off"][name], value), name
        assert torch.equal(got["loaded_on"][name], got["saved_off"][name]), name
    assert any(not torch.equal(got["saved_off"][n], v) for n, v in got["saved_on"].items())  # the step without float8 moved them
    assert all(type(v) is torch.Tensor for v in got["export"].values())
    for name, value in got["saved_off"].items():
        assert torch.equal(got["export"][name], value), name


# --------------------------------------------------------------------------------------------- vlmctl train


def _launch(nproc: int, *overrides: str) -> tuple[str, ...]:
    return ("--launcher", "torchrun", "--nproc-per-node", str(nproc), f"train.nproc_per_node={nproc}", *overrides)


def _metrics(project: Path, name: str) -> list[dict]:
    import json

    return [json.loads(line) for line in (project / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def test_vlmctl_train_with_tensor_parallel_matches_one_process_and_resumes_across_sizes(tmp_path):
    """TP=2 on 2 ranks gives one process's losses and gradient norms; each run's checkpoint resumes under the other's
    tensor-parallel size (DCP re-splits the weights and AdamW's state) with the loss the other run had; the export is
    a plain transformers model."""
    import torch
    from transformers import AutoModelForImageTextToText

    from test_sequence_parallel import _project
    from train_runner import RunsAhead, run_train, start_train

    project = _project(tmp_path)
    config = project / "vlmctl.yaml"
    runs = RunsAhead({
        "tp": lambda: start_train(config, *_launch(2, "train.tensor_parallel=2", "train.run_name=tp")),
        "one": lambda: start_train(config, *_launch(1, "train.run_name=one")),
    }, timeout=TIMEOUT)
    try:
        runs.output("tp")
        runs.output("one")
    finally:
        runs.close()
    tp, one = _metrics(project, "tp"), _metrics(project, "one")
    assert [r["loss"] for r in tp] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["grad_norm"] for r in tp] == pytest.approx([r["grad_norm"] for r in one], rel=1e-4)
    for name, nproc, extra in (("tp", 1, ()), ("one", 2, ("train.tensor_parallel=2",))):
        checkpoint = project / "runs" / name / "checkpoints" / "checkpoint-1"
        run_train(config, *_launch(nproc, *extra, f"train.run_name={name}-resumed", f"train.resume={checkpoint}"),
                  timeout=TIMEOUT)
        resumed = _metrics(project, f"{name}-resumed")
        assert [r["step"] for r in resumed] == [2]
        assert resumed[0]["loss"] == pytest.approx(one[1]["loss"], rel=1e-5), name
    model = AutoModelForImageTextToText.from_pretrained(project / "runs" / "tp" / "final", dtype=torch.float32)
    ref = AutoModelForImageTextToText.from_pretrained(project / "runs" / "one" / "final", dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)
