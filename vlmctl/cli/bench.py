"""`vlmctl bench`: measure training throughput (tokens/s, MFU, memory) of the configured model on synthetic data."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, OverridesArg, console, err_console, load_project, print_json, state

# The vlmctl modules that load numpy when imported are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for it.
# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

EXAMPLE = ("Example: vlmctl bench --steps 20 --nproc-per-node 2 model.preset=qwen2.5-vl-7b model.init=random "
           "train.strategy=fsdp train.stage=full   (LoRA: train.lora.r=16; padded: train.packing=false; "
           "scale-out: --scaling 1,2,4)")


def bench(
    config: ConfigOpt = None,
    overrides: OverridesArg = None,
    steps: Annotated[int, typer.Option("--steps", help="Measured training steps.")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", help="Unmeasured steps first (compilation, allocator warm-up).")] = 3,
    image_sizes: Annotated[Optional[str], typer.Option("--image-sizes", help="Square image sides in px, one drawn per image (default: the built model's image size, else 224,336,448,560).", show_default=False)] = None,
    images_per_sample: Annotated[str, typer.Option("--images-per-sample", help="Range of images per sample, MIN,MAX.")] = "1,1",
    video_frames: Annotated[Optional[str], typer.Option("--video-frames", help="Video samples instead of images: one clip per sample of MIN,MAX frames (even counts; families that take video: Qwen2-VL, Qwen2.5-VL, Qwen3-VL), through the chat workload.")] = None,
    video_sizes: Annotated[str, typer.Option("--video-sizes", help="Square video frame sides in px, one drawn per clip (with --video-frames).")] = "224,336,448",
    text_tokens: Annotated[Optional[str], typer.Option("--text-tokens", help="Range of text tokens per sample (the answer's in the chat workload), MIN,MAX (default: 64 up to what data.max_length leaves beside the images, at most 1536).", show_default=False)] = None,
    workload: Annotated[str, typer.Option("--workload", help="chat (processor + chat template + the trainer's collator), baseline (the Qwen-VL baseline's packed samples) or auto (baseline for Qwen-VL with packing and image samples, else chat).")] = "auto",
    nproc_per_node: Annotated[Optional[str], typer.Option("--nproc-per-node", help="Processes (GPUs), or auto; more than one runs through torchrun.")] = None,
    scaling: Annotated[Optional[str], typer.Option("--scaling", help="Process counts, e.g. 1,2,4: run the bench at each (one process per GPU; CPU processes where no GPU is visible) and report tokens/s per GPU and the efficiency against the fewest processes.")] = None,
    auto: Annotated[bool, typer.Option("--auto", help="Batch size and activation checkpointing as `auto` (whatever the config says): shows what training's start-up probe picks here, and why.")] = False,
    show_plan: Annotated[bool, typer.Option("--plan", help="Print the run plan (every auto decided, with the reason, as `vlmctl train --dry-run` prints it) after the checks, and exit without measuring.")] = False,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Profile the last warm-up step (give --warmup 2 or more) with torch.profiler on every rank: DIR/rank<N>/ops.txt (GPU-busy share, where the GPU sat idle, top operators) and trace.json.gz (open in ui.perfetto.dev).", show_default=False)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run N training steps of the configured model, stage, adapters (LoRA/QLoRA), strategy and kernels (the trainer's
    own step) on synthetic data, packed or padded as training batches it, and report tokens/s (text and visual, all
    GPUs and per GPU), MFU with ViT FLOPs, step time, peak memory; with --scaling, one row per process count.
    Samples hold one image, --images-per-sample images, or with --video-frames one video clip, plus the text.
    With train.objective=grpo the samples are prompts (their answers the references): also rollouts/s, generated
    tokens/s, the generation share of the step and train tokens/s."""
    from vlmctl.errors import UsageError

    if scaling is not None and nproc_per_node is not None:
        raise UsageError("--scaling and --nproc-per-node both set the number of processes", hint="give one of them, e.g. --scaling 1,2,4")
    if profile is not None and warmup < 1:
        raise UsageError("--profile profiles the last warm-up step, and --warmup is 0", hint="give --warmup 2 (the first step also compiles and warms the allocator)")
    if scaling is not None and profile is not None:
        raise UsageError("--profile profiles one bench run, not a --scaling series", hint="give --nproc-per-node N with --profile")
    auto_keys = ["train.tokens_per_batch=auto", "train.micro_batch_size=auto", "train.activation_checkpointing=auto"] if auto else []
    cfg = load_project(config, [*(overrides or []), *auto_keys,
                                *([f"train.nproc_per_node={nproc_per_node}"] if nproc_per_node else [])])
    from vlmctl.bench import WorkloadSpec, benchmark
    from vlmctl.bench import scaling as bench_scaling

    most = images_per_sample.split(",")[-1].strip()
    image_sizes, text_tokens = project_shapes(cfg, image_sizes, text_tokens, int(most) if most.isdigit() else 1)
    spec = WorkloadSpec.from_flags(image_sizes, text_tokens, workload, images_per_sample=images_per_sample,
                                   video_frames=video_frames, video_sizes=video_sizes)
    # with --json the progress (start-up probe trials, compile, steps) goes to stderr, so stdout stays one JSON object
    # and a run stopped by a time limit still shows how far it got
    out = err_console if as_json else console
    log = None if state.quiet else (lambda msg: out.print(f"[dim]{msg}[/dim]", markup=True, highlight=False))
    from vlmctl.config.plan import plan_text

    def print_plan(run_plan) -> None:  # stderr: stdout stays the result (one JSON object with --json)
        err_console.print(plan_text(run_plan), soft_wrap=True, markup=False, highlight=False)

    if show_plan:
        from vlmctl.bench import check_bench
        from vlmctl.config.plan import nproc_per_node

        print_plan(check_bench(cfg, nproc_per_node(cfg.train), steps=steps, warmup=warmup, spec=spec,
                               log=log).run)
        return
    if scaling is not None:
        rows = bench_scaling(cfg, scaling, steps=steps, warmup=warmup, spec=spec, log=log)
        if as_json:
            print_json(rows.as_dict())
        else:
            _render_scaling(rows)
        return
    result = benchmark(cfg, steps=steps, warmup=warmup, spec=spec, log=log,
                       show_plan=None if state.quiet else print_plan, profile=profile)
    if as_json:
        print_json(result.as_dict())
        return
    from rich.table import Table

    batching = "packed rows" if result.packing else "padded micro-batches"
    adapter = "" if result.adapter == "none" else f", {result.adapter}"
    table = Table(title=f"vlmctl bench: {result.name} (stage {result.stage}{adapter}), {result.strategy} on "
                        f"{result.world_size} process(es), {result.steps} steps of {result.tokens_per_step:,.0f} tokens "
                        f"({result.workload} workload{_media(result)}, {batching})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    slowest = slowest_step(result)
    steps = [("  median / slowest step", slowest)] if slowest else []
    for label, value in [
        ("tokens/s", f"{result.tokens_per_s:,.0f}"),
        ("  per GPU", f"{result.tokens_per_s_per_gpu:,.0f}"),
        ("  text tokens/s", f"{result.text_tokens_per_s:,.0f}"),
        ("  visual tokens/s", f"{result.visual_tokens_per_s:,.0f}"),
        ("samples/s", f"{result.samples_per_s:,.2f}"),
        ("step time", f"{result.step_time_s * 1000:,.0f} ms"),
        *steps,
        ("training FLOPs per token", f"{result.flops_per_token:,.4g}"),
        ("MFU (ViT included)", f"{result.mfu * 100:.1f}%" if result.on_gpu else "n/a (CPU)"),
        ("peak memory", f"{result.peak_memory_gib:.1f} GiB" if result.on_gpu else "n/a (CPU)"),
    ]:
        table.add_row(label, value)
    if result.rollouts_per_s is not None:  # grpo: the step is generation, then training on the rollouts
        for label, value in [
            ("rollouts per step", f"{result.rollouts_per_step:,.0f}"),
            ("rollouts/s (generation)", f"{result.rollouts_per_s:,.2f}"),
            ("  per GPU", f"{result.rollouts_per_s_per_gpu:,.2f}"),
            ("generated tokens/s", f"{result.generated_tokens_per_s:,.0f}"),
            ("generation share of the step", _percent(result.generation_share)),
            ("rollout / train time", f"{result.rollout_s * 1000:,.0f} / {result.train_s * 1000:,.0f} ms"),
            ("train tokens/s", f"{result.train_tokens_per_s:,.0f}"),
        ]:
            table.add_row(label, value)
    if result.balance is not None:
        table.add_row("balance (compute / FLOPs)", f"{result.balance * 100:.1f}% / {(result.balance_flops or 0) * 100:.1f}%")
    if result.data_wait is not None:
        table.add_row("data wait", _percent(result.data_wait))
    table.add_row("settings", result.settings)
    console.print(table)


def slowest_step(result) -> str | None:
    """The bench table's "median / slowest step" value of `result` (a `BenchResult`): the median and the slowest
    measured step in ms, which step, and what of it the collector's pauses and torch.compile's compilations took;
    None with fewer than two measured steps. An outlier step only raises the mean: this names it."""
    times = result.step_times_s
    if not times or len(times) < 2:
        return None
    slow = max(range(len(times)), key=times.__getitem__)

    def at_slowest(values):  # a per-step figure of the slowest step; 0 where the result has none for every step
        return values[slow] if values and len(values) == len(times) else 0

    gc, compiled = at_slowest(result.step_gc_s), at_slowest(result.step_compiles)
    extra = f", {gc * 1000:,.0f} ms of it in the garbage collector" if gc >= 0.001 else ""
    extra += f", {compiled} graph{'s' if compiled != 1 else ''} compiled in it" if compiled else ""
    return (f"{statistics.median(times) * 1000:,.0f} / {times[slow] * 1000:,.0f} ms "
            f"(measured step {slow + 1} of {len(times)}{extra})")


def project_shapes(cfg, image_sizes: str | None, text_tokens: str | None, images: int) -> tuple[str, str]:
    """The --image-sizes and --text-tokens flags, defaulted to the project's shapes: the built model's image size
    (model.image_size before a build), and text of 64 up to what data.max_length leaves beside `images` images'
    visual tokens (at most 1536), so the samples are ones `data prepare` would keep."""
    from vlmctl.models.load import read_build_info

    info = read_build_info(cfg.model.output_dir) or {}
    size = info.get("image_size") or cfg.model.image_size
    if image_sizes is None:
        image_sizes = str(size) if size else "224,336,448,560"
    if text_tokens is None:
        visual = (info.get("visual_tokens_per_image") or 0) * images if size and str(size) == image_sizes else 0
        room = cfg.data.max_length - visual - 32 if cfg.data.max_length else 1536  # 32: the chat template's tokens
        text_tokens = f"{min(64, max(room, 8))},{max(8, min(1536, room))}"
    return image_sizes, text_tokens


def _media(result) -> str:
    """The title's ": MEDIA" part: what a sample held besides its text ("" for a result without that label)."""
    return f": {result.media}" if result.media else ""


def _percent(value) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _render_scaling(scaling) -> None:
    """One row per process count: tokens/s (all and per GPU), efficiency, MFU, step time, peak memory, balance and
    data wait; then the settings measured (once when every count ran the same)."""
    from rich import box
    from rich.table import Table

    base = scaling.baseline
    batching = "packed rows" if base.packing else "padded micro-batches"
    adapter = "" if base.adapter == "none" else f", {base.adapter}"
    table = Table(title=f"vlmctl bench --scaling: {base.name} (stage {base.stage}{adapter}), {base.strategy}, {base.steps} "
                        f"steps per count ({base.workload} workload{_media(base)}, {batching}); efficiency = tokens/s per GPU against "
                        f"{base.world_size} process{'es' * (base.world_size > 1)}", box=box.SIMPLE_HEAD)
    for name in ("procs", "tokens/s", "per\nGPU", "effic.", "MFU", "step\nms", "peak\nGiB", "balance", "data\nwait"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in scaling.results:
        table.add_row(str(r.world_size), f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s_per_gpu:,.0f}",
                      _percent(scaling.efficiency(r)), _percent(r.mfu) if r.on_gpu else "n/a", f"{r.step_time_s * 1000:,.0f}",
                      f"{r.peak_memory_gib:.1f}" if r.on_gpu else "n/a", _percent(r.balance), _percent(r.data_wait))
    console.print(table)
    settings = {r.settings for r in scaling.results}
    for r in scaling.results if len(settings) > 1 else scaling.results[:1]:
        count = f" ({r.world_size} process{'es' * (r.world_size > 1)})" if len(settings) > 1 else ""
        console.print(f"settings{count}: {r.settings}", highlight=False)
