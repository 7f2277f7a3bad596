"""What a built model means for training: which parts a stage trains and a per-GPU memory estimate.

Memory follows the mixed-precision Adam accounting of the ZeRO paper (Rajbhandari et al. 2020,
https://arxiv.org/abs/1910.02054, section 3.1): per trained parameter 2 bytes of bf16 weights + 2 bytes of bf16
gradients + 12 bytes of fp32 optimizer state (master weights, momentum, variance) = 16 bytes; per frozen parameter
2 bytes. DDP replicates everything, ZeRO-2 shards gradients and optimizer state, FSDP (FULL_SHARD) and ZeRO-3 shard
all of it across the GPUs. Activations are not included (they depend on batch tokens and checkpointing).
"""

from __future__ import annotations

from typing import Any

from vlmctl.families import PARTS

STAGE_TRAINS = {"align": ("projector",), "finetune": ("projector", "llm"), "full": ("vision", "projector", "llm")}
"""Parts each `train.stage` trains by default (LLaVA-1.5's two stages, plus full training); training itself reads
it through `trained_parts` (`vlmctl.train.setup.trainable_parts`)."""

BYTES_WEIGHT, BYTES_GRAD, BYTES_OPTIM = 2, 2, 12


def trained_parts(stage: str, freeze: list[str] | None = None) -> dict[str, bool]:
    """{part: trained?} for `stage`; `freeze` (train.freeze) overrides the stage's default when given."""
    if freeze is not None:
        return {p: p not in freeze for p in PARTS}
    return {p: p in STAGE_TRAINS[stage] for p in PARTS}


def memory_per_gpu(parameters: dict[str, int], trained: dict[str, bool], *, strategy: str, num_gpus: int) -> dict[str, int]:
    """Bytes per GPU for weights, gradients and optimizer state, and their total (see the module docstring)."""
    n = max(1, int(num_gpus))
    total = sum(parameters[p] for p in PARTS)
    trainable = sum(parameters[p] for p in PARTS if trained[p])
    weights = BYTES_WEIGHT * total
    grads = BYTES_GRAD * trainable
    optim = BYTES_OPTIM * trainable
    if strategy == "zero2":
        grads, optim = grads / n, optim / n
    elif strategy in ("fsdp", "zero3"):
        weights, grads, optim = weights / n, grads / n, optim / n
    out = {"weights": int(weights), "gradients": int(grads), "optimizer": int(optim)}
    out["total"] = sum(out.values())
    return out


def training_summary(info: dict[str, Any], *, stage: str, strategy: str, num_gpus: int, freeze: list[str] | None = None,
                     lora: bool = False) -> dict[str, Any]:
    """Summary of a build (`vlmctl_model.json` content) under the configured training settings.

    With `lora`, the language model's weights stay frozen and only adapters (not counted) are trained on it.
    """
    trained = trained_parts(stage, freeze)
    if lora:
        trained["llm"] = False
    params = info["parameters"]
    return {
        "family": info["family"],
        "parameters": params,
        "trained": trained,
        "lora_on_llm": lora,
        "trainable_parameters": sum(params[p] for p in PARTS if trained[p]),
        "visual_tokens_per_image": info.get("visual_tokens_per_image"),
        "image_size": info.get("image_size"),
        "stage": stage,
        "strategy": strategy,
        "num_gpus": num_gpus,
        "memory_per_gpu_bytes": memory_per_gpu(params, trained, strategy=strategy, num_gpus=num_gpus),
    }
