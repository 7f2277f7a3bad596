"""`vlmctl data prepare` and `vlmctl data validate`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from vlmctl.cli._common import (ConfigOpt, JsonOpt, OverridesArg, console, debug, esc, info, load_project, print_json,
                                result_line, split_args, state)

if TYPE_CHECKING:
    from vlmctl.config import VlmctlConfig
    from vlmctl.data.pipeline import RowBudget

# The vlmctl modules that load numpy when imported are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for it.
# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

app = typer.Typer(help="Prepare and validate training data.", no_args_is_help=True)

PREPARE_EXAMPLE = "Example: vlmctl data prepare data.val_ratio=0.02 --num-proc 8"
VALIDATE_EXAMPLE = "Example: vlmctl data validate data/raw/train.json --json"
FORMATS = ("auto", "llava", "sharegpt", "messages", "parquet", "webdataset", "hf", "llamafactory", "preference")
"""`--format` of `data validate`: config.data.DataFormat (not imported here: `--help` does not load the config
models; a test keeps the two equal)."""


def _processor_dir(cfg: "VlmctlConfig") -> Path | None:
    # A built model (`vlmctl model build`) gives exact token counts.
    from vlmctl.data.tokens import has_processor

    return Path(cfg.model.output_dir) if has_processor(cfg.model.output_dir) else None


def _row_budget(cfg: "VlmctlConfig") -> "RowBudget | None":
    """The packed training row the trainer fills (`vlmctl.train.data.build_sampler`): train.tokens_per_batch x
    train.sequence_parallel tokens. None without packing (a sample is its own padded row) or with
    train.tokens_per_batch auto (the budget is measured when training starts)."""
    from vlmctl.data.pipeline import RowBudget

    train = cfg.train
    if not train.packing or not isinstance(train.tokens_per_batch, int):
        return None
    return RowBudget(train.tokens_per_batch, train.sequence_parallel)


@app.command("prepare", epilog=PREPARE_EXAMPLE)
def prepare(
    config: ConfigOpt = None,
    overrides: OverridesArg = None,
    num_proc: Annotated[Optional[int], typer.Option("--num-proc", help="Worker processes (default: all cores).")] = None,
    export: Annotated[Optional[str], typer.Option("--export", help="Also export another format: energon.")] = None,
    export_dir: Annotated[Optional[str], typer.Option("--export-dir", help="Where the export goes.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Read data.sources, drop defective samples (with reasons), write Parquet shards + manifest.json."""
    cfg = load_project(config, overrides)
    from vlmctl.data.prepare import prepare_data
    from vlmctl.models.build import configured_processor

    result = prepare_data(
        cfg.data,
        num_proc=num_proc,
        processor_dir=_processor_dir(cfg),
        model=cfg.model,  # before a build: the configured model's tokenizer / processor counts
        processors=configured_processor,
        row_budget=_row_budget(cfg),
        export=export,
        export_dir=Path(export_dir) if export_dir else None,
        progress=not (as_json or state.quiet),
    )
    if as_json:
        print_json(result.to_dict())
        return
    _render_prepare(result.manifest, result.prepared_dir, result.export_dir, result.token_note)


def _render_prepare(m: dict[str, Any], out: Path, export_dir: Path | None, token_note: str | None = None) -> None:
    from rich.table import Table

    table = Table(title="Sources", title_justify="left")
    table.add_column("source")
    table.add_column("format")
    table.add_column("kept", justify="right")
    table.add_column("rejected (reason: count)")
    for s in m["sources"]:
        rejected = ", ".join(f"{r}: {n}" for r, n in s["rejected"].items()) or "-"
        table.add_row(esc(s["name"]), esc(s["format"]), f"{s['kept']:,}", rejected)
    console.print(table)
    tr, va = m["splits"]["train"], m["splits"]["val"]
    result_line(f"[green]Prepared[/green] {esc(out)}: train {tr['samples']:,} samples ({len(tr['shards'])} shard(s)), val {va['samples']:,} samples")
    ratio = (m.get("settings") or {}).get("val_ratio") or 0
    if not va["samples"] and not ratio:
        info("[yellow]The val split is empty[/yellow]: `vlmctl eval` and train.eval_steps have nothing to evaluate; "
             "set data.val_ratio above 0 (e.g. 0.05) and prepare again if you want them.")
    elif not va["samples"]:  # identical samples stay on one side of the split; one such group is train
        info(f"[yellow]The val split is empty[/yellow]: data.val_ratio={ratio:g} of these samples left none for val "
             "(identical samples stay together, in train when they are all there is); `vlmctl eval` and "
             "train.eval_steps have nothing to evaluate until the data holds more distinct samples.")
    if m["totals"]["rejected_total"]:
        info(f"Rejected {m['totals']['rejected_total']:,} samples: see {esc(out / 'rejected.jsonl')}")
    for reason, n in (m["totals"].get("flagged") or {}).items():
        info(f"[yellow]Kept {n:,} samples flagged {reason}[/yellow] (data.duplicate_ids: keep)")
    tokens = m.get("tokens")
    if tokens:
        info(
            f"Tokens per sample: p50 {tokens['p50']:,}, max {tokens['max']:,}; suggested max_length {tokens['suggested_max_length']:,}, "
            f"packing length {tokens['suggested_packing_length']:,}"
        )
        info(_longest_line(tokens))
    else:
        info(f"[dim]No token counts ({esc(token_note or 'no processor')}): too_long was not checked.[/dim]")
    info(f"Length histogram: {esc(out / 'length_histogram.png')}")
    if export_dir:
        info(f"Energon export: {esc(export_dir)}")
    debug(f"manifest: {esc(out / 'manifest.json')}; shards: " + esc(", ".join(tr["shards"] + va["shards"])))


