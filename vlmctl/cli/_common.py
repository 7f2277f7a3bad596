"""Shared CLI pieces: global state, option aliases, config loading, rendering of results and errors.

Only light modules are imported here (typer, rich): `vlmctl --help` must not import torch.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console

if TYPE_CHECKING:
    from vlmctl.config import VlmctlConfig


@dataclass
class State:
    debug: bool = False
    quiet: bool = False
    verbose: bool = False
    config: Path | None = None  # -c given before the command: `vlmctl -c x.yaml train`


state = State(debug=os.environ.get("VLMCTL_DEBUG", "") not in ("", "0", "false"))
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="Project file (default: vlmctl.yaml here or in the nearest parent).", show_default=False),
]
OverridesArg = Annotated[
    Optional[list[str]],
    typer.Argument(help="Dotted overrides section.key=value, e.g. train.max_steps=50.", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON (for scripts).")]


def is_override(arg: str) -> bool:
    """True for `section.key=value` arguments (a dot before the first '=')."""
    key, sep, _ = arg.partition("=")
    return bool(sep) and "." in key and "/" not in key


def split_args(args: list[str] | None) -> tuple[list[str], list[str]]:
    """Split a command's trailing arguments into (positionals, overrides)."""
    positionals, overrides = [], []
    for arg in args or []:
        (overrides if is_override(arg) else positionals).append(arg)
    return positionals, overrides


def load_project(config: Path | None, overrides: list[str] | None) -> "VlmctlConfig":
    """Load the project file (discovered when `config` is None) with overrides applied."""
    from vlmctl.config import load_config

    bad = [o for o in overrides or [] if not is_override(o)]
    if bad:
        from vlmctl.errors import UsageError

        raise UsageError(f"unexpected argument {bad[0]!r}", hint="overrides look like section.key=value, e.g. train.max_steps=50")
    return load_config(config or state.config, overrides or [])


def info(message: str) -> None:
    """Print unless --quiet."""
    if not state.quiet:
        console.print(message)


def debug(message: str) -> None:
    """Print only with --verbose."""
    if state.verbose:
        console.print(f"[dim]{message}[/dim]")


def print_json(data: Any) -> None:
    """Machine-readable output on stdout (no rich markup)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def render_error(title: str, message: str, hint: str | None) -> None:
    from vlmctl.errors import panel

    err_console.print(panel(title, message, hint))
