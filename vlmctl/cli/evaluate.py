"""`vlmctl eval`: generate answers and score them."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, console, esc, info, load_project, print_json, result_line, split_args, state

# The vlmctl modules that load numpy when imported are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for it.
# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

EXAMPLE = "Example: vlmctl eval --data val --task vqa --limit 200"


def eval_cmd(
    args: Annotated[Optional[list[str]], typer.Argument(help="MODEL folder (default: the best checkpoint of the project's longest-trained run, else that run's final export, else the built model; the choice is printed), then overrides.", show_default=False)] = None,
    config: ConfigOpt = None,
    data: Annotated[Optional[str], typer.Option("--data", help="val, or a data file in any supported format.")] = None,
    task: Annotated[Optional[str], typer.Option("--task", help="auto|vqa|docvqa|chartqa|mcq|caption|asr|loss.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Samples per generation batch.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Tokens generated per answer.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Score at most N samples.")] = None,
    predictions: Annotated[Optional[Path], typer.Option("--predictions", help="Score an existing predictions JSONL; loads no model.")] = None,
    out: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output folder (default: a new folder under eval.output_dir named after the model, task and data).")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="hf, or vllm when installed.")] = None,
    lmms_eval: Annotated[Optional[str], typer.Option("--lmms-eval", help="Comma-separated lmms-eval tasks to run on MODEL (when lmms-eval is installed).")] = None,
    lmms_include: Annotated[Optional[Path], typer.Option("--lmms-eval-include", help="Folder of custom lmms-eval task YAMLs (lmms-eval's --include_path).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing -o folder of an earlier evaluation.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Generate answers on a validation set or benchmark file and compute VQA/ANLS/relaxed/MCQ/caption metrics."""
    from vlmctl import evaluation
    from vlmctl.errors import UsageError
    from vlmctl.inference import check_model_dir
    from vlmctl.outputs import check_fresh, fresh_folder, local_paths

    positionals, overrides = split_args(args)
    if len(positionals) > 1:
        raise UsageError(f"unexpected argument {positionals[1]!r}", hint="give at most one MODEL folder, then section.key=value overrides")
    if limit is not None and limit <= 0:
        raise UsageError("--limit must be positive", hint="e.g. --limit 200")

    rank0 = int(os.environ.get("RANK", 0)) == 0
    if predictions is not None:
        if out is None:
            result = evaluation.score_predictions_file(predictions, task=task or "auto",
                                                       out_dir=_predictions_out_dir(predictions, config, overrides), limit=limit)
        else:
            with fresh_folder(out, "eval", inputs=[predictions], force=force) as out_dir:
                result = evaluation.score_predictions_file(predictions, task=task or "auto", out_dir=out_dir, limit=limit)
        _render(result, as_json)
        return

    cfg = load_project(config, overrides)
    ev = cfg.eval
    from vlmctl.evaluation.runner import preflight

    preflight(backend=None if lmms_eval else (backend or ev.backend), lmms_eval=bool(lmms_eval))  # before loading anything
    if positionals:
        model_dir = Path(positionals[0]).expanduser().resolve()
    else:
        from vlmctl.cli.chat import project_model_dir

        model_dir = project_model_dir(cfg.train.output_dir, cfg.model.output_dir)
    # a run's final/ or export-<step> is labelled by its run
    label = model_dir.parent.name if model_dir.name == "final" else model_dir.name
    if model_dir.name.startswith("export-") and (model_dir.parent / "final").is_dir():
        label = f"{model_dir.parent.name}-{model_dir.name.removeprefix('export-')}"

    if lmms_include is not None and not lmms_eval:
        raise UsageError("--lmms-eval-include needs --lmms-eval", hint="name the tasks to run: --lmms-eval TASK[,TASK...]")
    if lmms_eval:
        from vlmctl.evaluation.lmms import run_lmms_eval

        check_model_dir(model_dir)
        if lmms_include is not None and not lmms_include.is_dir():
            raise UsageError(f"--lmms-eval-include {lmms_include}: no such folder", hint="pass the folder that holds the task YAML files")
        out_dir = out or ev.output_dir / f"{label}-lmms-eval"
        if out is not None:  # scores are merged into an earlier lmms-eval folder: refuse only a folder that holds an input
            check_fresh(out, "eval", inputs=[model_dir], force=True)
        notes: list[str] = []
        # lmms-eval's own default batch of 1, not eval.batch_size: most of its adapters refuse more (e.g. llava_hf).
        scores = run_lmms_eval(model_dir, lmms_eval, out_dir, batch_size=batch_size or 1, dtype=ev.dtype,
                               include_path=lmms_include.resolve() if lmms_include else None, limit=limit,
                               echo=not state.quiet, notes=notes)
        for note in notes if not as_json else ():
            info(f"[yellow]{esc(note)}[/yellow]")
        result = evaluation.fold_into_metrics(out_dir, scores, model=str(model_dir), data=f"lmms-eval:{lmms_eval}")
        _render(result, as_json)
        return

    check_model_dir(model_dir)  # fail before reading data
    data_name = data or ev.data
    inputs = [model_dir, *(local_paths(cfg.data.prepared_dir) if data_name == "val" else local_paths(data_name))]
    if out is not None and rank0:
        check_fresh(out, "eval", inputs=inputs, force=force)
    samples = evaluation.load_samples(data_name, cfg.data.prepared_dir, limit or ev.limit, media_roots=cfg.data.media_roots,
                                      video=cfg.data.video, audio=cfg.data.audio)
    task_name = evaluation.resolve_task(task or ev.task, samples)
    # Only rank 0 writes: it alone reserves a new folder; the other ranks never touch theirs.
    created = out is None and rank0
    out_dir = out or evaluation.default_output_dir(ev.output_dir, label, task_name, data_name, create=rank0)
    if not as_json and rank0:
        if samples.skipped:
            info(f"[yellow]{_skipped_line(samples)}[/yellow]")
        info(f"Evaluating [bold]{esc(model_dir)}[/bold] on {len(samples)} samples ({esc(data_name)}, task {task_name})")
    claim = fresh_folder(out, "eval", inputs=inputs, force=force) if out is not None and rank0 else contextlib.nullcontext()
    try:
        with claim, _progress(len(samples), enabled=not as_json) as progress:
            result = evaluation.run_eval(
                model_dir, samples, task=task_name, data_name=data_name, out_dir=out_dir,
                batch_size=batch_size or ev.batch_size, max_new_tokens=max_new_tokens or ev.max_new_tokens,
                backend=backend or ev.backend, dtype=ev.dtype, progress=progress,
            )
    except BaseException:
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # the folder reserved for this evaluation: leave nothing empty behind
        raise
    if result is not None:  # rank 0 only under torchrun
        _render(result, as_json)


