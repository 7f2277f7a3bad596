"""`vlmctl init`: scaffold a project from a template."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmctl.cli._common import JsonOpt, console, err_console, esc, info, print_json, result_line

# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.

EXAMPLE = "Example: vlmctl init my-vlm --template llava"


def init(
    folder: Annotated[Path, typer.Argument(help="Project folder to create (default: the current folder).")] = Path("."),
    template: Annotated[Optional[str], typer.Option("--template", "-t", help="tiny (the default) | llava | qwen2.5-vl-lora.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Create vlmctl.yaml and a data/ folder from a template (tiny also generates its data set)."""
    from vlmctl.project import available_templates, init_project

    named = template
    template = template or "tiny"
    with console.status(f"Creating {esc(folder)} from template {esc(template)}..."):
        result = init_project(folder, template=template, force=force)
    if named is None and folder.name in available_templates() and folder.name != template:
        # `vlmctl init llava` reads as "a llava project" but made a tiny project in a folder named llava
        err_console.print(f"[yellow]warning[/yellow]: {esc(folder)} is a folder name here, and the project in it is "
                          f"from the tiny template; for the {esc(folder.name)} template run `vlmctl init FOLDER "
                          f"--template {esc(folder.name)}`", soft_wrap=True)
    if as_json:
        print_json({"folder": str(result.folder), "template": template, "files": [str(f) for f in result.files]})
        return
    result_line(f"[green]Created[/green] {esc(result.folder)} from template [bold]{esc(template)}[/bold]")
    for f in result.files:
        info(f"  {esc(f)}")
    info("\nNext:")
    prefix = "" if result.folder.resolve() == Path.cwd().resolve() else f"cd {result.folder} && "
    for i, cmd in enumerate(result.next_commands):
        info(f"  {prefix if i == 0 and not cmd.startswith('#') else ''}{esc(cmd)}")
