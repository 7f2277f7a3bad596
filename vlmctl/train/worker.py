"""The per-rank entry point: `python -m vlmctl.train.worker RUN_DIR` (what torchrun, accelerate and sbatch run).

Every rank reads `RUN_DIR/config.yaml`, then: process group -> model -> attention backend and liger kernels ->
stage/freeze -> LoRA -> activation checkpointing -> torch.compile of decoder layers -> data (packed or padded
micro-batches) -> wrapping (DDP / FSDP2 per layer then root / DeepSpeed) -> optimizer and schedule -> resume ->
`Trainer.train()` -> final export. The order of checkpointing, compile and FSDP is torchtitan's.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from vlmctl.errors import ConfigError, ModelError, VlmctlError

EXIT_STOPPED = 0  # a run stopped by SIGTERM/SIGINT after saving exits cleanly; the launcher reports it


def model_source(cfg) -> str:
    """The model to train: the folder `vlmctl model build` wrote (`model.output_dir`), else `model.base`."""
    folder = Path(cfg.model.output_dir)
    if (folder / "config.json").is_file() or (folder / "vlmctl_model.json").is_file():
        return str(folder)
    if cfg.model.base is not None:
        return str(cfg.model.base)
    raise ModelError(f"no built model in {folder}", hint="run `vlmctl model build` first, or set model.base")


def load_source(source: str, cfg, *, dtype):
    """(model, processor, Family) through the family table's loader, on CPU."""
    from vlmctl.models import load_model

    return load_model(source, dtype=dtype, device="cpu", family=cfg.model.family,
                      trust_remote_code=cfg.model.trust_remote_code)


def load_quantized(source: str, cfg, *, dtype):
    """QLoRA's frozen base: the language model in 4-bit NF4 (or 8-bit) through bitsandbytes, vision tower,
    projector and lm_head kept in `dtype`. The 4-bit storage dtype equals the compute dtype, so FSDP shards the
    packed weights like any other bf16 tensor (the QLoRA + FSDP recipe of the bitsandbytes docs)."""
    import transformers
    from peft import prepare_model_for_kbit_training
    from transformers import AutoConfig, BitsAndBytesConfig

    from vlmctl.models import detect_family, get_family, load_processor, read_build_info

    info = read_build_info(source) if Path(source).is_dir() else None
    ref = info["source"] if info and info.get("mode") == "base" and not (Path(source) / "config.json").is_file() else source
    family = get_family(cfg.model.family or detect_family(AutoConfig.from_pretrained(ref, trust_remote_code=cfg.model.trust_remote_code)))
    skip = [family.vision_tower, *family.projector, family.lm_head]
    if cfg.train.lora.quantize == "4bit":
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype, llm_int8_skip_modules=skip)
    else:
        bnb = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    cls = getattr(transformers, family.model_class)
    model = cls.from_pretrained(ref, quantization_config=bnb, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.train.gradient_checkpointing)
    return model, load_processor(source, trust_remote_code=cfg.model.trust_remote_code), family


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def param_groups(model, parts, train) -> list[dict[str, Any]]:
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


def build_optimizer(model, parts, train, device, world_size: int = 1):
    """AdamW over `param_groups`, or its per-parameter form stepped during backward (`train.optimizer_in_backward`).
    Raises ConfigError when nothing is trainable or the in-backward form cannot apply to these settings."""
    import torch

    groups = param_groups(model, parts, train)
    if not groups:
        raise ConfigError("nothing to train: every parameter is frozen", hint="check train.stage and train.freeze")
    if train.optimizer_in_backward:
        from vlmctl.train.optimizer import OptimizerInBackward

        check_optimizer_in_backward(train, world_size)
        return OptimizerInBackward(groups, betas=tuple(train.adam_betas), eps=1e-8, fused=device.type == "cuda")
    return torch.optim.AdamW(groups, lr=train.learning_rate, betas=tuple(train.adam_betas), eps=1e-8,
                             fused=device.type == "cuda")


