"""Training-throughput benchmark: tokens/s, MFU (vision tower included), step time, peak memory.

The measured step is the trainer's own (`vlmctl.train.loop.Trainer.train_step`) on the model, kernels, stage,
strategy (none/ddp/fsdp/zero2/zero3) and optimizer that `vlmctl train` would use for the same config; only the data
is synthetic and packed in advance. Multi-GPU runs start one process per GPU through torchrun
(`python -m vlmctl.bench WORKDIR`); every rank packs its own rows and the figures are summed over ranks.

The workload reproduces the plain-transformers baseline's sample distribution for Qwen-VL architectures (one
square image of 224/336/448/560 px, i.e. 64..400 merged visual tokens, plus 64..1536 uniformly random text
tokens, every text token labelled), so vlmctl and the baseline can be measured in one run on the same GPU.

FLOPs: each packed row's training FLOPs come from `vlmctl.train.flops.CostModel.batch_flops`, summed by the
trainer's own step over the data-parallel ranks, exactly as `vlmctl train` sums them for its MFU column; so bench
and train report the same MFU for the same batch. MFU = FLOPs / step time / (peak x GPUs), with the device's
data-sheet peak (`vlmctl.train.metrics.peak_flops`), else 989 TFLOP/s (H100/H200 SXM dense bf16).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_PEAK = 989e12  # H100/H200 SXM dense bf16: the reference for devices without a data-sheet figure (CPUs)


@dataclass
class WorkloadSpec:
    image_sizes: tuple[int, ...] = (224, 336, 448, 560)
    text_tokens: tuple[int, int] = (64, 1536)
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2


@dataclass
class BenchResult:
    name: str
    steps: int
    world_size: int
    strategy: str
    tokens_per_s: float
    text_tokens_per_s: float
    visual_tokens_per_s: float
    samples_per_s: float
    step_time_s: float
    mfu: float
    peak_memory_gib: float  # the largest over ranks
    tokens_per_step: float  # all ranks together

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu}


def qwen_vl_samples(n: int, cfg, spec: WorkloadSpec = WorkloadSpec(), seed: int = 0) -> list[dict[str, Any]]:
    """`n` encoded samples shaped like the baseline's: dicts with input_ids/labels (L,), mm_token_type_ids (L,),
    pixel_values (patches, 3 * t * patch^2) float32 and image_grid_thw (1, 3), plus `n_patches`, `n_visual`,
    `n_text` counts. `cfg` is a Qwen2/2.5-VL config (token ids, vocabulary size)."""
    import torch

    rng = random.Random(seed)
    vocab = cfg.text_config.vocab_size
    special = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    out = []
    for _ in range(n):
        side = rng.choice(spec.image_sizes)
        gh = gw = side // spec.patch_size
        n_visual = gh * gw // spec.merge_size**2
        n_text = rng.randint(*spec.text_tokens)
        ids = [cfg.vision_start_token_id] + [cfg.image_token_id] * n_visual + [cfg.vision_end_token_id]
        ids += [t if t not in special else t + len(special) + 1 for t in (rng.randrange(0, vocab - len(special) - 1) for _ in range(n_text))]
        ids_t = torch.tensor(ids)
        labels = ids_t.clone()
        labels[: n_visual + 2] = -100
        out.append({
            "input_ids": ids_t,
            "labels": labels,
            "mm_token_type_ids": (ids_t == cfg.image_token_id).long(),
            "pixel_values": torch.randn(gh * gw, 3 * spec.temporal_patch_size * spec.patch_size**2),
            "image_grid_thw": torch.tensor([[1, gh, gw]]),
            "n_patches": gh * gw,
            "n_visual": n_visual,
            "n_text": n_text + 2,
        })
    return out


def packed_batch(group: list[dict[str, Any]], dtype) -> dict[str, Any]:
    """One packed row of synthetic samples with the counters the trainer's collator adds (see
    `vlmctl.data.collate.PackedCollator`); pixel values in the training dtype, as the processor's output would be
    cast on the device."""
    from vlmctl.data.packing import pack_samples

    batch = pack_samples([{k: v for k, v in s.items() if hasattr(v, "numel")} for s in group])
    batch["pixel_values"] = batch["pixel_values"].to(dtype)
    batch["num_label_tokens"] = sum(int((s["labels"][1:] != -100).sum()) for s in group)
    batch["num_visual_tokens"] = sum(s["n_visual"] for s in group)
    batch["num_text_tokens"] = sum(s["n_text"] for s in group)
    batch["num_dummy_images"] = 0
    batch["num_samples"] = len(group)
    return batch


def run_bench(model_section, train_section, *, steps: int = 20, warmup: int = 3, spec: WorkloadSpec = WorkloadSpec(),
              log=print, setup=None) -> BenchResult:
    """`vlmctl bench` on this rank: a random-init model of `model_section` (a Qwen-VL `preset`, e.g.
    qwen2.5-vl-3b) trained for `warmup + steps` optimizer steps on the synthetic baseline-shaped workload with the
    settings of `train_section` (strategy, precision, master_weights, tokens_per_batch, attn_implementation, liger,
    gradient_checkpointing, compile, stage, ...). Call it in every process of a torchrun launch, or alone (one
    process). `setup(model)`, when given, is applied to the model before wrapping (benchmark scripts use it to try
    kernels that have no config key yet). Returns the figures of the last `steps` steps, summed over ranks.

    Raises UsageError for a model that is not a Qwen-VL preset (the workload is Qwen-VL shaped) or for
    `train.packing: false`.
    """
    import torch.distributed as dist

    from vlmctl.train.setup import setup_run

    log = log or (lambda msg: None)
    plan = bench_plan(model_section, train_section)
    try:
        ctx = setup_run(train_section)
        return _run_bench(plan, model_section, train_section, ctx, steps=steps, warmup=warmup, spec=spec, log=log, setup=setup)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def bench_plan(model_section, train):
    """The build plan of the benchmarked model. Raises UsageError for a model that is not a Qwen-VL architecture
    (the workload is Qwen-VL shaped) or for `train.packing: false`."""
    from vlmctl.errors import UsageError
    from vlmctl.models.build import plan_build

    plan = plan_build(model_section)
    if not plan.family.mrope:
        raise UsageError(
            f"vlmctl bench runs Qwen-VL architectures; model family {plan.family.name!r} is not one",
            hint="set model.preset to qwen2.5-vl-3b, qwen2.5-vl-7b or tiny-qwen2.5-vl (with model.init=random)",
        )
    if not train.packing:
        raise UsageError("vlmctl bench measures packed training; train.packing is false",
                         hint="set train.packing=true (the default)")
    return plan


def rank_rows(model, train, spec: WorkloadSpec, *, rows: int, dp_rank: int, dp_size: int, dtype) -> list[dict[str, Any]]:
    """This data-parallel rank's packed rows of synthetic samples: every rank draws the same samples and packs the
    same `rows` rows (fullest first), then takes every dp_size-th row. Raises UsageError when too few rows fit."""
    from vlmctl.data.packing import first_fit_decreasing
    from vlmctl.errors import UsageError

    mean_tokens = sum(spec.text_tokens) / 2 + sum((s // spec.patch_size) ** 2 / spec.merge_size**2 for s in spec.image_sizes) / len(spec.image_sizes)
    n = int((rows + 2) * train.tokens_per_batch / mean_tokens * 1.3) + 8
    samples = qwen_vl_samples(n, model.config, spec, seed=train.seed)
    # samples longer than a row are left out, as the trainer's packed sampler does
    fitting = ((i, s["input_ids"].numel()) for i, s in enumerate(samples) if s["input_ids"].numel() <= train.tokens_per_batch)
    bins = list(first_fit_decreasing(fitting, train.tokens_per_batch, lookahead=512))
    # fullest rows first: the partial tail rows of a finite sample set would understate throughput
    bins.sort(key=lambda b: -sum(samples[k]["input_ids"].numel() for k in b))
    if len(bins) < rows:
        raise UsageError(f"{len(samples)} synthetic samples make only {len(bins)} packed rows; {rows} are needed",
                         hint="raise train.tokens_per_batch or lower --steps")
    return [packed_batch([samples[k] for k in b], dtype) for b in bins[dp_rank:rows:dp_size]]


def _run_bench(plan, model_section, train, ctx, *, steps, warmup, spec, log, setup) -> BenchResult:
    import torch

    from vlmctl.models.build import instantiate
    from vlmctl.train.loop import Trainer, TrainState, prefetch
    from vlmctl.train.setup import prepare_model
    from vlmctl.train.worker import wrap_model

    env, dims, total_steps = ctx.env, ctx.dims, steps + warmup
    model = instantiate(plan, device=str(env.device), dtype="bf16" if ctx.stored == torch.bfloat16 else "fp32")
    tm = prepare_model(model, plan.family, train, env.device)
    log(f"attention {tm.attn}, liger {'on' if tm.liger else 'off'}" + "".join(f", vision {k}" for k in tm.vision_kernels))
    if setup is not None:
        setup(tm.model)
    gas = train.gradient_accumulation_steps
    batches = rank_rows(tm.model, train, spec, rows=total_steps * gas * dims.dp_size, dp_rank=dims.dp_rank,
                        dp_size=dims.dp_size, dtype=ctx.dtype)
    wrapped = wrap_model(tm, train, ctx, total_steps)
    trainer = Trainer(stepper=wrapped.stepper, batches=prefetch(iter(batches), tm.prepare), env=env, state=TrainState(),
                      total_steps=total_steps, grad_accum=gas, batches_per_epoch=len(batches), save_steps=1 << 30,
                      logging_steps=1 << 30, max_bad_steps=total_steps, save=None, log=None, progress=None,
                      flops_of=tm.cost_model.batch_flops, dp_group=dims.dp_group)
    return _measure(trainer, model_section, train, ctx, steps=steps, warmup=warmup, log=log)


def _measure(trainer, model_section, train, ctx, *, steps: int, warmup: int, log) -> BenchResult:
    """`warmup + steps` trainer steps; the figures of the last `steps`. Tokens, samples and FLOPs are the steps'
    own data-parallel sums; the time is the slowest rank's, the memory the largest."""
    import torch
    import torch.distributed as dist

    from vlmctl.train import flops as cost
    from vlmctl.train.metrics import peak_flops

    env = ctx.env
    cuda = env.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    totals = torch.zeros(4, dtype=torch.float64)  # flops, text, visual, samples
    seconds = torch.zeros(1, dtype=torch.float64)
    for i in range(steps + warmup):
        sync()
        t0 = time.perf_counter()
        result = trainer.train_step()  # ends in a collective that waits for the device
        dt = time.perf_counter() - t0
        if i >= warmup:
            totals += torch.tensor([result.flops, result.text_tokens, result.visual_tokens, result.samples], dtype=torch.float64)
            seconds += dt
        if env.is_main:
            loss = "skipped" if result.loss is None else f"{result.loss:.3f}"
            log(f"step {i}{' (warm-up)' if i < warmup else ''}: loss {loss}, {dt * 1000:.0f} ms, "
                f"{result.text_tokens + result.visual_tokens} tokens, {result.samples} samples")
    peak = torch.tensor([torch.cuda.max_memory_allocated(env.device) / 2**30 if cuda else 0.0], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        peak, seconds = peak.to(env.device), seconds.to(env.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    flops, text, visual, n_samples = (float(x) for x in totals)
    total, world, toks = float(seconds.cpu()[0]), env.world_size, text + visual
    mfu = cost.mfu(flops, total, peak_flops(env.device) or DEFAULT_PEAK, world)
    return BenchResult(
        name=model_section.preset or "model", steps=steps, world_size=world, strategy=train.strategy,
        tokens_per_s=toks / total, text_tokens_per_s=text / total, visual_tokens_per_s=visual / total,
        samples_per_s=n_samples / total, step_time_s=total / steps, mfu=mfu or 0.0,
        peak_memory_gib=float(peak.cpu()[0]), tokens_per_step=toks / steps,
    )


def benchmark(cfg, *, steps: int = 20, warmup: int = 3, spec: WorkloadSpec = WorkloadSpec(), log=print) -> BenchResult:
    """`vlmctl bench` for a project config: in this process for one process per node and one node, else one process
    per GPU through torchrun (`train.nproc_per_node`, auto = the visible GPUs), rank 0 handing the figures back
    through a temporary folder. Raises UsageError for more than one node, ConfigError for an optional package the
    config needs that is missing (`train.launch.check_packages`), VlmctlError when the ranks fail."""
    import json
    import tempfile
    from pathlib import Path

    from vlmctl.config import dump_config
    from vlmctl.errors import UsageError, VlmctlError
    from vlmctl.train.launch import check_packages, clear_rank_env, launch_command, launch_env, resolve_nproc, spawn
    from vlmctl.distributed.env import free_port

    train = cfg.train
    if train.nnodes > 1:
        raise UsageError("vlmctl bench runs on one node", hint="set train.nnodes=1 (tokens/s per GPU carry over to more nodes only approximately)")
    check_packages(train)  # before any process starts (ConfigError)
    nproc = resolve_nproc(train.nproc_per_node)
    if nproc == 1:
        clear_rank_env()
        return run_bench(cfg.model, train, steps=steps, warmup=warmup, spec=spec, log=log)
    # torchrun on this node whatever train.launcher says, on a free port (a training run may hold master_port)
    local = train.model_copy(update={"launcher": "torchrun", "master_addr": "127.0.0.1", "master_port": free_port(), "node_rank": 0})
    with tempfile.TemporaryDirectory(prefix="vlmctl-bench-") as tmp:
        work = Path(tmp)
        (work / "config.yaml").write_text(dump_config(cfg))
        (work / "args.json").write_text(json.dumps({"steps": steps, "warmup": warmup, "image_sizes": list(spec.image_sizes),
                                                    "text_tokens": list(spec.text_tokens), "verbose": log is not None}))
        code, _ = spawn(launch_command(local, work, module="vlmctl.bench").command, env=launch_env(train))
        result = work / "result.json"
        if code != 0 or not result.is_file():
            raise VlmctlError(f"the bench processes failed (exit code {code})", hint="see the rank output above")
        data = json.loads(result.read_text())
    data.pop("tokens_per_s_per_gpu", None)
    return BenchResult(**data)


def main(argv: list[str] | None = None) -> None:
    """One rank of a multi-process bench: `python -m vlmctl.bench WORKDIR` (torchrun sets the rank). WORKDIR holds
    `config.yaml` and `args.json` (steps, warmup, image_sizes, text_tokens); rank 0 writes `result.json`."""
    import json
    import os
    import sys
    from pathlib import Path

    from vlmctl.config import load_config
    from vlmctl.distributed.process import exit_on_stop_signals, report_error, tie_to_launcher
    from vlmctl.errors import VlmctlError

    tie_to_launcher()  # no rank outlives `vlmctl bench`
    exit_on_stop_signals()  # nothing to save: SIGTERM/SIGINT end a rank at once, quietly
    work = Path((sys.argv[1:] if argv is None else argv)[0])
    args = json.loads((work / "args.json").read_text())
    cfg = load_config(work / "config.yaml")
    spec = WorkloadSpec(image_sizes=tuple(args["image_sizes"]), text_tokens=tuple(args["text_tokens"]))
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run_bench(cfg.model, cfg.train, steps=args["steps"], warmup=args["warmup"], spec=spec,
                           log=(lambda msg: print(msg, flush=True)) if args.get("verbose", True) else (lambda msg: None))
    except VlmctlError as exc:
        sys.exit(report_error(exc))
    if rank == 0:
        tmp = work / "result.json.tmp"
        tmp.write_text(json.dumps(result.as_dict()))
        os.replace(tmp, work / "result.json")


if __name__ == "__main__":
    main()
