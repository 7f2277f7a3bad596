"""`vlmctl eval`: generate answers and score them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, load_project, split_args
from vlmctl.cli._stub import not_implemented

EXAMPLE = "Example: vlmctl eval --data val --task vqa --limit 200"


def eval_cmd(
    args: Annotated[Optional[list[str]], typer.Argument(help="MODEL folder (default: latest final export), then overrides.", show_default=False)] = None,
    config: ConfigOpt = None,
    data: Annotated[Optional[str], typer.Option("--data", help="val, or a data file in any supported format.")] = None,
    task: Annotated[Optional[str], typer.Option("--task", help="auto|vqa|docvqa|chartqa|mcq|caption|loss.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Samples per generation batch.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Tokens generated per answer.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Score at most N samples.")] = None,
    predictions: Annotated[Optional[Path], typer.Option("--predictions", help="Score an existing predictions JSONL; loads no model.")] = None,
    out: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output folder.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate answers on a validation set or benchmark file and compute VQA/ANLS/relaxed/MCQ/caption metrics."""
    _, overrides = split_args(args)
    if predictions is None:
        load_project(config, overrides)
    not_implemented("eval")
