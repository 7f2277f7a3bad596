"""`vlmctl bench`: measure training throughput (tokens/s, MFU, memory) on synthetic or prepared data."""

from __future__ import annotations

from typing import Annotated

import typer

from vlmctl.cli._common import ConfigOpt, JsonOpt, OverridesArg, load_project
from vlmctl.cli._stub import not_implemented

EXAMPLE = "Example: vlmctl bench --steps 20 model.preset=qwen2.5-vl-3b model.init=random"


def bench(
    config: ConfigOpt = None,
    overrides: OverridesArg = None,
    steps: Annotated[int, typer.Option("--steps", help="Measured training steps (after warmup).")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Run N training steps and report tokens/s (text and visual), MFU with ViT FLOPs, step time, peak memory."""
    load_project(config, overrides)
    not_implemented("bench")
