"""`vlmctl bench`: measure training throughput (tokens/s, MFU, memory) on a synthetic, baseline-shaped workload."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, OverridesArg, console, load_project, print_json, state

EXAMPLE = ("Example: vlmctl bench --steps 20 --nproc-per-node 2 model.preset=qwen2.5-vl-7b model.init=random "
           "train.strategy=fsdp train.stage=full")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def bench(
    config: ConfigOpt = None,
    overrides: OverridesArg = None,
    steps: Annotated[int, typer.Option("--steps", help="Measured training steps.")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", help="Unmeasured steps first (compilation, allocator warm-up).")] = 3,
    image_sizes: Annotated[str, typer.Option("--image-sizes", help="Square image sides in px, one drawn per sample.")] = "224,336,448,560",
    text_tokens: Annotated[str, typer.Option("--text-tokens", help="Range of text tokens per sample, MIN,MAX.")] = "64,1536",
    nproc_per_node: Annotated[Optional[str], typer.Option("--nproc-per-node", help="Processes (GPUs), or auto; more than one runs through torchrun.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run N training steps of the configured model, strategy and kernels (the trainer's own step) on synthetic
    packed data and report tokens/s (text and visual, all GPUs and per GPU), MFU with ViT FLOPs, step time, peak
    memory."""
    cfg = load_project(config, [*(overrides or []), *([f"train.nproc_per_node={nproc_per_node}"] if nproc_per_node else [])])
    from vlmctl.bench import WorkloadSpec, benchmark
    from vlmctl.errors import UsageError

    lo_hi = _ints(text_tokens)
    if len(lo_hi) != 2 or lo_hi[0] > lo_hi[1]:
        raise UsageError(f"--text-tokens {text_tokens!r} is not MIN,MAX", hint="e.g. --text-tokens 64,1536")
    spec = WorkloadSpec(image_sizes=_ints(image_sizes), text_tokens=(lo_hi[0], lo_hi[1]))
    log = None if (as_json or state.quiet) else (lambda msg: console.print(f"[dim]{msg}[/dim]"))
    result = benchmark(cfg, steps=steps, warmup=warmup, spec=spec, log=log)
    if as_json:
        print_json(result.as_dict())
        return
    from rich.table import Table

    table = Table(title=f"vlmctl bench: {result.name}, {result.strategy} on {result.world_size} process(es), "
                        f"{result.steps} steps of {result.tokens_per_step:,.0f} tokens")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in [
        ("tokens/s", f"{result.tokens_per_s:,.0f}"),
        ("  per GPU", f"{result.tokens_per_s_per_gpu:,.0f}"),
        ("  text tokens/s", f"{result.text_tokens_per_s:,.0f}"),
        ("  visual tokens/s", f"{result.visual_tokens_per_s:,.0f}"),
        ("samples/s", f"{result.samples_per_s:,.2f}"),
        ("step time", f"{result.step_time_s * 1000:,.0f} ms"),
        ("MFU (ViT included)", f"{result.mfu * 100:.1f}%"),
        ("peak memory", f"{result.peak_memory_gib:.1f} GiB"),
    ]:
        table.add_row(label, value)
    console.print(table)