def check_optimizer_in_backward(train, world_size: int) -> None:
    """Raise ConfigError for settings `train.optimizer_in_backward` cannot honour: it steps each parameter inside
    backward, so there is no global gradient to clip or accumulate, and DDP would average gradients only after the
    step (FSDP2 fires the hook after its reduce-scatter)."""
    hint = "set train.optimizer_in_backward=false"
    if train.max_grad_norm > 0:
        raise ConfigError(f"train.optimizer_in_backward cannot clip gradients (train.max_grad_norm={train.max_grad_norm})",
                          hint="set train.max_grad_norm=0, or " + hint)
    if train.gradient_accumulation_steps != 1:
        raise ConfigError(f"train.optimizer_in_backward steps after every backward; train.gradient_accumulation_steps="
                          f"{train.gradient_accumulation_steps} needs the gradients kept", hint="raise train.tokens_per_batch instead, or " + hint)
    if train.strategy in ("zero2", "zero3"):
        raise ConfigError(f"train.optimizer_in_backward is not available with DeepSpeed ({train.strategy})",
                          hint="use train.strategy=fsdp, or " + hint)
    if train.strategy == "ddp" and world_size > 1:
        raise ConfigError("train.optimizer_in_backward with ddp on several processes would step before gradients are averaged",
                          hint="use train.strategy=fsdp, or " + hint)


def build_scheduler(optimizer, train, total_steps: int):
    from transformers import get_scheduler

    warmup = math.ceil(train.warmup_ratio * total_steps)
    # transformers' "constant" ignores num_warmup_steps; warmup applies to every schedule here.
    name = "constant_with_warmup" if train.lr_scheduler == "constant" else train.lr_scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def resolve_attention(train, device) -> str:
    """The transformers attention implementation for `train.attn_implementation` on `device`.

    Packed rows: auto = PyTorch's varlen kernel on CUDA in bf16/fp16, sdpa on CPU or in fp32 (block-diagonal mask
    from the per-sample position ids). Padded batches: auto = flash_attention_2 when flash-attn is installed on CUDA, else sdpa; varlen
    needs packing. Raises ConfigError for a backend this device or batching cannot run.
    """
    import importlib.util

    import torch

    from vlmctl.train.kernels import resolve_attn_implementation
    from vlmctl.train.parallel import resolve_dtype

    requested = train.attn_implementation
    if device.type == "cuda" and resolve_dtype(train.precision, device) == torch.float32:
        if requested in ("varlen", "flash_attn"):
            raise ConfigError(f"train.attn_implementation={requested} computes in bf16/fp16, but train.precision resolves to fp32",
                              hint="set train.precision=bf16, or train.attn_implementation=sdpa")
        if requested == "auto":
            requested = "sdpa"  # the flash kernels compute in bf16/fp16 only
    if not train.packing:
        if requested == "varlen":
            raise ConfigError("train.attn_implementation=varlen attends within packed rows; it needs train.packing=true",
                              hint="set train.packing=true, or use sdpa / flash_attn with padded batches")
        if requested == "auto":
            cuda_flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
            requested = "flash_attn" if cuda_flash else "sdpa"
    try:
        return resolve_attn_implementation(requested, device.type)
    except ValueError as exc:
        raise ConfigError(str(exc), hint="set train.attn_implementation=auto (or sdpa)") from None


