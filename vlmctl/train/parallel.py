"""Process groups, model parts, stages/freezing, LoRA, and the data-parallel wrappers (DDP, FSDP2, DeepSpeed).

Applied in a fixed order by the worker (torchtitan's `parallelize_*` order)::

    dist = init_distributed()                         # NCCL on GPU, gloo on CPU
    parts = model_parts(model, family)                # vision tower / projector / language model
    apply_stage(model, parts, stage="finetune", freeze=None)
    model = apply_lora(model, lora, parts, trainable)   # when train.lora is set
    model = apply_fsdp(model, parts, mesh, param_dtype=torch.bfloat16)   # or apply_ddp / deepspeed_engine
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmctl.errors import ConfigError

PARTS = ("vision", "projector", "llm")

LORA_AUTO_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(deepspeed: bool = False) -> DistEnv:
    """Initialize the default process group from torchrun's environment (or a 1-process group without it).

    NCCL when CUDA is available, gloo otherwise. DeepSpeed runs use `deepspeed.init_distributed`, which needs
    `DS_ACCELERATOR=cpu` set before deepspeed is imported on machines without GPUs.
    """
    import torch
    import torch.distributed as dist

    # fewer out-of-memory errors from fragmentation: packed rows change shape every step (torchtitan sets it too)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        if deepspeed:
            import deepspeed as ds

            ds.init_distributed(dist_backend=backend)
        else:
            dist.init_process_group(backend=backend, device_id=device if cuda else None)
    return DistEnv(rank=rank, world_size=world, local_rank=local, device=device)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_dtype(precision: str, device) -> Any:
    """Compute dtype: auto = bf16 on GPUs that support it, fp32 on CPU."""
    import torch

    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


# ----------------------------------------------------------------------------------------------- model parts


@dataclass
class ModelParts:
    """Module paths of the vision tower, projector and language model (from the family table), and the repeated
    layers used as FSDP2 units."""

    family: Any
    paths: dict[str, list[str]]
    decoder_layers: list[Any] = field(default_factory=list)  # nn.Module instances
    vision_layers: list[Any] = field(default_factory=list)

    def part_of(self, name: str) -> str:
        """"vision", "projector" or "llm" for a parameter or module name (wrapper prefixes are ignored)."""
        from vlmctl.families import part_of_parameter

        return part_of_parameter(name, self.family)


def model_parts(model, family: Any) -> ModelParts:
    """The parts of a VLM per the family table, and its decoder / vision-encoder layer modules."""
    from vlmctl.families import decoder_layers, vision_layers

    paths = {"vision": [family.vision_tower], "projector": list(family.projector),
             "llm": [family.language_model, family.lm_head]}
    return ModelParts(family=family, paths=paths, decoder_layers=list(decoder_layers(model, family)),
                      vision_layers=list(vision_layers(model, family)))


# ----------------------------------------------------------------------------------------- stages, freezing


def trainable_parts(stage: str, freeze: list[str] | None) -> set[str]:
    """Parts trained by a stage (align: projector; finetune: projector + llm; full: all); `freeze` overrides."""
    if freeze is not None:
        return set(PARTS) - set(freeze)
    return {"align": {"projector"}, "finetune": {"projector", "llm"}, "full": set(PARTS)}[stage]


def apply_stage(model, parts: ModelParts, trainable: set[str]) -> dict[str, int]:
    """Set requires_grad per part; returns the number of trainable parameters per part."""
    counts = {p: 0 for p in PARTS}
    for name, param in model.named_parameters():
        part = parts.part_of(name)
        param.requires_grad_(part in trainable)
        if part in trainable:
            counts[part] += param.numel()
    return counts


def apply_lora(model, lora, parts: ModelParts, trainable: set[str]):
    """Wrap the model with peft LoRA adapters on the language model's linear layers.

    The language model's own weights are frozen (only the adapters train); the projector and vision tower, when
    their stage trains them, are trained in full and saved with the adapter (`modules_to_save`).
    """
    from peft import LoraConfig, get_peft_model

    llm_paths = [re.escape(p) for p in parts.paths["llm"] if p != "lm_head"]
    if lora.target_modules == "auto":
        target: Any = rf"^({'|'.join(llm_paths)})\..*\.({'|'.join(LORA_AUTO_TARGETS)})$"
    else:
        target = list(lora.target_modules)
    full = [p for part in ("projector", "vision") if part in trainable for p in parts.paths[part]]
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target,
                        modules_to_save=full or None, bias="none")
    for param in model.parameters():
        param.requires_grad_(False)
    try:
        model = get_peft_model(model, config)
    except ValueError as exc:
        raise ConfigError(f"train.lora.target_modules matched no layer: {exc}",
                          hint="use target_modules: auto, or module names such as [q_proj, v_proj]") from exc
    return model


def lora_config_dict(model) -> dict | None:
    """The peft adapter config as plain JSON (for trainer_state.json), or None without LoRA.

    `target_modules` is always a JSON list: the configured names, or for `target_modules: auto` (a regex over the
    language model) the full names of the adapted modules, which peft matches exactly. The dict stays valid
    `peft.LoraConfig` keyword arguments.
    """
    cfg = getattr(model, "peft_config", None)
    if not cfg:
        return None
    out = cfg["default"].to_dict()
    target = out.get("target_modules")
    if isinstance(target, str):
        names = getattr(getattr(model, "base_model", None), "targeted_module_names", None)
        if names:
            out["target_modules"] = sorted(names)
        else:
            out["target_modules"] = [target]
    return json.loads(json.dumps(out, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))


# ------------------------------------------------------------------------------------------------ wrappers


def apply_ddp(model, env: DistEnv):
    """DistributedDataParallel over the trainable parameters.

    `find_unused_parameters=True`: VLMs carry parameters no loss reaches (a vision pooling head, layers after the
    selected feature layer), which DDP's reducer would otherwise wait for forever.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None, find_unused_parameters=True)


