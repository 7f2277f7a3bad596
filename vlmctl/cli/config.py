"""`vlmctl config show`: print the resolved project file."""

from __future__ import annotations

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, OverridesArg, console, esc, load_project, print_json

# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

app = typer.Typer(help="Inspect the project file.", no_args_is_help=True)

EXAMPLE = "Example: vlmctl config show train.max_steps=50"


@app.command("show", epilog=EXAMPLE)
def show(config: ConfigOpt = None, overrides: OverridesArg = None, as_json: JsonOpt = False) -> None:
    """Print the resolved project file: defaults filled, overrides applied, paths absolute."""
    from vlmctl.config import dump_config

    cfg = load_project(config, overrides)
    if as_json:
        print_json(cfg.model_dump(mode="json"))
        return
    from rich.syntax import Syntax

    console.print(f"[dim]# {esc(cfg.path)}[/dim]")
    console.print(Syntax(dump_config(cfg), "yaml", theme="ansi_dark", background_color="default"))