def resolve_liger(train, family, device) -> bool:
    """Whether liger-kernel's fused linear cross-entropy is used (`train.liger`: on, off, auto = when it can run).

    It needs CUDA, the package and a liger patch for the family, and the head's weight gathered during the root
    forward: ZeRO-3 partitions it outside the head's own forward, so zero3 uses the plain loss.
    Raises ConfigError for `on` where it cannot run.
    """
    from vlmctl.train.kernels import liger_available

    if train.liger == "off":
        return False
    why = None
    if not liger_available(device.type):
        why = "needs a CUDA GPU and the liger-kernel package (pip install 'vlmctl[gpu]')"
    elif family.liger_patch is None:
        why = f"has no patch for the {family.name} family"
    elif train.strategy == "zero3":
        why = "cannot read the head's weight while ZeRO-3 partitions it"
    if why is None:
        return True
    if train.liger == "on":
        raise ConfigError(f"train.liger=on, but liger-kernel {why}", hint="set train.liger=auto or off")
    return False


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def resolve_resume(run_dir: Path, resume: str | None) -> Path | None:
    """The checkpoint to resume from: None, the latest complete one (`auto`), or a given path."""
    from vlmctl.train.checkpoint import latest_checkpoint

    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise ConfigError(f"train.resume = {resume}: no complete checkpoint there (trainer_state.json is missing)",
                          hint="use train.resume=auto, or a checkpoints/checkpoint-<step> folder of a run")
    return path


