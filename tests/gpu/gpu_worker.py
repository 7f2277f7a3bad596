"""One rank of the GPU suite's training cases (`tests/gpu`): each case prepares and wraps a tiny model exactly as
`vlmctl train` does (`prepare_model`, `wrap_model`, `build_objective`: kernels, liger, compile, FSDP2 / DeepSpeed,
Ulysses), runs one forward + backward of its data-parallel rank's packed row (optionally an optimizer step), and
rank 0 saves, per case: the loss of the rows (summed over the ranks, divided by their labelled tokens), every
parameter's full gradient (fp32, CPU), what preparing decided (liger, attention, the decoder MLP's forward, the FSDP2
plan) and the peak GPU memory. The reference is the CPU path of the same rows (fp32, sdpa, no liger, no kernels),
computed by rank 0.

Run one process per GPU: `python -c "from gpu_worker import main; main()" RANK WORLD PORT MODEL DATA CASES OUT`
(CASES: a JSON file of {"name": {"train": {TrainSection overrides}, "step": bool, "probe": bool,
"ranks_per_node": int}}).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

from shapes_shards import packed_rows

ROW_TOKENS = 420  # a packed row of several samples (several images)

# the CPU path's settings: every case overrides what it tests
BASE = dict(stage="full", strategy="fsdp", precision="fp32", master_weights="fp32", packing=True,
            tokens_per_batch=ROW_TOKENS, attn_implementation="sdpa", sequence_parallel=1,
            activation_checkpointing="off", liger="off", compile="off", compile_vision="off", balance="off",
            learning_rate=1e-3, warmup_ratio=0.0, lr_scheduler="constant", weight_decay=0.0, max_grad_norm=0.0)


def labelled(batch) -> int:
    return int((batch["labels"][0, 1:] != -100).sum())


def reference(folder: Path, batches) -> dict[str, Any]:
    """The CPU path (fp32, sdpa, no liger): the mean loss over the labelled tokens of `batches` and its gradients."""
    import torch

    from vlmctl.models import load_model
    from vlmctl.train.objectives import loss_sum

    model, _, _ = load_model(folder, dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    model.train()
    total = sum(loss_sum(model, b) for b in batches)
    n = sum(labelled(b) for b in batches)
    (total / n).backward()
    return {"loss": float(total.detach()) / n, "grads": {k: p.grad.float().clone() for k, p in model.named_parameters() if p.grad is not None}}


def _full(t):
    from vlmctl.distributed.float8 import high_precision  # a float8 all-gather weight: the tensor it wraps

    return high_precision(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def _params(model, engine) -> dict[str, Any]:
    import torch

    if engine is not None:
        from deepspeed import zero

        named = list(engine.module.named_parameters())
        with zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().float().cpu().clone() for n, p in named}
    return {n: _full(p) for n, p in model.named_parameters() if isinstance(p, torch.Tensor)}


def _grads(model, engine) -> dict[str, Any]:
    if engine is not None:
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for n, p in engine.module.named_parameters():
            g = safe_get_full_grad(p)
            if g is not None:
                out[n] = g.detach().float().cpu().clone()
        return out
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _float8(model) -> dict[str, Any] | None:
    """What `train.fp8` converted (`distributed.float8`): recipe, float8 all-gather, layer count, whether they compute
    in float8, and for the float8 all-gather weights the largest relative error of their precomputed scales against
    the scale of their current weights (None before any was computed)."""
    import torch

    from vlmctl.distributed import float8

    state = float8.state_of(model)
    if state is None:
        return None
    errors = []
    for layer in float8.float8_layers(model):
        local = getattr(layer.weight, "_local_tensor", None)
        scale = getattr(local, "_precomputed_scale", None)
        if scale is not None:
            amax = _full(layer.weight).abs().max().double().clamp(min=1e-12)
            want = torch.finfo(torch.float8_e4m3fn).max / amax
            errors.append(float((scale.double().cpu() - want).abs() / want))
    return {"recipe": state.recipe, "all_gather": state.all_gather, "layers": len(state.layers),
            "computes": float8.computes_float8(model), "scale_error": max(errors) if errors else None}


def _expandable(device) -> bool | None:
    """Whether the CUDA allocator's segments are expandable (`distributed.env.configure_cuda_allocator`)."""
    import torch

    if device.type != "cuda":
        return None
    return any(seg.get("is_expandable") for seg in torch.cuda.memory_snapshot())


def _forward_name(module) -> str:
    f = module.__dict__.get("forward") or type(module).forward
    f = getattr(f, "__func__", f)
    return getattr(f, "__qualname__", type(f).__name__)


