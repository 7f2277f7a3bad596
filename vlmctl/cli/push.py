"""`vlmctl push`: upload a model folder to the Hub with a generated model card."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmctl.cli._common import ConfigOpt
from vlmctl.cli._stub import not_implemented

EXAMPLE = "Example: vlmctl push outputs/runs/my-run/final --repo-id my-org/my-vlm --dry-run"


def push(
    folder: Annotated[Optional[Path], typer.Argument(help="Model folder (default: the latest run's final export).")] = None,
    config: ConfigOpt = None,
    repo_id: Annotated[Optional[str], typer.Option("--repo-id", help="ORG/NAME (default: hub.repo_id).")] = None,
    private: Annotated[Optional[bool], typer.Option("--private/--public", help="Repository visibility (default: hub.private).")] = None,
    revision: Annotated[Optional[str], typer.Option("--revision", help="Branch to push to.")] = None,
    commit_message: Annotated[Optional[str], typer.Option("--commit-message", help="Commit message.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show files and model card; upload nothing.")] = False,
) -> None:
    """Upload a model folder to the Hugging Face Hub with a model card."""
    not_implemented("push")