def apply_fsdp(model, parts: ModelParts, env: DistEnv, param_dtype=None, reshard_after_forward: bool = True):
    """FSDP2: `fully_shard` each vision-encoder layer and decoder layer, then the root (torchtitan's order: call it
    after activation checkpointing and torch.compile have been applied to the layers).

    With `param_dtype` (bf16 on GPU) parameters are gathered in that dtype for compute while gradients are
    reduced in fp32 (`MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`). `reshard_after_forward`
    (`train.fsdp_reshard_after_forward`) frees each layer's gathered weights after its forward (gathered again
    for backward); false trades memory for one all-gather less per layer and step.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype not in (None, torch.float32) else MixedPrecisionPolicy()
    for layer in [*parts.vision_layers, *parts.decoder_layers]:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def deepspeed_config(train, *, world_size: int, dtype, hidden_size: int, stage: int) -> dict:
    """The DeepSpeed config: the user's JSON (`train.deepspeed_config`) with "auto" values filled as
    transformers' `HfTrainerDeepSpeedConfig` fills them, or one generated from the train section.

    Raises ConfigError for an unreadable JSON or a ZeRO stage that contradicts `train.strategy`.
    """
    import torch

    if train.deepspeed_config is not None:
        path = Path(train.deepspeed_config)
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"train.deepspeed_config {path} cannot be read: {exc}", hint="point it at a valid DeepSpeed JSON") from exc
    else:
        cfg = {"zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                     "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                     "stage3_param_persistence_threshold": "auto"},
               "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
        if stage == 2:
            for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
                cfg["zero_optimization"].pop(key)
    zero = cfg.setdefault("zero_optimization", {})
    if zero.get("stage", stage) != stage:
        raise ConfigError(f"train.deepspeed_config sets ZeRO stage {zero['stage']} but train.strategy is zero{stage}",
                          hint=f"set train.strategy=zero{zero['stage']} or change the JSON")
    zero["stage"] = stage
    values = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * world_size,
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
    """`deepspeed.initialize` with our AdamW and LR scheduler (DeepSpeed steps the scheduler at accumulation boundaries)."""
    import deepspeed

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine, optimizer, scheduler
