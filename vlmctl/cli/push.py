"""`vlmctl push`: upload a model folder to the Hub with a generated model card."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, console, esc, info, load_project, print_json, result_line, split_args, state

# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

EXAMPLE = "Example: vlmctl push outputs/runs/my-run/final --repo-id my-org/my-vlm --dry-run hub.license=mit"


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _load_config(config: Path | None, overrides: list[str]):
    """The project file with overrides; without one anywhere, the defaults of every section plus the overrides
    (a folder can be pushed from outside a project)."""
    from vlmctl.config import apply_overrides, find_config, validate_config

    if config is None and state.config is None and find_config() is None:
        return validate_config(apply_overrides({}, overrides), base_dir=Path.cwd(), source="overrides")
    return load_project(config, overrides)


def push(
    args: Annotated[Optional[list[str]], typer.Argument(help="Model folder (default: the trained model chat and eval use, the best checkpoint of the longest-trained run or its final export), then overrides such as hub.license=mit.", show_default=False)] = None,
    config: ConfigOpt = None,
    repo_id: Annotated[Optional[str], typer.Option("--repo-id", help="ORG/NAME (default: hub.repo_id).")] = None,
    private: Annotated[Optional[bool], typer.Option("--private/--public", help="Repository visibility (default: hub.private).")] = None,
    revision: Annotated[Optional[str], typer.Option("--revision", help="Branch to push to.")] = None,
    commit_message: Annotated[Optional[str], typer.Option("--commit-message", help="Commit message.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show files and model card; upload nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Upload a model folder to the Hugging Face Hub with a model card."""
    from rich.table import Table

    from vlmctl.errors import UsageError
    from vlmctl.hub import push_folder

    positionals, overrides = split_args(args)
    if len(positionals) > 1:
        raise UsageError(f"unexpected argument {positionals[1]!r}", hint="give at most one model FOLDER, then section.key=value overrides")
    folder = Path(positionals[0]) if positionals else None
    cfg = _load_config(config, overrides)
    if folder is None:  # the model chat, generate, eval and serve default to, when it is a trained one
        from vlmctl.cli.chat import project_model_dir
        from vlmctl.runs import finished_runs

        if not finished_runs(cfg.train.output_dir):
            raise UsageError(f"no run with a final export under {cfg.train.output_dir}", hint="pass the model folder: vlmctl push FOLDER --repo-id ORG/NAME")
        folder = project_model_dir(cfg.train.output_dir, cfg.model.output_dir)
    eval_dir = cfg.eval.output_dir

    if dry_run:
        result = push_folder(folder, hub=cfg.hub, repo_id=repo_id, private=private, revision=revision, commit_message=commit_message, dry_run=True, eval_dir=eval_dir)
    else:
        with console.status(f"Uploading {folder} to {repo_id or cfg.hub.repo_id} ...", spinner="dots"):
            result = push_folder(folder, hub=cfg.hub, repo_id=repo_id, private=private, revision=revision, commit_message=commit_message, eval_dir=eval_dir)
    if as_json:
        print_json(result.to_dict())
        return

    table = Table(title=f"{'Would upload' if dry_run else 'Uploaded'} to {result.repo_id}", title_justify="left")
    table.add_column("file")
    table.add_column("size", justify="right")
    for f in result.files:
        note = " (generated)" if f.path == "README.md" and result.card_generated else (f" (link to {esc(f.link_to)})" if f.link_to else "")
        table.add_row(esc(f.path) + note, _human(f.size))
    table.add_row("[bold]total[/bold]", f"[bold]{_human(result.total_bytes)}[/bold]")
    console.print(table)
    if dry_run:
        console.rule("README.md" + (" (generated)" if result.card_generated else ""))
        console.print(result.card, markup=False, highlight=False)
        console.rule()
        info("[dim]dry run: nothing was uploaded[/dim]")
    else:
        result_line(f"[green]Pushed[/green] {len(result.files)} files ({_human(result.total_bytes)}) to {esc(result.url)}" + (f" @ {result.commit[:10]}" if result.commit else ""))
