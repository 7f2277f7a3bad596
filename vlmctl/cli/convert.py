"""`vlmctl convert`: any checkpoint -> a complete, verified HF folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmctl.cli._stub import not_implemented

EXAMPLE = "Example: vlmctl convert outputs/runs/my-run/checkpoint-500 -o exports/my-model --dtype bf16"


def convert(
    src: Annotated[Path, typer.Argument(help="Run folder, DCP or ZeRO checkpoint, LoRA adapter folder, or HF folder.")],
    out: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output folder.")] = None,
    to: Annotated[str, typer.Option("--to", help="Target format.")] = "hf",
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="bf16 | fp16 | fp32.")] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard.")] = "5GB",
    merge_lora: Annotated[bool, typer.Option("--merge-lora/--no-merge-lora", help="Merge LoRA adapters into the weights.")] = True,
    adapter_only: Annotated[bool, typer.Option("--adapter-only", help="Export only the peft adapter.")] = False,
    base: Annotated[Optional[str], typer.Option("--base", help="Base model of a LoRA adapter folder.")] = None,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Reload and compare logits with the source.")] = True,
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT.")] = False,
) -> None:
    """Turn a checkpoint into a complete Hugging Face model folder and verify its logits."""
    not_implemented("convert")