def run(run_dir: Path) -> str:
    """Train per `run_dir/config.yaml` on this rank; returns "done" or "stopped" (after a signal)."""
    import torch.distributed as dist

    from vlmctl.config import load_config
    from vlmctl.train.parallel import init_distributed

    # DeepSpeed and FSDP call collectives torch marks as renamed; the warning repeats every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    run_dir = Path(run_dir).resolve()
    cfg = load_config(run_dir / "config.yaml")
    deepspeed = cfg.train.strategy in ("zero2", "zero3")
    env = init_distributed(deepspeed=deepspeed)
    try:
        outcome = _run(cfg, run_dir, env)
        dist.barrier()
        return outcome
    finally:
        # No barrier after a failure: the other ranks may be blocked in a collective; the launcher stops them.
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(cfg, run_dir: Path, env) -> str:
    import torch

    from vlmctl.data.collate import Collator, PackedCollator
    from vlmctl.data.loader import DistributedBatchSampler, PackedBatchSampler, ShardDataset, build_loader
    from vlmctl.train import checkpoint as ckpt
    from vlmctl.train import parallel
    from vlmctl.train.loop import Trainer, TrainState, prefetch
    from vlmctl.train.metrics import MetricsLogger, Progress, flops_per_token, human, peak_flops, plot_loss, startup_table

    train = cfg.train
    seed_everything(train.seed)
    dtype = parallel.resolve_dtype(train.precision, env.device)
    if dtype == torch.float16 and train.strategy in ("ddp", "fsdp"):
        raise ConfigError("train.precision=fp16 needs loss scaling, which only the DeepSpeed strategies provide here",
                          hint="use train.precision=bf16, or train.strategy=zero2/zero3")
    if train.lora is not None and train.lora.quantize != "none" and env.device.type != "cuda":
        raise ConfigError("train.lora.quantize (QLoRA) needs bitsandbytes on a CUDA GPU",
                          hint="set train.lora.quantize=none, or run on a GPU machine with bitsandbytes installed")

    # ---- model, stage, LoRA
    source = model_source(cfg)
    quantized = train.lora is not None and train.lora.quantize != "none"
    if quantized:
        model, processor, family = load_quantized(source, cfg, dtype=dtype)
    else:
        model, processor, family = load_source(source, cfg, dtype=master_dtype(train, dtype))
    attn, liger, vision_kernels = apply_kernels(model, family, train, env.device)
    prepare = family.position_hook(model, getattr(model.config, "image_token_id", None)) if train.packing else None
    model, parts, trainable = apply_training_setup(model, family, train)
    # Counted before wrapping: ZeRO-3 leaves empty placeholders where its partitioned parameters were.
    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    part_params = {part: _part_params(model, parts, part) for part in parallel.PARTS}

    # ---- data
    dataset = ShardDataset.from_dir(Path(cfg.data.prepared_dir) / "train")
    weights = {(s.name or Path(s.path).name): s.weight for s in cfg.data.sources}
    sample_weights = dataset.sample_weights(weights) if any(w != 1.0 for w in weights.values()) else None
    if train.packing:
        lengths = dataset.lengths
        if not dataset.exact_lengths:  # shards prepared before the model was built: count with its processor
            if env.is_main:
                print(f"counting the tokens of {len(dataset)} samples for packing (`vlmctl data prepare` after "
                      "`vlmctl model build` records them)", file=sys.stderr)
            lengths = dataset.count_tokens(processor, family.name)
        if cfg.data.max_length:
            lengths = lengths.clip(max=cfg.data.max_length)  # encode_sample truncates text beyond max_length
        sampler = PackedBatchSampler(lengths, tokens_per_batch=train.tokens_per_batch, world_size=env.world_size,
                                     rank=env.rank, seed=train.seed, weights=sample_weights)
        if sampler.too_long and env.is_main:
            print(f"warning: {sampler.too_long} samples are longer than train.tokens_per_batch={train.tokens_per_batch} "
                  "tokens and are left out (`vlmctl data prepare` drops them as too_long with data.max_length <= "
                  "train.tokens_per_batch)", file=sys.stderr)
    else:
        sampler = DistributedBatchSampler(dataset.lengths, micro_batch_size=train.micro_batch_size, world_size=env.world_size,
                                          rank=env.rank, seed=train.seed, group_by_length=train.group_by_length, weights=sample_weights)
    gas = train.gradient_accumulation_steps
    total_steps = train.max_steps or max(1, math.ceil(train.num_epochs * sampler.batches_per_epoch / gas))

    # ---- wrapping, optimizer, schedule
    model, optimizer, scheduler, engine, stepper = wrap_and_optimize(model, parts, train, env, dtype, total_steps, liger=liger)

    # ---- resume
    state = TrainState()
    resume_from = resolve_resume(run_dir, train.resume)
    if resume_from is not None:
        saved = ckpt.load(resume_from, rank=env.rank, model=None if engine else model, optimizer=optimizer,
                          scheduler=scheduler, engine=engine)
        if saved.get("world_size") != env.world_size:
            if engine is not None:
                raise ConfigError(f"{resume_from} was written by {saved.get('world_size')} ranks; DeepSpeed resumes with the same number",
                                  hint=f"launch with {saved.get('world_size')} processes in total")
            if env.is_main:  # DCP reshards weights and optimizer; the data position is per-rank micro-batches
                print(f"warning: {resume_from} was written by {saved.get('world_size')} ranks, resuming with {env.world_size}: "
                      "the data order after resume differs from the original run", file=sys.stderr)
        state = TrainState(step=saved["step"], consumed=saved["consumed_micro_batches"], bad_steps=saved.get("bad_steps", 0),
                           tokens=saved.get("tokens_seen", 0))
    sampler.set_position(state.consumed)
    if train.packing:
        collator = PackedCollator(processor, family, max_length=cfg.data.max_length, tokens_per_batch=train.tokens_per_batch)
    else:
        collator = Collator(processor, family, max_length=cfg.data.max_length)
    loader = build_loader(dataset, sampler, collator, num_workers=train.num_workers, seed=train.seed)

    # ---- what the user sees
    run_name = run_dir.name
    logger = None
    if env.is_main:
        logger = MetricsLogger(run_dir, list(train.report_to), run_name=run_name, project=cfg.project.name,
                               config=cfg.model_dump(mode="json"), resume_step=state.step)
        from rich.console import Console

        if train.packing:
            global_batch = (f"up to {train.tokens_per_batch * gas * env.world_size} tokens ({train.tokens_per_batch} x {gas} "
                            f"accumulation x {env.world_size} ranks)")
            batching = f"packed rows of up to {train.tokens_per_batch} tokens"
            per_epoch = f"{sampler.batches_per_epoch * env.world_size} packed micro-batches per epoch"
        else:
            global_batch = f"{train.micro_batch_size * gas * env.world_size} samples ({train.micro_batch_size} x {gas} accumulation x {env.world_size} ranks)"
            batching = "padded micro-batches" + (", length-grouped" if train.group_by_length else "")
            per_epoch = f"{sampler.batches_per_epoch * env.world_size * train.micro_batch_size} per epoch"
        Console(highlight=False).print(startup_table({
            "model": f"{source} ({family.name})",
            "parameters": f"{human(num_params)} (" + ", ".join(f"{k} {human(v)}" for k, v in part_params.items()) + ")",
            "trainable": f"{human(num_trainable)} ({', '.join(sorted(trainable))}{'; LoRA on the llm' if train.lora else ''})",
            "strategy": f"{train.strategy} ({str(dtype).removeprefix('torch.')}, {device_name(env.device)})",
            "kernels": f"attention {attn}, loss {'liger fused linear cross-entropy' if liger else 'labelled-token logits' if train.packing else 'full logits'}"
                       + (", activation checkpointing" if train.gradient_checkpointing else "") + (", compiled decoder layers" if train.compile else "")
                       + "".join(f", vision {k}" for k in vision_kernels),
            "world size": env.world_size,
            "global batch": global_batch,
            "batching": batching,
            "steps": f"{state.step} -> {total_steps}" if state.step else total_steps,
            "data": f"{len(dataset)} samples, {per_epoch}",
            "run": str(run_dir),
            **({"resumed from": str(resume_from)} if resume_from else {}),
        }))
    progress = Progress(total_steps, state.step, enabled=env.is_main)
    lm_cfg = getattr(getattr(_unwrap(model), "config", None), "text_config", None)
    fpt = None
    if lm_cfg is not None:
        fpt = lambda seq: flops_per_token(num_params, lm_cfg.num_hidden_layers, lm_cfg.hidden_size, seq)  # noqa: E731

    trainer_info = {
        "lora": parallel.lora_config_dict(_unwrap(model) if engine is None else engine.module),
        "model_source": source, "family": family.name, "world_size": env.world_size, "strategy": train.strategy,
        "stage": train.stage, "trainable_parts": sorted(trainable), "format": "deepspeed" if engine else "dcp",
        "micro_batch_size": train.micro_batch_size, "gradient_accumulation_steps": gas, "total_steps": total_steps,
        "batches_per_epoch": sampler.batches_per_epoch, "precision": str(dtype).removeprefix("torch."),
        "packing": train.packing, "tokens_per_batch": train.tokens_per_batch if train.packing else None,
        "attn_implementation": attn, "liger": liger, "device": device_name(env.device),
    }

    def save(step: int, st: TrainState, reason: str) -> None:
        info = {"step": step, "epoch": st.consumed / sampler.batches_per_epoch, "consumed_micro_batches": st.consumed,
                "bad_steps": st.bad_steps, "tokens_seen": st.tokens, "reason": reason, **trainer_info}
        path = ckpt.save(run_dir, step, info, rank=env.rank, model=None if engine else model, optimizer=optimizer,
                         scheduler=scheduler, engine=engine, total_limit=train.save_total_limit)
        progress.print(f"saved {path}")

    batches = prefetch(iter(loader), prepare)
    trainer = Trainer(
        stepper=stepper, batches=batches, env=env, state=state, total_steps=total_steps, grad_accum=gas,
        batches_per_epoch=sampler.batches_per_epoch, save_steps=train.save_steps, logging_steps=train.logging_steps,
        max_bad_steps=train.max_bad_steps, save=save, log=logger.log if logger else (lambda row: None),
        progress=progress, flops_per_token=fpt, peak_flops=peak_flops(env.device),
        device_name=device_name(env.device),
    )
    try:
        outcome = trainer.train()
    finally:
        batches.close()
        progress.close()
        if logger is not None:
            logger.close()
            plot_loss(run_dir)
    if outcome == "stopped":
        progress.print(f"[yellow]stopped by a signal at step {state.step}; checkpoint saved. "
                       f"Continue with `vlmctl train --resume`[/yellow]")
        return outcome
    export_final(run_dir, cfg, model=None if engine else model, engine=engine, source=source, dtype=dtype, rank=env.rank,
                 lora=train.lora, parts_trainable=trainable)
    progress.print(f"final model exported to {run_dir / 'final'}")
    return outcome


