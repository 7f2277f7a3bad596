"""What a run tells about itself: the start-up table rank 0 prints, and the run description every checkpoint's
trainer_state.json carries (readers such as `vlmctl convert` use `model_source`, `family`, `lora`, `format`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmctl.config.plan import pending, row_tokens
from vlmctl.distributed import float8

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# rich is imported inside the functions that print: using vlmctl as a library does not load it.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.


def device_name(device) -> str:
    """The GPU's name (`torch.cuda.get_device_name`), or the device type ("cpu")."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _batching(train, sampler, dp_size: int, sp: int = 1) -> dict[str, str]:
    """The global batch, batching and per-epoch rows of the start-up table (`sp`: sequence-parallel ranks per row)."""
    gas = train.gradient_accumulation_steps
    if train.packing:
        row = row_tokens(train)  # sp: train.sequence_parallel, the ranks that split the row
        split = f" ({train.tokens_per_batch} per GPU x {sp} sequence-parallel ranks)" if sp > 1 else ""
        return {"global batch": (f"up to {row * gas * dp_size} tokens ({row} x {gas} "
                                 f"accumulation x {dp_size} data-parallel ranks)"),
                "batching": f"packed rows of up to {row} tokens{split}",
                "per epoch": f"{sampler.batches_per_epoch * dp_size} packed micro-batches per epoch"}
    return {"global batch": f"{train.micro_batch_size * gas * dp_size} samples ({train.micro_batch_size} x {gas} accumulation x {dp_size} ranks)",
            "batching": "padded micro-batches" + (", length-grouped" if train.group_by_length else ""),
            "per epoch": f"{sampler.batches_per_epoch * dp_size * train.micro_batch_size} per epoch"}


def _kernels(train, tm) -> str:
    from vlmctl.distributed.checkpointing import describe, describe_memory_helpers

    loss = "liger fused linear cross-entropy" if tm.liger else "labelled-token logits" if train.packing else "full logits"
    checkpointing = train.activation_checkpointing
    return (f"attention {tm.attn}, loss {loss}"
            + (f", activation checkpointing {describe(checkpointing)}" if not pending(checkpointing) and checkpointing != "off" else "")
            + describe_memory_helpers(train)
            + (", compiled decoder layers" if train.compile == "on" else "") + float8.describe(tm.model)
            + "".join(f", vision {k}" for k in tm.vision_kernels))


def startup_rows(train, *, run_dir: Path, ctx, tm, dataset, sampler, start_step: int, total_steps: int,
                 resume_from: Path | None) -> dict[str, Any]:
    """The rows of the start-up table: model and its parts, trainable parameters, strategy, kernels, world size,
    global batch, batching, steps, data, run folder. `ctx` is the worker's RunContext, `tm` its TrainingModel."""
    from vlmctl.train.metrics import human

    batching = _batching(train, sampler, ctx.dims.dp_size, ctx.dims.sp)
    params, adapters = built_parameters(tm.model, tm.parts, tm.parameters)
    lora = f"; LoRA adapters {human(adapters)} on the llm" if train.lora else ""
    return {
        "model": f"{tm.source} ({tm.family.name})",
        "parameters": f"{human(sum(params.values()))} (" + ", ".join(f"{k} {human(v)}" for k, v in params.items()) + ")",
        "trainable": f"{human(tm.num_trainable)} ({', '.join(sorted(tm.trainable))}{lora})",
        "strategy": f"{train.strategy} ({_dtype_name(ctx.dtype)}, {device_name(ctx.env.device)})",
        "kernels": _kernels(train, tm),
        "world size": (f"{ctx.env.world_size} ({ctx.dims.dp_size} data-parallel x {ctx.dims.tp} tensor-parallel)"
                       if ctx.dims.tp > 1 else ctx.env.world_size if ctx.dims.sp == 1 else
                       f"{ctx.env.world_size} ({ctx.dims.dp_size} data-parallel x {ctx.dims.sp} sequence-parallel, Ulysses)"),
        "global batch": batching["global batch"],
        "batching": batching["batching"],
        "steps": f"{start_step} -> {total_steps}" if start_step else total_steps,
        "data": f"{len(dataset)} samples, {batching['per epoch']}",
        "run": str(run_dir),
        **({"resumed from": str(resume_from)} if resume_from else {}),
    }


def built_parameters(model, parts, parameters: dict[str, int]) -> tuple[dict[str, int], int]:
    """(`parameters` per part without what LoRA added: its adapters and peft's trainable copies of fully trained
    parts (`modules_to_save`), the LoRA adapters' count): the counts `vlmctl model build` reports for the same model.
    `parameters` were counted before wrapping (`TrainingModel.parameters`); sizes are read as DeepSpeed's ZeRO-3
    records them (`ds_numel`) where it emptied a parameter."""
    added = dict.fromkeys(parameters, 0)
    adapters = 0
    for name, param in model.named_parameters():
        if "lora_" in name or ".modules_to_save." in name:
            n = int(getattr(param, "ds_numel", param.numel()))
            added[parts.part_of(name)] += n
            adapters += n if "lora_" in name else 0
    return {part: n - added[part] for part, n in parameters.items()}, adapters


KNOWN_BENIGN_WARNINGS = (
    # DeepSpeed and FSDP call collectives torch marks as renamed; the warning repeats every step
    {"category": FutureWarning, "module": "torch.distributed"},
    # FSDP2 on the root module's output: the loop computes the loss out of place, so no pre-backward hook is lost
    {"category": UserWarning, "message": r"FSDP2-wrapped module .* returned a view tensor"},
)
"""Warnings a training rank would print without cause (once per rank and run, alarming on every run)."""


def filter_known_warnings() -> None:
    """Silence `KNOWN_BENIGN_WARNINGS` in this process (every rank of `vlmctl train` and `vlmctl bench`)."""
    import warnings

    for rule in KNOWN_BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", **rule)


def print_startup(rows: dict[str, Any]) -> None:
    """Print the start-up table (rank 0)."""
    from rich.console import Console

    from vlmctl.train.metrics import startup_table

    Console(highlight=False).print(startup_table(rows))


def checkpoint_info(train, *, ctx, tm, lora: dict | None, engine, total_steps: int, batches_per_epoch: int) -> dict[str, Any]:
    """The run's description saved in every checkpoint's trainer_state.json (with the loop's position)."""
    return {
        "lora": lora, "model_source": tm.source, "family": tm.family.name, "world_size": ctx.env.world_size, "dp_size": ctx.dims.dp_size,
        "strategy": train.strategy, "stage": train.stage, "trainable_parts": sorted(tm.trainable),
        "format": engine.checkpoint_format, "micro_batch_size": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps, "total_steps": total_steps,
        "batches_per_epoch": batches_per_epoch, "precision": _dtype_name(ctx.dtype), "packing": train.packing,
        "tokens_per_batch": train.tokens_per_batch if train.packing else None,
        "sequence_parallel": train.sequence_parallel, "tensor_parallel": train.tensor_parallel, "attn_implementation": tm.attn,
        "liger": tm.liger, "device": device_name(ctx.env.device),
    }
