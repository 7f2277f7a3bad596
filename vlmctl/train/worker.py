"""The per-rank entry point: `python -m vlmctl.train.worker RUN_DIR` (what torchrun, accelerate and sbatch run).

Every rank reads `RUN_DIR/config.yaml` and runs these steps (the order of checkpointing, compile and FSDP is
torchtitan's)::

    ctx = setup_run(cfg.train, plan)                  # the run plan (plan.json), process group, mesh, seed, dtypes
    tm = load_model_for_training(cfg, ctx)            # model (fsdp/ddp: rank 0 reads the weights), kernels, cost model,
                                                      # stage/freeze, LoRA
    dataset, lengths = load_data(cfg, ctx, tm)        # the training shards and their token counts (train/data.py)
    engine = wrap_model(tm, cfg.train, ctx, steps)    # parallelize(): sequence split, checkpointing, compile, DDP /
                                                      # FSDP2 (rank 0's weights placed) / DeepSpeed; AdamW; schedule
    objective = build_objective(tm, cfg.train, ctx, cfg, run_dir)   # the objective's spec builds it (train/registry.py)
    autotune.tune(...)                                # auto batch size and activation checkpointing, probed on a GPU
    sampler = build_sampler(cfg, ctx, dataset, lengths)   # this data-parallel rank's packed or padded micro-batches
    trainer = build_trainer(...)                      # loader, metrics, checkpoints, validation -> loop.Trainer
    trainer.train(); export_final(...)                # run_dir/final

`setup_run` and `prepare_model` live in `train/setup.py`, `parallelize` and `build_engine` in `distributed/`;
`vlmctl bench` runs them through `wrap_model` on its synthetic model and data.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from vlmctl.distributed import deepspeed as ds
from vlmctl.config.plan import settle_reshard, write_plan
from vlmctl.distributed.engine import Engine, build_engine, strategy_of
from vlmctl.distributed.fsdp import fsdp_plan_of
from vlmctl.distributed.parallelize import parallelize
from vlmctl.distributed.process import LAUNCHER_ENV
from vlmctl.errors import VlmctlError
from vlmctl.train import autotune
from vlmctl.train.data import build_collator, build_sampler, load_data
from vlmctl.train.kernels import sequence_core_attention
from vlmctl.train.objectives import Objective, has_hook
from vlmctl.train.setup import (RunContext, TrainingModel, build_optimizer, build_scheduler, defer_weights, load_for_rank,
                                model_parts, model_source, planned_family, prepare_model, setup_run)
from vlmctl.train.validation import build_validator, name_best

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy and torch when imported; light vlmctl modules sit next to their use too.

EXIT_STOPPED = 0  # a run stopped by SIGTERM/SIGINT after saving exits cleanly; the launcher reports it


def load_model_for_training(cfg, ctx: RunContext, resuming: bool = False) -> TrainingModel:
    """Load the model to train (`setup.model_source`) in the stored dtype and `prepare_model` it (frozen weights
    cast to the compute dtype). Under fsdp and ddp on several ranks only rank 0 reads the weights (none when
    `resuming`); the others build it on the meta device and get theirs in `wrap_model` (`setup.rank0_loads`)."""
    source = model_source(cfg)
    model, processor, family = load_for_rank(source, cfg, ctx, resuming=resuming)
    from vlmctl.train.registry import get_objective

    tm = prepare_model(model, family, cfg.train, ctx.env.device, compute_dtype=ctx.dtype, plan=ctx.plan,
                       fused_loss=get_objective(cfg.train.objective).fused_loss)
    tm.deferred = defer_weights(tm.model, cfg.train, ctx.env, resuming=resuming)
    tm.processor, tm.source = processor, source
    return tm


def wrap_model(tm: TrainingModel, train, ctx: RunContext, total_steps: int) -> Engine:
    """The trained model's one `parallelize` (sequence split, checkpointing, compile, DDP / FSDP2 / DeepSpeed
    hand-off over the run's mesh) and its engine: AdamW, the LR schedule of `total_steps` (and DeepSpeed's engine
    with its config), in train mode."""
    env, dims, strategy = ctx.env, ctx.dims, strategy_of(train.strategy)
    model = parallelize(tm.model, family=tm.family, parts=tm.parts, train=train, dims=dims, device=env.device,
                        dtype=ctx.dtype, core_attention=sequence_core_attention(tm.attn), deferred=tm.deferred)
    tm.deferred = None
    if (fsdp := fsdp_plan_of(model)) is not None:  # a reshard rule the plan left to this rank, recorded in the plan
        ctx.plan = settle_reshard(ctx.plan, fsdp.reshard_after_forward, fsdp.reason)
    return build_engine(
        model, strategy, max_grad_norm=train.max_grad_norm, device=env.device, dtype=ctx.dtype,
        make_optimizer=lambda m: build_optimizer(m, tm.parts, train, env.device, dims.dp_size),
        make_scheduler=lambda optimizer: build_scheduler(optimizer, train, total_steps),
        deepspeed_config=lambda m: ds.deepspeed_config(train, dp_size=dims.grad_size, dtype=ctx.dtype,
                                                       hidden_size=ds.hidden_size(m), stage=strategy.zero_stage))


def build_objective(tm: TrainingModel, train, ctx: RunContext, cfg=None, run_dir: Path | None = None,
                    reference_model=None) -> Objective:
    """The run's objective (`train.objective` of the resolved `train` section), built by its spec
    (`registry.get_objective(...).build`: `cfg`, the project config, for a frozen model to load; `run_dir` for its
    reports; `reference_model` a frozen model to use instead), its frozen models parallelized for forward only."""
    from vlmctl.train.registry import get_objective

    objective = get_objective(train.objective).build(tm, train, ctx, cfg, run_dir, reference_model)
    for name, frozen in objective.models.items():  # forward only: a reference model of a preference objective
        objective.models[name] = parallelize(frozen, family=tm.family, parts=model_parts(frozen, tm.family), train=train,
                                             dims=ctx.dims, device=ctx.env.device, dtype=ctx.dtype,
                                             core_attention=sequence_core_attention(tm.attn), trainable=False,
                                             deferred=getattr(frozen, "_vlmctl_deferred", None))
    return objective


def reschedule(engine: Engine, train, total_steps: int) -> Engine:
    """A new LR schedule of `total_steps` on a torch engine's optimizer (built before the probe knew the step
    count; LambdaLR keeps each group's `initial_lr`)."""
    engine.reschedule(build_scheduler(engine.optimizer, train, total_steps))
    return engine