def master_dtype(train, dtype):
    """The dtype parameters are stored (and optimized) in: fp32 master weights, or `dtype` itself with
    `train.master_weights: bf16` (pure bf16). Raises ConfigError where pure bf16 cannot apply."""
    import torch

    if train.master_weights == "fp32":
        return torch.float32
    if dtype != torch.bfloat16:
        raise ConfigError(f"train.master_weights=bf16 needs bf16 compute, but train.precision resolves to {str(dtype).removeprefix('torch.')}",
                          hint="set train.precision=bf16 (on a GPU with bf16), or train.master_weights=fp32")
    if train.strategy in ("zero2", "zero3"):
        raise ConfigError("train.master_weights=bf16: DeepSpeed keeps its own fp32 master weights for zero2/zero3",
                          hint="use train.strategy=fsdp or ddp for pure bf16, or train.master_weights=fp32")
    return torch.bfloat16


def apply_kernels(model, family, train, device) -> tuple[str, bool, list[str]]:
    """Attention backend, liger-kernel patches and the vision tower's kernels (CUDA), applied to the HF model in
    place (before peft wraps it). Returns (attention implementation name, whether liger's fused loss is on, the
    vision kernels applied)."""
    from vlmctl.families import vision_layers
    from vlmctl.train import kernels

    attn = resolve_attention(train, device)
    kernels.set_attention(model, attn, vision_varlen=device.type == "cuda" and family.mrope)
    liger = resolve_liger(train, family, device)
    if liger:
        # liger's norm/SwiGLU/RoPE kernels are autograd functions torch.compile cannot trace: compile fuses those
        kernels.apply_liger(model, family, kernels=not train.compile)
    vision = []
    if device.type == "cuda":
        compile_vision = train.compile_vision == "on" or (train.compile_vision == "auto" and _has_triton())
        vision = kernels.apply_vision_kernels(model, vision_layers(model, family), compile=compile_vision)
    return attn, liger, vision


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def apply_training_setup(model, family, train):
    """Stage/freeze, LoRA, activation checkpointing and torch.compile, in torchtitan's order (checkpointing, then
    compile, then the FSDP wrapping of `wrap_and_optimize`). Returns (model, parts, trainable part names)."""
    from vlmctl.train import parallel

    parts = parallel.model_parts(model, family)
    trainable = parallel.trainable_parts(train.stage, train.freeze)
    parallel.apply_stage(model, parts, trainable)
    if train.lora is not None:
        model = parallel.apply_lora(model, train.lora, parts, trainable)
        parts = parallel.model_parts(model, family)
    if train.gradient_checkpointing:
        # transformers' per-layer checkpointing (each decoder layer and vision block), non-reentrant
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    if train.compile:
        for layer in parts.decoder_layers:
            layer.compile(dynamic=train.packing)  # packed rows change length every step
    return model, parts, trainable


