"""`vlmctl model build`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, OverridesArg, console, esc, info, load_project, print_json, result_line, state

# The vlmctl modules that load numpy when imported are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for it.
# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

app = typer.Typer(help="Build or inspect the model.", no_args_is_help=True)



def _preset_names() -> list[str]:
    """The shipped presets' names, from their folder, without importing the model code (--help stays light)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vlmctl.models")
    folder = Path(next(iter(spec.submodule_search_locations))) / "presets"
    return sorted(p.stem for p in folder.glob("*.yaml"))


EXAMPLE = ("Example: vlmctl model build model.projector=linear --force  (vlmctl model build --list: the supported families)"
           "\n\nPresets (model.preset, model.vision, model.llm with init: random): " + ", ".join(_preset_names())
           + " (vlmctl model presets describes them)")


@app.command("build", epilog=EXAMPLE)
def build(
    config: ConfigOpt = None,
    overrides: OverridesArg = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing built model.")] = False,
    list_families: Annotated[bool, typer.Option("--list", help="List the supported model families and exit.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compose vision encoder + projector + LLM (or pick up model.base) into a standard HF checkpoint."""
    if list_families:
        _list_families(as_json)
        return
    cfg = load_project(config, overrides)
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from vlmctl.models.build import build_model

    prepared = cfg.data.prepared_dir if (cfg.data.prepared_dir / "train").is_dir() else None
    with Progress(SpinnerColumn(), TextColumn("building the model"), TimeElapsedColumn(), console=console,
                  transient=True, disable=state.quiet or as_json or not console.is_terminal):
        result = build_model(cfg.model, prepared_dir=prepared, force=force, seed=cfg.project.seed)
    summary = _summary(result.info, cfg.train)
    if as_json:
        print_json({**result.to_dict(), "summary": summary})
        return
    _render(result, summary)


@app.command("presets")
def presets(as_json: JsonOpt = False) -> None:
    """List the shipped size presets (model.preset, or model.vision / model.llm with init: random)."""
    from rich.table import Table

    from vlmctl.models.build import list_presets

    rows = list_presets()
    if as_json:
        print_json(rows)
        return
    table = Table(title="Presets", title_justify="left")
    table.add_column("name")
    table.add_column("what it is")
    for name, description in rows.items():
        table.add_row(esc(name), esc(description))
    console.print(table)


def _list_families(as_json: bool) -> None:
    from rich.table import Table

    from vlmctl.families import family_table

    rows = family_table()
    if as_json:
        print_json(rows)
        return
    fields = {
        "model class": lambda r: r["model_class"],
        "modalities": lambda r: "\n".join(f"{m} {t}" for m, t in r["modalities"].items()),
        "vision tower": lambda r: r["vision_tower"],
        "projector": lambda r: "\n".join(r["projector"]),
        "language model": lambda r: r["language_model"],
        "liger patch": lambda r: r["liger_patch"] or "[dim]-[/dim]",
        "notes": lambda r: r["notes"] + (" [dim](compose family: model.vision + model.llm)[/dim]" if r["compose"] else ""),
    }
    title = "Model families (model.family; detected from the checkpoint's model_type)"
    if console.width >= 230:  # one row per family
        table = Table(title=title, title_justify="left")
        table.add_column("family", no_wrap=True)
        for label in fields:
            table.add_column(label, no_wrap=label != "notes", min_width=30 if label == "notes" else None)
        for r in rows:
            table.add_row(r["name"], *(get(r) for get in fields.values()))
        console.print(table)
        return
    console.print(title)
    for r in rows:  # narrow terminals: one small key/value table per family
        console.print()
        table = Table(title=f"[bold]{r['name']}[/bold]", title_justify="left", show_header=False, box=None, pad_edge=False)
        table.add_column(style="dim", no_wrap=True)
        table.add_column(overflow="fold")
        for label, get in fields.items():
            table.add_row(label, get(r))
        console.print(table)


def _summary(info: dict[str, Any], t: Any) -> dict[str, Any]:
    """The build under the project's `train` settings, on the device and process count a `vlmctl train` here uses."""
    from vlmctl.config.plan import run_processes
    from vlmctl.models import summary

    processes = run_processes(t)  # the run plan's rule: nodes x processes per node, 1 in-process
    return summary.training_summary(
        info, stage=t.stage, strategy=t.strategy, num_gpus=processes, freeze=t.freeze, lora=t.lora is not None,
        device=summary.training_device(t.launcher), precision=t.precision, master_weights=t.master_weights,
        optimizer_in_backward=t.optimizer_in_backward, quantize=t.lora.quantize if t.lora is not None else None,
        tensor_parallel=t.tensor_parallel,
    )


def _render(result: Any, s: dict[str, Any]) -> None:
    from rich.table import Table

    names = s.get("part_labels") or {"vision": "vision tower", "projector": "projector", "llm": "language model"}
    table = Table(title=f"{esc(result.output_dir)} ({s['family']}, {result.mode})", title_justify="left")
    table.add_column("part")
    table.add_column("parameters", justify="right")
    table.add_column(f"trained at stage {s['stage']}")
    for part, label in names.items():
        trained = "[green]yes[/green]" if s["trained"][part] else ("LoRA" if part == "llm" and s["lora_on_llm"] else "[dim]frozen[/dim]")
        table.add_row(label, _count(s["parameters"][part]), trained)
    table.add_row("[bold]total[/bold]", f"[bold]{_count(s['parameters']['total'])}[/bold]", f"{_count(s['trainable_parameters'])} trainable" + (" + LoRA adapters" if s["lora_on_llm"] else ""))
    console.print(table)
    if s["visual_tokens_per_image"] is not None:
        info(f"Visual tokens per image: {s['visual_tokens_per_image']:,} at {s['image_size']}x{s['image_size']} px")
    shares = result.info.get("resampler_own_cell_attention")
    if shares:
        info("Perceiver resampler seeded by region: each visual token reads its own cell of the picture "
             f"(attention on it per block: {', '.join(f'{x:.0%}' for x in shares)})")
    mem = s["memory_per_gpu_bytes"]
    n = s["num_processes"]
    where = ("per GPU", f"{n} GPU(s)") if s["device"] == "cuda" else ("per process", f"{n} process(es) on CPU")
    if s.get("tensor_parallel", 1) > 1:
        where = (where[0], f"{where[1]}, language model over {s['tensor_parallel']} tensor-parallel ranks")
    info(
        f"Training memory {where[0]} ({s['strategy']}, {where[1]}, {s['storage']}, without activations): "
        f"~{_gib(mem['total'])} (weights {_gib(mem['weights'])}, gradients {_gib(mem['gradients'])}, optimizer {_gib(mem['optimizer'])})"
    )
    result_line(f"[green]Built[/green] {esc(result.output_dir)} in {result.seconds:.1f} s")


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"
