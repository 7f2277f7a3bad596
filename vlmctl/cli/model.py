"""`vlmctl model build`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, OverridesArg, console, info, load_project, print_json, state

app = typer.Typer(help="Build or inspect the model.", no_args_is_help=True)

EXAMPLE = "Example: vlmctl model build model.projector=linear --force"


@app.command("build", epilog=EXAMPLE)
def build(
    config: ConfigOpt = None,
    overrides: OverridesArg = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing built model.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compose vision encoder + projector + LLM (or pick up model.base) into a standard HF checkpoint."""
    cfg = load_project(config, overrides)
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from vlmctl.models.build import build_model
    from vlmctl.models.summary import training_summary

    prepared = cfg.data.prepared_dir if (cfg.data.prepared_dir / "train").is_dir() else None
    with Progress(SpinnerColumn(), TextColumn("building the model"), TimeElapsedColumn(), console=console,
                  transient=True, disable=state.quiet or as_json):
        result = build_model(cfg.model, prepared_dir=prepared, force=force, seed=cfg.project.seed)
    t = cfg.train
    num_gpus = t.nproc_per_node if isinstance(t.nproc_per_node, int) else _visible_gpus()
    summary = training_summary(result.info, stage=t.stage, strategy=t.strategy, num_gpus=num_gpus * t.nnodes,
                               freeze=t.freeze, lora=t.lora is not None)
    if as_json:
        print_json({**result.to_dict(), "summary": summary})
        return
    _render(result, summary)


def _visible_gpus() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def _render(result: Any, s: dict[str, Any]) -> None:
    from rich.table import Table

    names = {"vision": "vision tower", "projector": "projector", "llm": "language model"}
    table = Table(title=f"{result.output_dir} ({s['family']}, {result.mode})", title_justify="left")
    table.add_column("part")
    table.add_column("parameters", justify="right")
    table.add_column(f"trained at stage {s['stage']}")
    for part, label in names.items():
        trained = "[green]yes[/green]" if s["trained"][part] else ("LoRA" if part == "llm" and s["lora_on_llm"] else "[dim]frozen[/dim]")
        table.add_row(label, _count(s["parameters"][part]), trained)
    table.add_row("[bold]total[/bold]", f"[bold]{_count(s['parameters']['total'])}[/bold]", f"{_count(s['trainable_parameters'])} trainable")
    console.print(table)
    if s["visual_tokens_per_image"] is not None:
        info(f"Visual tokens per image: {s['visual_tokens_per_image']:,} at {s['image_size']}x{s['image_size']} px")
    mem = s["memory_per_gpu_bytes"]
    info(
        f"Training memory per GPU ({s['strategy']}, {s['num_gpus']} GPU(s), bf16 + AdamW, without activations): "
        f"~{_gib(mem['total'])} (weights {_gib(mem['weights'])}, gradients {_gib(mem['gradients'])}, optimizer {_gib(mem['optimizer'])})"
    )
    info(f"[green]Built[/green] {result.output_dir} in {result.seconds:.1f} s")


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"
