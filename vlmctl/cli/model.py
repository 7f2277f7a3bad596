"""`vlmctl model build`."""

from __future__ import annotations

from typing import Annotated

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, OverridesArg, load_project
from vlmctl.cli._stub import not_implemented

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
    load_project(config, overrides)
    not_implemented("model build")