def wrap_and_optimize(model, parts, train, env, dtype, total_steps: int, *, liger: bool):
    """Wrap for `train.strategy` (DDP / FSDP2 per layer then root / DeepSpeed engine), build AdamW and the LR
    schedule. Returns (model, optimizer, scheduler, engine or None, stepper)."""
    from vlmctl.train import parallel
    from vlmctl.train.loop import DeepSpeedStepper, TorchStepper

    engine = None
    if train.strategy in ("zero2", "zero3"):
        optimizer = build_optimizer(model, parts, train, env.device)
        scheduler = build_scheduler(optimizer, train, total_steps)
        ds_cfg = parallel.deepspeed_config(train, world_size=env.world_size, dtype=dtype, hidden_size=_hidden_size(model),
                                           stage=int(train.strategy[-1]))
        engine, optimizer, scheduler = parallel.deepspeed_engine(model, optimizer, scheduler, ds_cfg)
        stepper = DeepSpeedStepper(engine, liger=liger)
    else:
        if train.strategy == "fsdp":
            model = parallel.apply_fsdp(model, parts, env, param_dtype=dtype, reshard_after_forward=train.fsdp_reshard_after_forward)
        else:
            model = model.to(env.device)
            if train.strategy == "ddp" and (env.world_size > 1 or os.environ.get("LOCAL_WORLD_SIZE")):
                model = parallel.apply_ddp(model, env)
        optimizer = build_optimizer(model, parts, train, env.device, env.world_size)
        scheduler = build_scheduler(optimizer, train, total_steps)
        stepper = TorchStepper(model, optimizer, scheduler, max_grad_norm=train.max_grad_norm,
                               autocast_dtype=dtype if train.strategy != "fsdp" else None, device=env.device, liger=liger)
    stepper.model.train()
    return model, optimizer, scheduler, engine, stepper


