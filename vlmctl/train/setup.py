"""What a rank sets up before it trains, apart from the parallel steps (`distributed.parallelize`: sequence split,
activation checkpointing, compile, wrapping): the model source, dtype and master weights, the model parts,
stage/freeze, LoRA, kernels (attention backend, liger, vision tower), the AdamW parameter groups, the optimizer and
the LR schedule.

The worker and `vlmctl bench` run the same steps (`train.worker.wrap_model`)::

    ctx = setup_run(train, plan)                      # process group, mesh, seed, the run plan's dtypes
    tm = prepare_model(model, family, train, device)  # apply_kernels, cost model, apply_training_setup (stage, LoRA)
    model = parallelize(tm.model, ...)                # distributed.parallelize: split, checkpointing, compile, wrap
    engine = build_engine(model, ...)                 # distributed.engine: build_optimizer, build_scheduler (+ DeepSpeed)
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmctl.config.plan import quantized
from vlmctl.distributed.engine import is_ddp, is_deepspeed, is_fsdp, is_torch
from vlmctl.distributed.weights import DeferredWeights
from vlmctl.errors import ConfigError, ModelError
from vlmctl.families import PARTS

# numpy, peft, torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's
# start-up) must not pay for them.
# So are the vlmctl modules that load numpy and torch when imported.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

LORA_AUTO_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BUILT_MODEL_FILES = ("config.json", "vlmctl_model.json")  # what `vlmctl model build` leaves in model.output_dir


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------ the model


def model_source(cfg) -> str:
    """The model to train: the folder `vlmctl model build` wrote (`model.output_dir`), else `model.base`.
    Raises ModelError when there is neither."""
    folder = Path(cfg.model.output_dir)
    if any((folder / name).is_file() for name in BUILT_MODEL_FILES):
        return str(folder)
    if cfg.model.base is not None:
        return str(cfg.model.base)
    raise ModelError(f"no built model in {folder}", hint="run `vlmctl model build` first, or set model.base")


def planned_family(cfg):
    """The `FamilySpec` of the model a run trains, without loading its weights, for the run plan (packing, liger):
    `model.family` when set, else the family the model folder records (`inference.load.folder_family`), else that of
    `model.base`'s config (transformers' `AutoConfig`: a Hub id's config.json, from the cache when offline). None
    where none of them says (no built model yet, a config of no registered family): loading it tells what is wrong."""
    from vlmctl.errors import VlmctlError
    from vlmctl.families import detect_family, get_family
    from vlmctl.inference.load import folder_family

    model = getattr(cfg, "model", None)
    if model is None:
        return None
    try:
        if model.family is not None:
            return get_family(model.family)
        source = model_source(cfg)
        if Path(source).is_dir():
            return folder_family(Path(source))
        from transformers import AutoConfig  # a Hub id: its config only

        return get_family(detect_family(AutoConfig.from_pretrained(source, trust_remote_code=model.trust_remote_code)))
    except (VlmctlError, OSError, ValueError):  # no built model yet, no such config: preflight says so where it matters
        return None


def load_source(source: str, cfg, *, dtype):
    """(model, processor, family spec) through the family table's loader, on CPU."""
    from vlmctl.models import load_model

    return load_model(source, dtype=dtype, device="cpu", family=cfg.model.family,
                      trust_remote_code=cfg.model.trust_remote_code)


def load_empty(source: str, cfg, *, dtype):
    """(model, processor, family spec) as `load_source` returns them, without the weights: parameters on the meta
    device, buffers computed on CPU (`vlmctl.models.load.build_empty_model`). No weight file is read."""
    from vlmctl.models.load import build_empty_model

    return build_empty_model(source, dtype=dtype, family=cfg.model.family, trust_remote_code=cfg.model.trust_remote_code)