def resume_state(resume_from: Path | None, ctx: RunContext, engine: Engine, train, objective=None):
    """The loop's starting TrainState (and `objective`'s state): fresh, or from `resume_from` if `train` batches as its run did."""
    from vlmctl.train import checkpoint as ckpt
    from vlmctl.train.loop import TrainState

    if resume_from is None:
        return TrainState()
    ckpt.check_batching(resume_from, train)
    saved = ckpt.resume(resume_from, rank=ctx.env.rank, world_size=ctx.env.world_size, engine=engine, objective=objective)
    return TrainState.from_checkpoint(saved, dp_size=ctx.dims.dp_size)


def build_trainer(cfg, run_dir: Path, ctx: RunContext, tm: TrainingModel, engine: Engine, objective: Objective, *,
                  loader, sampler, state, total_steps: int, logger):
    """The step loop over `loader` (prefetched, with the model's batch hook), with rank 0's progress and metrics
    and a checkpoint callback (`checkpoint.Saver`)."""
    from vlmctl.train import report
    from vlmctl.train.checkpoint import Saver
    from vlmctl.train.loop import Trainer, prefetch
    from vlmctl.train.metrics import Progress, peak_flops
    from vlmctl.train.setup import lora_config_dict

    train, env = cfg.train, ctx.env
    progress = Progress(total_steps, state.step, enabled=env.is_main, fields=objective.spec.step_line)
    info = report.checkpoint_info(train, ctx=ctx, tm=tm, lora=lora_config_dict(engine.module), engine=engine,
                                  total_steps=total_steps, batches_per_epoch=sampler.batches_per_epoch)
    save = Saver(run_dir, rank=env.rank, engine=engine, total_limit=train.save_total_limit,
                 batches_per_epoch=sampler.batches_per_epoch, info=info, notify=progress.print, objective=objective)
    return Trainer(
        engine=engine, objective=objective, batches=prefetch(iter(loader), tm.prepare, device=env.device), env=env, state=state,
        total_steps=total_steps, grad_accum=train.gradient_accumulation_steps, batches_per_epoch=sampler.batches_per_epoch,
        save_steps=train.save_steps, logging_steps=train.logging_steps, max_bad_steps=train.max_bad_steps, save=save,
        log=logger.log if logger else (lambda row: None), progress=progress, flops_of=tm.cost_model.batch_flops,
        peak_flops=peak_flops(env.device), device_name=report.device_name(env.device), dp_group=ctx.dims.dp_group,
        sp_group=ctx.dims.sp_group, validator=build_validator(cfg, ctx, tm, engine, objective, saved_best=state.best),
        gc_freeze_step=train.gc_freeze_step)