def _skipped_line(samples) -> str:
    from vlmctl.evaluation.results import skipped_reasons

    n = len(samples.skipped)
    counts = ", ".join(f"{reason} {count}" for reason, count in skipped_reasons(samples.skipped).items())
    return (f"Skipped {n} of {n + len(samples)} samples that cannot be evaluated ({counts}); they are listed in "
            "skipped.jsonl and report.html")


def _predictions_out_dir(predictions: Path, config: Path | None, overrides: list[str]) -> Path:
    """eval.output_dir/<file stem>-scored inside a project, else a folder next to the predictions file; `-2`, `-3`,
    ... when it exists (an earlier scoring is never overwritten)."""
    from vlmctl.config import find_config
    from vlmctl.evaluation.runner import unique_output_dir

    if config is not None or state.config is not None or find_config() is not None:
        return unique_output_dir(load_project(config, overrides).eval.output_dir / f"{predictions.stem}-scored", create=False)
    return unique_output_dir(predictions.with_name(f"{predictions.stem}-scored"), create=False)


class _progress:
    """A rich progress bar over samples (hidden with --quiet, --json, and on ranks other than 0)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total = total
        self.enabled = enabled and not state.quiet and int(os.environ.get("RANK", 0)) == 0
        self.bar = None

    def __enter__(self):
        if not self.enabled or not console.is_terminal:  # piped or logged: a bar would leave its last frame
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console, transient=True)
        self.bar.start()
        task = self.bar.add_task("eval", total=self.total)
        return lambda done, total: self.bar.update(task, completed=done, total=total)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def _render(result, as_json: bool) -> None:
    summary = result.summary()
    if as_json:
        print_json({**summary, "output_dir": str(result.out_dir) if result.out_dir else None})
        return
    from rich.table import Table

    table = Table(title=f"{summary['task']} · {summary['n']} samples · {Path(str(summary['data'])).name}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in summary["metrics"].items():
        table.add_row(esc(name), f"{value:.4f}")
    console.print(table)
    skipped = summary.get("skipped")
    if skipped:
        counts = ", ".join(f"{reason} {count}" for reason, count in skipped["reasons"].items())
        info(f"[yellow]{skipped['count']} samples skipped[/yellow] ({counts}): not in these metrics")
    if result.out_dir is not None:
        # what is there: an lmms-eval run writes metrics.json and lmms_eval/, no predictions or report
        folder = Path(result.out_dir)
        names = ["metrics.json", *(n for n in ("predictions.jsonl", "report.html") if (folder / n).is_file()),
                 *(["skipped.jsonl"] if skipped else []), *(["lmms_eval/"] if (folder / "lmms_eval").is_dir() else [])]
        result_line(f"Wrote {esc(result.out_dir)}/ ({esc(', '.join(names))})")
