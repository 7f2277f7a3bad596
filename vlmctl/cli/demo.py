"""`vlmctl demo`: scaffold the tiny project and run prepare -> build -> train -> eval on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vlmctl.cli._stub import not_implemented

EXAMPLE = "Example: vlmctl demo my-demo"


def demo(
    folder: Annotated[Path, typer.Argument(help="Where the demo project is created.")] = Path("vlmctl-demo"),
    force: Annotated[bool, typer.Option("--force", help="Reuse an existing demo folder.")] = False,
) -> None:
    """Run the whole pipeline on a generated shapes VQA set (CPU, no downloads) and show that the model learns."""
    not_implemented("demo")