def run_case(name: str, spec: dict[str, Any], env, folder: Path, all_rows) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from vlmctl.config.train import TrainSection
    from vlmctl.distributed.fsdp import PLAN_ATTR
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.models import load_model
    from vlmctl.train import autotune
    from vlmctl.train.loop import to_device
    from vlmctl.config.plan import DeviceFacts, build_plan, check_plan
    from vlmctl.train.setup import RunContext, prepare_model, torch_dtype
    from vlmctl.train.worker import build_objective, wrap_model

    device = env.device
    train = TrainSection(**{**BASE, **spec.get("train", {})})
    plan = build_plan(train, DeviceFacts.here(env.world_size))
    check_plan(plan, train)
    train = plan.train_section(train)
    dims = ParallelDims.for_strategy(train.strategy, env.world_size, sharding=train.fsdp_sharding,
                                     sp=train.sequence_parallel, tp=train.tensor_parallel,
                                     ranks_per_node=spec.get("ranks_per_node"))
    dims.build_mesh(device.type)
    dtype = torch_dtype(plan.precision.value)
    ctx = RunContext(env=env, dims=dims, dtype=dtype, stored=torch_dtype(plan.stored.value), plan=plan)
    torch.manual_seed(0)
    model, _, family = load_model(folder, dtype=ctx.stored)
    tm = prepare_model(model, family, train, device, compute_dtype=dtype, plan=plan)
    mlp = tm.parts.decoder_layers[0].mlp
    engine, objective = wrap_model(tm, train, ctx, total_steps=2), build_objective(tm, train, ctx)
    raw = getattr(engine, "engine", None)  # DeepSpeed's own engine (its gathered parameters and gradients)
    batches = all_rows[:dims.dp_size]
    mine = to_device(batches[dims.dp_rank], device)
    n = sum(labelled(b) for b in batches)
    before = _params(engine.model, raw) if spec.get("step") else None
    cuda = device.type == "cuda"  # CPU: a smoke run of the harness itself (tests/gpu/run.sh --cpu-smoke)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    result: dict[str, Any] = {"expandable_segments": _expandable(device), "liger": tm.liger, "attn": tm.attn, "mlp_forward": _forward_name(mlp),
                              "vision_kernels": list(tm.vision_kernels), "dp_size": dims.dp_size, "rows": len(batches)}
    plan = getattr(engine.model, PLAN_ATTR, None)
    if plan is not None:
        result["reshard_after_forward"] = plan.reshard_after_forward
    if spec.get("probe"):  # the start-up probe's trials must give back what they take
        allocated = torch.cuda.memory_allocated(device)
        peak, seconds = autotune.measure_pass(engine, objective, batches[dims.dp_rank], device)
        result["probe"] = {"before": allocated, "after": torch.cuda.memory_allocated(device), "peak": peak,
                           "seconds": seconds}
    loss = engine.forward(objective, mine).loss
    engine.backward(loss, dims.grad_size / n)
    total = loss.detach().float().clone()
    # each rank holds its row's (or its slice's) part; the tp ranks of a group each hold the whole row's
    dist.all_reduce(total, group=dims.dp_group if dims.tp > 1 else None)
    result["loss"] = float(total) / n
    result["grads"] = _grads(engine.model, raw)
    if spec.get("step"):
        grads = result["grads"]
        engine.step(skip=False)
        result["before"], result["after"] = before, _params(engine.model, raw)
        result["step_grads"] = grads
    result["float8"] = _float8(tm.model)
    result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    if raw is not None:
        raw.destroy()
    del engine, raw, tm, model, mine, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _liger_order(item) -> int:
    train = item[1].get("train", {})
    if train.get("liger", "off") == "off":
        return 0
    return 1 if train.get("compile") == "on" else 2


def main(argv: list[str] | None = None) -> None:
    rank, world, port, folder, data, cases, out = (argv or sys.argv[1:])[:7]
    os.environ.update({"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    import torch
    import torch.distributed as dist

    from vlmctl.distributed.env import init_distributed

    env = init_distributed(deepspeed=True)
    specs = json.loads(Path(cases).read_text())
    all_rows = packed_rows(Path(folder), Path(data), int(world), per_row=5)
    results: dict[str, Any] = {}
    if int(rank) == 0:  # first: liger's patches replace the transformers module's classes for every later model
        results["reference"] = {str(k): reference(Path(folder), all_rows[:k]) for k in range(1, int(world) + 1)}
    # for the same reason: the cases without liger first, then those with its loss only (compiled layers), then the
    # rest (whose norm and SwiGLU classes would reach the compiled cases' vision blocks, which dynamo cannot trace)
    linear = torch.nn.functional.linear
    for name, spec in sorted(specs.items(), key=_liger_order):
        # ZeRO-3 replaces torch.nn.functional.linear for the rest of the process (DeepSpeed's memory-efficient
        # linear, "persists unless manually reset"): each case starts from torch's own, as a run of its own would
        torch.nn.functional.linear = linear
        try:
            results[name] = run_case(name, spec, env, Path(folder), all_rows)
        except Exception as exc:  # noqa: BLE001 - recorded per case, so one broken path does not hide the others
            import traceback

            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
            print(f"[rank {rank}] case {name} failed:\n{results[name]['traceback']}", file=sys.stderr, flush=True)
            dist.barrier()
    if int(rank) == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
