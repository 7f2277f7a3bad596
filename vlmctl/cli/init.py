"""`vlmctl init`: scaffold a project from a template."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vlmctl.cli._common import JsonOpt, console, esc, info, print_json, result_line

EXAMPLE = "Example: vlmctl init my-vlm --template llava"


def init(
    folder: Annotated[Path, typer.Argument(help="Project folder to create (default: the current folder).")] = Path("."),
    template: Annotated[str, typer.Option("--template", "-t", help="tiny | llava | qwen2.5-vl-lora.")] = "tiny",
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Create vlmctl.yaml and a data/ folder from a template (tiny also generates its data set)."""
    from vlmctl.project import init_project

    with console.status(f"Creating {folder} from template {template}..."):
        result = init_project(folder, template=template, force=force)
    if as_json:
        print_json({"folder": str(result.folder), "template": template, "files": [str(f) for f in result.files]})
        return
    result_line(f"[green]Created[/green] {esc(result.folder)} from template [bold]{esc(template)}[/bold]:")
    for f in result.files:
        info(f"  {esc(f)}")
    info("\nNext:")
    prefix = "" if result.folder.resolve() == Path.cwd().resolve() else f"cd {result.folder} && "
    for i, cmd in enumerate(result.next_commands):
        info(f"  {prefix if i == 0 and not cmd.startswith('#') else ''}{esc(cmd)}")