def _unwrap(model):
    return getattr(model, "module", model)


def _hidden_size(model) -> int:
    cfg = _unwrap(model).config
    text = getattr(cfg, "text_config", None) or cfg
    return int(getattr(text, "hidden_size", 1024))


def _part_params(model, parts, part: str) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if parts.part_of(n) == part)


def export_final(run_dir: Path, cfg, *, model, engine, source: str, dtype, rank: int, lora, parts_trainable: set[str]) -> Path:
    """Write `run_dir/final/`: an HF folder loadable by AutoModelForImageTextToText + AutoProcessor (LoRA merged),
    or the peft adapter with `train.lora.keep_adapter`. Every rank calls this (gathering weights is collective).

    Saved in fp32 when training ran in fp32, else in bf16.
    """
    import torch
    import torch.distributed as dist

    if engine is not None:
        if engine.zero_optimization_stage() == 3:
            state = engine._zero3_consolidated_16bit_state_dict()
        else:
            state = engine.module.state_dict() if rank == 0 else None
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    final = Path(run_dir) / "final"
    if rank == 0:
        from vlmctl.train import parallel

        fresh, processor, family = load_source(source, cfg, dtype=torch.float32)
        if lora is not None:
            fresh = parallel.apply_lora(fresh, lora, parallel.model_parts(fresh, family), parts_trainable)
        quantized = lora is not None and lora.quantize != "none"
        if quantized:  # the trained tensors are the adapters (and fully trained parts); the base is re-read in full
            state = {k: v for k, v in state.items() if "lora_" in k or "modules_to_save" in k}
        missing, unexpected = fresh.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        if unexpected or (not quantized and [k for k in missing if "lm_head" not in k]):
            raise VlmctlError(f"the trained weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}",
                              hint="report this with the model family and strategy")
        out_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        tmp = Path(run_dir) / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        if lora is not None and not lora.keep_adapter:
            fresh = fresh.merge_and_unload()
        fresh.to(out_dtype).save_pretrained(tmp)
        processor.save_pretrained(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()
    return final


def main(argv: list[str] | None = None) -> None:
    """Console entry of a rank: `python -m vlmctl.train.worker RUN_DIR`."""
    from vlmctl.cli._common import render_error

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m vlmctl.train.worker RUN_DIR", file=sys.stderr)
        sys.exit(2)
    try:
        outcome = run(Path(args[0]))
    except VlmctlError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            render_error(exc.title, exc.message, exc.hint)
        sys.exit(exc.exit_code)
    sys.exit(EXIT_STOPPED if outcome == "stopped" else 0)


if __name__ == "__main__":
    main()
