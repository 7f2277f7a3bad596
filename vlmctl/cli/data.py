"""`vlmctl data prepare` and `vlmctl data validate`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, OverridesArg, load_project, split_args
from vlmctl.cli._stub import not_implemented

app = typer.Typer(help="Prepare and validate training data.", no_args_is_help=True)

PREPARE_EXAMPLE = "Example: vlmctl data prepare data.val_ratio=0.02 --num-proc 8"
VALIDATE_EXAMPLE = "Example: vlmctl data validate data/raw/train.json --json"


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
    load_project(config, overrides)
    not_implemented("data prepare")


@app.command("validate", epilog=VALIDATE_EXAMPLE)
def validate(
    args: Annotated[Optional[list[str]], typer.Argument(help="Source files/folders or a prepared dir (default: data.sources), then overrides.", show_default=False)] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check sources without writing anything; exit 1 when any sample would be rejected."""
    _, overrides = split_args(args)
    load_project(config, overrides)
    not_implemented("data validate")