def load_quantized(source: str, cfg, *, dtype):
    """QLoRA's frozen base: the language model in 4-bit NF4 (or 8-bit) through bitsandbytes, vision tower,
    projector and lm_head kept in `dtype`. The 4-bit storage dtype equals the compute dtype, so FSDP shards the
    packed weights like any other bf16 tensor (the QLoRA + FSDP recipe of the bitsandbytes docs).
    Returns (model, processor, family spec)."""
    import transformers
    from peft import prepare_model_for_kbit_training
    from transformers import AutoConfig, BitsAndBytesConfig

    from vlmctl.families import detect_family, get_family
    from vlmctl.models import load_processor, read_build_info
    from vlmctl.models.load import quiet_transformers

    info = read_build_info(source) if Path(source).is_dir() else None
    ref = info["source"] if info and info.get("mode") == "base" and not (Path(source) / "config.json").is_file() else source
    family = get_family(cfg.model.family or detect_family(AutoConfig.from_pretrained(ref, trust_remote_code=cfg.model.trust_remote_code)))
    skip = [*(enc.path for enc in family.encoders.values()), *family.projector, family.lm_head]
    if cfg.train.lora.quantize == "4bit":
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype, llm_int8_skip_modules=skip)
    else:
        bnb = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    cls = getattr(transformers, family.model_class)
    with quiet_transformers():  # no third-party progress bar or load report
        model = cls.from_pretrained(ref, quantization_config=bnb, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
    # activation checkpointing is set per layer by `distributed.parallelize` (train.activation_checkpointing)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model, load_processor(source, trust_remote_code=cfg.model.trust_remote_code), family


# ---------------------------------------------------------------------------- the weights read once per run


def rank0_loads(train, world_size: int) -> bool:
    """Whether the ranks share one read of the model's weights (what accelerate calls
    `fsdp_cpu_ram_efficient_loading`): the torch strategies (fsdp, ddp) on more than one rank. Rank 0 reads them
    and the other ranks build the model on the meta device (`load_empty`) and receive their parameters after
    wrapping (`place_weights`), so host memory holds one full copy of the weights per run instead of one per rank;
    a resumed run reads no source weights at all (every rank builds empty, and the checkpoint's resume reads each
    rank's own shards).

    DeepSpeed (zero2, zero3) and QLoRA keep every rank loading the full model on CPU: DeepSpeed's engine takes a
    model that holds its weights and partitions them itself, and bitsandbytes quantizes the weights while
    transformers reads them, which a model built empty cannot go through.
    """
    return world_size > 1 and is_torch(train.strategy) and not quantized(train)


def load_for_rank(source: str, cfg, ctx, *, resuming: bool = False) -> tuple[Any, Any, Any]:
    """This rank's model before `prepare_model`, in `ctx.stored`: QLoRA's quantized base (`load_quantized`); the
    full model on CPU (`load_source`) where every rank loads; else (`rank0_loads`) the full model on rank 0 and
    the model built empty (`load_empty`) on the others, checked against rank 0's (`match_rank0`, collective), or
    built empty on every rank when `resuming` (the checkpoint holds every weight). Returns (model, processor,
    family spec)."""
    if quantized(cfg.train):
        return load_quantized(source, cfg, dtype=ctx.stored)
    if not rank0_loads(cfg.train, ctx.env.world_size):
        return load_source(source, cfg, dtype=ctx.stored)
    if resuming:
        return load_empty(source, cfg, dtype=ctx.stored)
    model, processor, family = (load_source if ctx.env.is_main else load_empty)(source, cfg, dtype=ctx.stored)
    match_rank0(model, ctx.env.rank)
    return model, processor, family


def match_rank0(model, rank: int) -> int:
    """Check that this rank's model has rank 0's parameters and buffers (names and shapes, tied weights counted
    once) and give its empty parameters and its buffers rank 0's dtypes (transformers keeps some modules in fp32
    while loading them: a model's `_keep_in_fp32_modules`). Collective; returns the number of tensors cast. Raises
    ModelError on every rank, naming the first difference, when a rank's model differs."""
    import torch.distributed as dist

    mine = [(name, tuple(t.shape), t.dtype) for name, t in _tensors(model)]
    box = [mine if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    error, cast = None, 0
    if len(box[0]) != len(mine) or any(a[:2] != b[:2] for a, b in zip(box[0], mine)):
        first = next(((a, b) for a, b in zip(box[0], mine) if a[:2] != b[:2]), (len(box[0]), len(mine)))
        error = f"rank {rank} built a model that differs from rank 0's loaded one: {first[0]} vs {first[1]}"
    else:
        cast = _cast_like(model, [d for _, _, d in box[0]])
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        raise ModelError(next(e for e in errors if e), hint="report this with the model family; "
                         "the model must be built the same way on every rank")
    return cast


def _tensors(model) -> list[tuple[str, Any]]:
    """(name, tensor) of the parameters (tied ones once) and the buffers of `model`, in module order."""
    return [*model.named_parameters(), *model.named_buffers()]


def _cast_like(model, dtypes: list) -> int:
    """Cast the meta parameters and the buffers of `model` (`_tensors` order) to `dtypes`; returns how many
    changed. A parameter that holds its weights keeps them as they are."""
    from torch import nn

    cast = 0
    for (_, tensor), dtype in zip(_tensors(model), dtypes):
        if tensor.dtype != dtype and (tensor.is_meta or not isinstance(tensor, nn.Parameter)):
            tensor.data = tensor.data.to(dtype)
            cast += 1
    return cast


def defer_weights(model, train, env, *, resuming: bool = False) -> DeferredWeights | None:
    """After `prepare_model`: what `place_weights` needs once the model is wrapped, or None where every rank
    loaded its weights. Unless `resuming`, every rank also takes rank 0's torch RNG state (collective): loading
    draws random numbers where building empty does not (LoRA's adapter initialization), and every rank drew the
    same before."""
    import torch
    import torch.distributed as dist

    if not rank0_loads(train, env.world_size):
        return None
    if resuming:
        return DeferredWeights("checkpoint")
    box = [torch.get_rng_state() if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    torch.set_rng_state(box[0])
    if not is_fsdp(train.strategy):
        return DeferredWeights("ddp")
    return DeferredWeights("rank0", state=model.state_dict() if env.is_main else None)


# ------------------------------------------------------------------------------------------------ dtypes


def torch_dtype(name: str) -> Any:
    """The `torch.dtype` of a resolved precision name (bf16, fp16, fp32: `RunPlan.precision`, `RunPlan.stored`)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# ----------------------------------------------------------------------------------------------- model parts


@dataclass
class ModelParts:
    """Module paths of the vision tower, projector and language model (from the family spec), and the repeated
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
    """The parts of a VLM per the family spec, and its decoder / vision-encoder layer modules."""
    from vlmctl.families import decoder_layers, vision_layers

    paths: dict[str, list[str]] = {p: [] for p in PARTS}
    for encoder in family.encoders.values():
        paths.setdefault(encoder.part, []).append(encoder.path)
    paths["projector"], paths["llm"] = list(family.projector), [family.language_model, family.lm_head]
    return ModelParts(family=family, paths=paths, decoder_layers=list(decoder_layers(model, family)),
                      vision_layers=list(vision_layers(model, family)))


def part_parameters(model, parts: ModelParts) -> dict[str, int]:
    """Parameters (count) per part, in `PARTS` order."""
    counts = {p: 0 for p in PARTS}
    for name, param in model.named_parameters():
        counts[parts.part_of(name)] += param.numel()
    return counts


# ----------------------------------------------------------------------------------------- stages, freezing


def trainable_parts(stage: str, freeze: list[str] | None) -> set[str]:
    """Parts trained by a stage (align: projector; finetune: projector + llm; full: all); `freeze` overrides.
    The table is `vlmctl.models.summary.STAGE_TRAINS`."""
    from vlmctl.models.summary import trained_parts

    return {part for part, trained in trained_parts(stage, freeze).items() if trained}


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
    their stage trains them, are trained in full and saved with the adapter (`modules_to_save`). Raises
    ConfigError when `lora.target_modules` matches no layer.
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
        out["target_modules"] = sorted(names) if names else [target]
    return json.loads(json.dumps(out, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))


def store_frozen(model, dtype) -> int:
    """Cast the frozen floating-point parameters to the compute `dtype` (they never change, so they need no fp32
    master copy: a frozen vision tower, LoRA's base weights). Returns the number of parameters cast."""
    count = 0
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            count += param.numel()
    return count


def apply_training_setup(model, family, train, compute_dtype=None):
    """Stage/freeze, LoRA and frozen weights in `compute_dtype` (when given): what is trained. Activation
    checkpointing, compile and the wrapping come after, in `distributed.parallelize.parallelize`.
    Returns (model, parts, trainable part names)."""
    parts = model_parts(model, family)
    trainable = trainable_parts(train.stage, train.freeze)
    apply_stage(model, parts, trainable)
    if train.lora is not None:
        model = apply_lora(model, train.lora, parts, trainable)
        parts = model_parts(model, family)
    if compute_dtype is not None:
        store_frozen(model, compute_dtype)
    return model, parts, trainable


# ---------------------------------------------------------------------------------------------------- kernels


def apply_kernels(model, family, train, device, plan) -> tuple[str, bool, list[str]]:
    """Attention backend, liger-kernel patches and each encoder's kernels (CUDA) that `plan` (a RunPlan) decided,
    applied to the HF model in place (before peft wraps it). `train`: the resolved train section. Returns (attention
    implementation name, whether liger's fused loss is on, the encoder kernels applied)."""
    from vlmctl.train import kernels

    attn = kernels.resolve_attn_implementation(plan.attention.value, device.type)
    kernels.set_attention(model, attn, vision_varlen=device.type == "cuda", encoders=family.encoders.values())
    # False where the family has no liger patch (a plan made before the family was known)
    liger = plan.liger.value and kernels.apply_liger(model, family, kernels=plan.liger_kernels.value)
    vision = []
    if device.type == "cuda":
        vision = kernels.apply_encoder_kernels(model, family, compile=train.compile_vision == "kernels")
    if train.compile_vision == "blocks":
        vision.append("compiled blocks")
    return attn, liger, vision


# ------------------------------------------------------------------------------------------ optimizer, schedule


def param_groups(model, parts: ModelParts, train) -> list[dict[str, Any]]:
    """AdamW groups: per-part learning rates (vision_lr, projector_lr) and no weight decay on biases and norms."""
    groups: dict[tuple[float, float], list] = {}
    lrs = {"vision": train.vision_lr or train.learning_rate, "projector": train.projector_lr or train.learning_rate,
           "llm": train.learning_rate}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lr = lrs[parts.part_of(name)]
        wd = train.weight_decay if p.ndim >= 2 else 0.0
        groups.setdefault((lr, wd), []).append(p)
    return [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]


def build_optimizer(model, parts: ModelParts, train, device, dp_size: int = 1):
    """AdamW over `param_groups`, or its per-parameter form stepped during backward (`train.optimizer_in_backward`).
    Raises ConfigError when nothing is trainable or the in-backward form cannot apply to these settings."""
    groups = param_groups(model, parts, train)
    if not groups:
        raise ConfigError("nothing to train: every parameter is frozen", hint="check train.stage and train.freeze")
    make = adamw_factory(train, device)
    if train.optimizer_in_backward:
        from vlmctl.train.optimizer import OptimizerInBackward

        check_optimizer_in_backward(train, dp_size)
        return OptimizerInBackward(groups, make=make)
    return make(groups)


def adamw_factory(train, device):
    """`make(groups)` -> the run's AdamW over parameter groups: AdamW with stochastic rounding of the bf16 weight
    update (`train.stochastic_rounding: on` with bf16 master weights, `optimizer.stochastic_adamw`; its learning
    rates are tensors), else torch's AdamW (fused on CUDA)."""
    import torch

    betas = tuple(train.adam_betas)
    if train.master_weights == "bf16" and train.stochastic_rounding == "on":
        from vlmctl.train.optimizer import stochastic_adamw

        return lambda groups: stochastic_adamw(groups, lr=train.learning_rate, betas=betas, eps=1e-8)
    return lambda groups: torch.optim.AdamW(groups, lr=train.learning_rate, betas=betas, eps=1e-8,
                                            fused=device.type == "cuda")


def check_optimizer_in_backward(train, dp_size: int) -> None:
    """Raise ConfigError for settings `train.optimizer_in_backward` cannot honour: it steps each parameter inside
    backward, so there is no global gradient to clip or accumulate, and DDP over `dp_size` > 1 ranks would average
    gradients only after the step (FSDP2 fires the hook after its reduce-scatter)."""
    hint = "set train.optimizer_in_backward=false"
    if train.max_grad_norm > 0:
        raise ConfigError(f"train.optimizer_in_backward cannot clip gradients (train.max_grad_norm={train.max_grad_norm})",
                          hint="set train.max_grad_norm=0, or " + hint)
    if train.gradient_accumulation_steps != 1:
        raise ConfigError(f"train.optimizer_in_backward steps after every backward; train.gradient_accumulation_steps="
                          f"{train.gradient_accumulation_steps} needs the gradients kept", hint="raise train.tokens_per_batch instead, or " + hint)
    if is_deepspeed(train.strategy):
        raise ConfigError(f"train.optimizer_in_backward is not available with DeepSpeed ({train.strategy})",
                          hint="use train.strategy=fsdp, or " + hint)
    if is_ddp(train.strategy) and dp_size > 1:
        raise ConfigError("train.optimizer_in_backward with ddp on several processes would step before gradients are averaged",
                          hint="use train.strategy=fsdp, or " + hint)


def build_scheduler(optimizer, train, total_steps: int):
    """The LR schedule of `train.lr_scheduler` with `train.warmup_ratio` of `total_steps` as linear warm-up."""
    from transformers import get_scheduler

    warmup = math.ceil(train.warmup_ratio * total_steps)
    # transformers' "constant" ignores num_warmup_steps; warmup applies to every schedule here.
    name = "constant_with_warmup" if train.lr_scheduler == "constant" else train.lr_scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


# ------------------------------------------------------------------------------------- the run and its model


@dataclass
class RunContext:
    """What `setup_run` decided for this rank: its place (`env`: DistEnv), the parallel dimensions with the run's
    mesh built (`dims`: ParallelDims), the compute dtype and the dtype the parameters are stored in."""

    env: Any
    dims: Any
    dtype: Any
    stored: Any
    plan: Any = None  # config.plan.RunPlan: every decision of the run, with this rank's probe once settled


@dataclass
class TrainingModel:
    """A model ready to wrap and what preparing it decided (kernels, trainable parts, batch hook, cost model)."""

    model: Any
    family: Any
    parts: ModelParts
    trainable: set[str]
    attn: str
    liger: bool
    vision_kernels: list[str]
    prepare: Any  # batch hook run ahead of the step (Qwen's mRoPE positions), or None
    parameters: dict[str, int]  # per part, counted before wrapping (ZeRO-3 leaves empty placeholders)
    num_trainable: int
    cost_model: Any  # flops.CostModel of the unwrapped model: training FLOPs per collated batch
    processor: Any = None
    source: str | None = None
    deferred: DeferredWeights | None = None  # weights placed after wrapping (`defer_weights`), where rank 0 alone read them


def setup_run(train, plan=None, family=None) -> RunContext:
    """Process group and the run's one device mesh (`vlmctl.distributed`), seeds, compute and stored dtypes, from the
    run's plan: `plan` (the launcher's RunPlan, from plan.json) where it was built for this device and `family` (the
    model's, `planned_family`), else one built here (`config.plan.plan_for_rank`). `train` is not changed;
    `ctx.plan.train_section(train)` is the resolved copy the run reads. Raises ConfigError for a precision or master-weights setting this strategy and device cannot
    train with (`config.plan.check_plan`)."""
    from vlmctl.config.plan import DeviceFacts, check_plan, plan_for_rank
    from vlmctl.distributed.env import init_distributed
    from vlmctl.distributed.mesh import ParallelDims

    env = init_distributed(deepspeed=is_deepspeed(train.strategy))  # the plan never picks DeepSpeed for auto
    plan = plan_for_rank(plan, train, DeviceFacts.here(env.world_size), family)
    check_plan(plan, train)
    dims = ParallelDims.for_strategy(plan.strategy.value, env.world_size, sharding=train.fsdp_sharding,
                                     sp=train.sequence_parallel, tp=train.tensor_parallel)
    dims.build_mesh(env.device.type)
    seed_everything(train.seed)
    return RunContext(env=env, dims=dims, dtype=torch_dtype(plan.precision.value), stored=torch_dtype(plan.stored.value),
                      plan=plan)


def prepare_model(model, family, train, device, compute_dtype=None, plan=None, fused_loss: bool = True) -> TrainingModel:
    """Kernels, the batch hook, the cost model, stage/freeze, LoRA and frozen weights in `compute_dtype` (when
    given): what `vlmctl train` and `vlmctl bench` do to a loaded model before `distributed.parallelize.parallelize`
    (sequence split, activation checkpointing, compile, wrapping). The kernels come first because they patch the
    bare HF model (liger's forwards, the vision tower's modules) before peft wraps it. `plan`: the run's RunPlan
    (its kernels and packing, decided with the family); without one, planned here for this device. Raises
    ConfigError where `train` packs rows for a family that cannot take them (a plan made without the family).
    `fused_loss`: the run's objective takes its loss from the model's forward given labels (`ObjectiveSpec.fused_loss`),
    so where liger patched that forward on CUDA its loss kernel is compiled here, before any step."""
    from vlmctl.train.flops import CostModel

    if train.packing and not family.supports_packing:  # the plan decides packing with the family; `train` is its copy
        raise ConfigError(f"train.packing: {family.name} models cannot take packed rows, and the run plan was made "
                          "without knowing the model's family", hint="set train.packing: false (or model.family)")
    # counted on the model as built: before the vision kernels pad or reshape its layers, peft wraps it
    # (modules_to_save copies would count twice) and ZeRO-3 / FSDP2 shard it
    cost_model = CostModel.from_model(model, family, trainable_parts(train.stage, train.freeze), lora=train.lora is not None)
    if plan is None:
        from vlmctl.config.plan import DeviceFacts, build_plan

        plan = build_plan(train, DeviceFacts.here(cuda=device.type == "cuda"), family)
    attn, liger, vision_kernels = apply_kernels(model, family, train, device, plan)
    head = model.get_output_embeddings() if liger and fused_loss and device.type == "cuda" else None
    if head is not None:  # liger's loss compiled for every label count now, not inside some training step
        from vlmctl.train.kernels import warm_fused_loss

        warm_fused_loss(head.weight.shape[0], compute_dtype or head.weight.dtype, device)
    prepare = family.position_hook(model, getattr(model.config, "image_token_id", None)) if plan.packing.value else None
    if train.sequence_parallel == 1:  # the towers' grid-derived inputs computed ahead of the step, on the host
        from vlmctl.train.tower_inputs import chain, install_tower_inputs

        prepare = chain(prepare, *(t.prepare for t in install_tower_inputs(model, family)))
    model, parts, trainable = apply_training_setup(model, family, train, compute_dtype)
    return TrainingModel(model=model, family=family, parts=parts, trainable=trainable, attn=attn, liger=liger,
                         vision_kernels=vision_kernels, prepare=prepare, parameters=part_parameters(model, parts),
                         num_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                         cost_model=cost_model)