def train_run(cfg, run_dir: Path, ctx: RunContext) -> str:
    """Model -> data -> wrap -> resume -> train -> export on this rank; returns "done", "stopped" or "interrupted"."""
    from vlmctl.data.loader import build_loader
    from vlmctl.train import report
    from vlmctl.train.checkpoint import resolve_resume
    from vlmctl.train.export import export_final
    from vlmctl.train.metrics import MetricsLogger, plot_loss_or_warn

    train, env = cfg.train, ctx.env
    resume_from = resolve_resume(run_dir, train.resume)
    tm = load_model_for_training(cfg, ctx, resuming=resume_from is not None)
    dataset, lengths = load_data(cfg, ctx, tm)
    objective = build_objective(tm, train, ctx, cfg, run_dir)
    engine = None
    before = has_hook(objective, "before_training")  # e.g. DPO's precomputed reference log-probs
    if before:
        objective.stand_in_for_probe()
    if autotune.wants(ctx.plan):  # the probe measures the wrapped model; the schedule's length follows its choice
        engine = wrap_model(tm, train, ctx, total_steps=1)
        autotune.tune(cfg, run_dir, ctx, tm, engine, objective, dataset, lengths, log=lambda m: print(m, file=sys.stderr))
    sampler = build_sampler(cfg, ctx, dataset, lengths)
    total_steps = train.max_steps or max(1, math.ceil(train.num_epochs * sampler.batches_per_epoch / train.gradient_accumulation_steps))
    engine = wrap_model(tm, train, ctx, total_steps) if engine is None else reschedule(engine, train, total_steps)
    if before:  # before resume_state: the weights have not trained yet
        objective.before_training(cfg, ctx, tm, engine, dataset, build_collator(cfg, ctx, tm), run_dir, resume_from)
    state = resume_state(resume_from, ctx, engine, train, objective)
    sampler.set_position(state.consumed)
    loader = build_loader(dataset, sampler, build_collator(cfg, ctx, tm), num_workers=train.num_workers, seed=train.seed)
    logger = None
    if env.is_main:
        write_plan(run_dir, ctx.plan)  # with what this rank settled (the probe, FSDP2's reshard rule)
        logger = MetricsLogger(run_dir, list(train.report_to), run_name=run_dir.name, project=cfg.project.name,
                               config=cfg.model_dump(mode="json"), resume_step=state.step)
        report.print_startup(report.startup_rows(train, run_dir=run_dir, ctx=ctx, tm=tm, dataset=dataset, sampler=sampler,
                                                 start_step=state.step, total_steps=total_steps, resume_from=resume_from))
    trainer = build_trainer(cfg, run_dir, ctx, tm, engine, objective, loader=loader, sampler=sampler, state=state,
                            total_steps=total_steps, logger=logger)
    try:
        outcome = trainer.train()
    finally:
        trainer.batches.close()
        trainer.progress.close()
        if logger is not None:
            logger.close()
            # a convenience: a full disk here is a warning, not the run's error
            plot_loss_or_warn(run_dir, objective.spec.curves, loss=objective.spec.plots_loss)
    if outcome != "done":
        if os.environ.get(LAUNCHER_ENV) is None:  # else the launcher reports the stop, in one line
            trainer.progress.print(f"[yellow]stopped by a signal at step {state.step}; checkpoint saved. "
                                   f"Continue with `vlmctl train --resume`[/yellow]")
        return outcome
    export_final(run_dir, cfg, engine=engine, source=tm.source, dtype=ctx.dtype, rank=env.rank, lora=train.lora,
                 parts_trainable=tm.trainable)
    trainer.progress.print(f"final model exported to {run_dir / 'final'}", markup=False)
    name_best(run_dir, trainer.validator, trainer.progress.print)  # train.save_best
    return outcome


def run(run_dir: Path) -> str:
    """Train per `run_dir/config.yaml` on this rank; returns "done", "stopped" or "interrupted" (after a signal).
    `rundir.guard_run`: temporary files are swept before and after a failure, a full disk is a CheckpointError."""
    import torch.distributed as dist

    from vlmctl.config import load_config
    from vlmctl.train.report import filter_known_warnings
    from vlmctl.config.plan import read_plan
    from vlmctl.train.rundir import guard_run

    filter_known_warnings()  # benign warnings that would alarm on every run
    run_dir = Path(run_dir).resolve()
    cfg = load_config(run_dir / "config.yaml")
    try:
        with guard_run(run_dir, main=int(os.environ.get("RANK", "0")) == 0):
            ctx = autotune.record_plan(run_dir, setup_run(cfg.train, read_plan(run_dir), planned_family(cfg)))  # rank 0: plan.json
            outcome = train_run(cfg.model_copy(update={"train": ctx.plan.train_section(cfg.train)}), run_dir, ctx)
            dist.barrier()
        return outcome
    finally:
        # No barrier after a failure: the other ranks may be blocked in a collective; the agent stops them.
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Console entry of a rank: `python -m vlmctl.train.worker RUN_DIR`. The rank dies with the agent that started
    it and with the `vlmctl train` named in VLMCTL_LAUNCHER_PID (`distributed.process`)."""
    from vlmctl.distributed.process import exit_on_stop_signals, report_error, tie_to_launcher

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m vlmctl.train.worker RUN_DIR", file=sys.stderr)
        sys.exit(2)
    tie_to_launcher()
    exit_on_stop_signals()  # until the step loop installs its own handlers (finish the step, save, stop)
    try:
        outcome = run(Path(args[0]))
    except VlmctlError as exc:
        sys.exit(report_error(exc))
    # Everything is saved and the process group is gone: leave without interpreter teardown, where a CUDA/NCCL
    # library's static destructors can abort an otherwise finished rank (seen after FSDP2 runs on one GPU).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STOPPED if outcome != "done" else 0)


if __name__ == "__main__":
    main()
