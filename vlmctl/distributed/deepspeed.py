"""DeepSpeed ZeRO-2/3: the config (the user's JSON with "auto" values filled, or one generated from the train
section) and the engine. DeepSpeed keeps its own data-parallel group over the world; the batch size it checks is
computed from the mesh's data-parallel size, which equals the world for zero2/zero3."""

from __future__ import annotations

import json
from pathlib import Path

from vlmctl.errors import ConfigError

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# deepspeed (an optional dependency) is imported only where used, so the rest works without it.


def _read_or_default(train, stage: int) -> dict:
    """The user's JSON (`train.deepspeed_config`), or the generated ZeRO section with "auto" values."""
    if train.deepspeed_config is not None:
        path = Path(train.deepspeed_config)
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"train.deepspeed_config {path} cannot be read: {exc}", hint="point it at a valid DeepSpeed JSON") from exc
    cfg = {"zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                 "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"},
           "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    if stage == 2:
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            cfg["zero_optimization"].pop(key)
    return cfg


def deepspeed_config(train, *, dp_size: int, dtype, hidden_size: int, stage: int) -> dict:
    """The DeepSpeed config for `train` on `dp_size` data-parallel ranks: "auto" values filled as transformers'
    `HfTrainerDeepSpeedConfig` fills them (batch sizes, clipping, bf16/fp16 from `dtype`, bucket sizes from the
    language model's `hidden_size`).

    Raises ConfigError for an unreadable JSON, a ZeRO stage that contradicts `train.strategy`, or an optimizer /
    scheduler section (those come from train.*).
    """
    import torch

    cfg = _read_or_default(train, stage)
    zero = cfg.setdefault("zero_optimization", {})
    if zero.get("stage", stage) != stage:
        raise ConfigError(f"train.deepspeed_config sets ZeRO stage {zero['stage']} but train.strategy is zero{stage}",
                          hint=f"set train.strategy=zero{zero['stage']} or change the JSON")
    zero["stage"] = stage
    values = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * dp_size,
        "gradient_clipping": train.max_grad_norm,
    }
    for key, value in values.items():
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value
    for key, on in (("bf16", dtype == torch.bfloat16), ("fp16", dtype == torch.float16)):
        if key in cfg and cfg[key].get("enabled", "auto") == "auto":
            cfg[key]["enabled"] = on
    zero_auto = {"reduce_bucket_size": hidden_size * hidden_size,
                 "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                 "stage3_param_persistence_threshold": 10 * hidden_size}
    for key, value in zero_auto.items():
        if zero.get(key) == "auto":
            zero[key] = value
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise ConfigError(f"train.deepspeed_config has an {section} section; the optimizer and LR schedule come from train.*",
                              hint=f"remove the {section} section from the DeepSpeed JSON (train.learning_rate, train.lr_scheduler set them)")
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 10**9)
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def deepspeed_engine(model, optimizer, scheduler, config: dict):
    """`deepspeed.initialize` with our AdamW and LR scheduler (DeepSpeed steps the scheduler at accumulation
    boundaries). Returns (engine, optimizer, scheduler) as DeepSpeed wrapped them."""
    import deepspeed

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine, optimizer, scheduler


def hidden_size(model) -> int:
    """The language model's hidden size (what the "auto" bucket sizes scale with); 1024 when the config has none."""
    cfg = getattr(model, "module", model).config
    text = getattr(cfg, "text_config", None) or cfg
    return int(getattr(text, "hidden_size", 1024))
