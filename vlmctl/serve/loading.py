"""Loading a model folder for serving: the dtype and attention backend of training's run plan on this machine
(`serving_plan`), the model and processor (`load_for_serving`), and what /health reports of them (`model_choice`).
Used by `serve.server` (the engine in a thread) and by the engine process (`serve.engine_process`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmctl.errors import UsageError

# torch, transformers and the run plan are imported inside the functions that use them: importing vlmctl (the CLI's
# start-up) must not pay for them.


def serving_plan(device: str, dtype: str = "auto", train: Any = None) -> tuple[str, str]:
    """(compute dtype, attention backend) to serve with on `device` (a resolved torch device name): the decisions of
    training's run plan (`vlmctl.config.plan.build_plan`) for `train` (a TrainSection; None: the defaults) on this
    machine, for padded batches, since the engine left-pads its rows. `dtype` other than `auto` is kept. The
    attention backend is one of the plan's (flash_attn, sdpa, flex, eager); a run trained with the packed-row
    kernel (varlen) is served with sdpa, as its GRPO rollouts are generated (`train.kernels.padded_attention`).
    On CPU: (fp32, sdpa); on a GPU with bf16: bf16, and flash_attn where flash-attn is installed, else sdpa."""
    from vlmctl.config.plan import DeviceFacts, build_plan
    from vlmctl.config.train import TrainSection

    train = train if train is not None else TrainSection()
    if dtype != "auto":
        train = train.model_copy(update={"precision": dtype})
    plan = build_plan(train.model_copy(update={"packing": False}), DeviceFacts.here(cuda=device.startswith("cuda")))
    attention = plan.attention.value
    return plan.precision.value, "sdpa" if attention == "varlen" else attention


def load_for_serving(model_dir: Path, *, device: str = "auto", dtype: str = "auto", train: Any = None) -> tuple[Any, Any, dict]:
    """(model, processor, choice) for serving `model_dir`: loaded by `load_for_generation` on `device` in the dtype
    of `serving_plan`, its attention set to the plan's backend (`train.kernels`, as training sets it). `choice`:
    {"dtype", "attn_implementation"} as the model holds them (what /health reports). Raises UsageError for an
    unknown device or dtype, or a backend this machine cannot run (flash_attn without flash-attn), ModelError as
    `load_for_generation`."""
    from vlmctl.inference import load_for_generation, resolve_device
    from vlmctl.train import kernels

    device = resolve_device(device)
    precision, attention = serving_plan(device, dtype, train)
    try:
        implementation = kernels.resolve_attn_implementation(attention, device.split(":")[0])
    except ValueError as exc:
        raise UsageError(str(exc).replace("train.attn_implementation", "the attention backend"),
                         hint="set train.attn_implementation=sdpa (or auto) in the project") from None
    model, processor = load_for_generation(Path(model_dir), device=device, dtype=precision)
    if model.config._attn_implementation != implementation:
        kernels.set_attention(model, implementation)
    return model, processor, model_choice(model)


def model_choice(model) -> dict:
    """{"dtype", "attn_implementation"} of a loaded model: its parameters' dtype name (bf16, fp16, fp32) and the
    attention implementation of its language model."""
    import torch

    dtype = next(model.parameters()).dtype
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {"dtype": names.get(dtype, str(dtype)), "attn_implementation": text._attn_implementation}


__all__ = ["load_for_serving", "model_choice", "serving_plan"]