def _longest_line(tokens: dict[str, Any]) -> str:
    """How many GPUs the longest kept sample needs, at the row budget's tokens per GPU (or the default one)."""
    gpus, at = tokens.get("gpus_needed"), tokens.get("gpus_needed_at")
    line = f"Longest sample: {tokens['max']:,} tokens, {gpus} GPU{'s' if gpus != 1 else ''}"
    sp = tokens.get("sequence_parallel")
    if sp is None:  # no row budget: counted at training's default tokens per GPU
        hint = f"; set train.sequence_parallel={gpus} for it" if gpus > 1 else ""
        return f"{line} at {at:,} tokens per GPU (train.tokens_per_batch: auto without a probe{hint})"
    line = f"{line} at train.tokens_per_batch={at}"
    if sp == 1:
        return line
    fewer = f"; train.sequence_parallel={gpus} would too" if gpus < sp else ""  # a smaller group leaves more data-parallel ranks
    return f"{line} (train.sequence_parallel={sp} holds it{fewer})"


@app.command("validate", epilog=VALIDATE_EXAMPLE)
def validate(
    args: Annotated[Optional[list[str]], typer.Argument(help="Source files/folders or a prepared dir (default: data.sources), then overrides.", show_default=False)] = None,
    config: ConfigOpt = None,
    image_root: Annotated[Optional[Path], typer.Option("--image-root", help="Folder that the files' relative image paths are relative to (default: each file's folder).")] = None,
    format: Annotated[str, typer.Option("--format", help=f"Format of the files given: {' | '.join(FORMATS)}.")] = "auto",
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="The data set of a LLaMA-Factory dataset_info.json given (default: its only one).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Check sources without writing anything; exit 1 when any sample would be rejected."""
    from typing import get_args

    from vlmctl.config.data import DataFormat

    if format not in get_args(DataFormat):
        raise typer.BadParameter(f"{format!r} is not one of: {', '.join(get_args(DataFormat))}", param_hint="'--format'")
    paths, overrides = split_args(args)
    if (image_root is not None or format != "auto" or dataset is not None) and not paths:
        from vlmctl.errors import UsageError

        raise UsageError("--image-root, --format and --dataset apply to files given on the command line",
                         hint="pass the files (`vlmctl data validate data/raw/train.json --image-root data/raw`), or set "
                         "data.sources[].image_root / format / dataset in vlmctl.yaml")
    cfg = _load_for_validate(config, overrides, standalone=bool(paths))
    from vlmctl.data.validate import validate_data

    report = validate_data(
        cfg.data,
        paths=paths or None,
        processor_dir=_processor_dir(cfg),
        progress=not (as_json or state.quiet),
        row_budget=_row_budget(cfg),
        image_root=image_root,
        format=format,
        dataset=dataset,
        max_examples=10 if state.verbose else 5,
    )
    if as_json:
        print_json(report.to_dict())
    else:
        _render_validate(report, cfg, given=bool(paths))
    if not report.ok:
        raise typer.Exit(1)


def _load_for_validate(config: Path | None, overrides: list[str], standalone: bool) -> "VlmctlConfig":
    """The project config; with explicit paths and no project file anywhere, the defaults (plus overrides)."""
    from vlmctl.config import find_config

    if standalone and config is None and state.config is None and find_config() is None:
        from vlmctl.config import apply_overrides, validate_config

        return validate_config(apply_overrides({}, overrides), base_dir=Path.cwd(), source="overrides")
    return load_project(config, overrides)


def _render_validate(report, cfg: "VlmctlConfig", given: bool = False) -> None:
    from rich.table import Table

    from vlmctl.data.counting import model_configured

    for reason, n in report.flagged.items():
        info(f"[yellow]{n:,} kept samples flagged {reason}[/yellow] (data.duplicate_ids: keep)")
    debug(f"checked {report.total:,} samples; token counts {'checked' if report.tokens_checked else 'not checked'}")
    if report.ok:
        result_line(f"[green]OK[/green]: {report.total:,} samples checked, none would be rejected.")
        if not report.tokens_checked:
            later = "; `vlmctl data prepare` checks it with the configured model" if model_configured(cfg.model) else ""
            info(f"[dim]too_long was not checked (no built model in model.output_dir{later}).[/dim]")
        return
    counts = report.to_dict()["counts"]
    summary = f"{report.rejected:,} of {report.total:,} samples would be rejected"
    if state.quiet:  # the result line alone
        result_line(f"{summary} ({', '.join(f'{reason} {n:,}' for reason, n in counts.items())})")
        return
    table = Table(title=summary, title_justify="left")
    table.add_column("reason")
    table.add_column("count", justify="right")
    table.add_column("first locations", overflow="fold")
    shown = 10 if state.verbose else 3  # -v: every location kept (up to 10 per reason)
    for reason, count in counts.items():
        where = "\n".join(f"{esc(e['location'])}: {esc(e['detail'])}" for e in report.examples.get(reason, [])[:shown])
        table.add_row(reason, f"{count:,}", where)
    console.print(table)
    info(f"Kept: {report.kept:,}. Fix the records above, or run `vlmctl data prepare` to drop them with these reasons.")
    if report.kept == 0 and counts.get("missing_image") == report.total:  # a wrong root, not missing files
        where = "--image-root FOLDER" if given else "data.sources[].image_root in vlmctl.yaml"
        info(f"[yellow]Every image is missing[/yellow]: the image paths are probably relative to another folder; "
             f"pass {where} (the folder they are relative to).")
