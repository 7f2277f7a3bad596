"""`vlmctl convert`: any checkpoint -> a complete, verified HF folder (or, `--to megatron`, a Megatron checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmctl.cli._common import JsonOpt, console, esc, info, print_json, result_line, state

# transformers is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for
# it.
# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

EXAMPLE = ("Example: vlmctl convert outputs/runs/my-run/checkpoint-500 -o exports/my-model --dtype bf16  "
           "(Megatron: vlmctl convert --from megatron ckpts/llava --base hf/llava-qwen2 -o exports/llava-hf; "
           "vlmctl convert exports/my-model --to megatron --tensor-parallel 2 -o ckpts/my-model-megatron)")


def convert(
    src: Annotated[Path, typer.Argument(help="Run folder, DCP or ZeRO checkpoint, LoRA adapter folder, HF folder, or Megatron checkpoint.")],
    out: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output folder (default: RUN/export-<step> for a run's checkpoint, SRC-hf (SRC-megatron with --to megatron) next to any other source).", show_default=False)] = None,
    to: Annotated[str, typer.Option("--to", help="Target format: hf | megatron (torch_dist).")] = "hf",
    from_: Annotated[Optional[str], typer.Option("--from", help="Source format: megatron (detected when left out).")] = None,
    tensor_parallel: Annotated[Optional[int], typer.Option("--tensor-parallel", help="--to megatron: the tensor-parallel size the export must divide (pads the vocabulary).")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="bf16 | fp16 | fp32.")] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard.")] = "5GB",
    merge_lora: Annotated[bool, typer.Option("--merge-lora/--no-merge-lora", help="Merge LoRA adapters into the weights.")] = True,
    adapter_only: Annotated[bool, typer.Option("--adapter-only", help="Export only the peft adapter.")] = False,
    base: Annotated[Optional[str], typer.Option("--base", help="Base model of a LoRA adapter folder; the HF folder (config + processor) of a Megatron checkpoint.")] = None,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Reload and compare logits with the source.")] = True,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT when an earlier conversion wrote it (never a folder of other files or one holding the source).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Turn a checkpoint (vlmctl's, an HF folder, or Megatron's) into a complete Hugging Face model folder, or with
    --to megatron into a Megatron torch_dist checkpoint, and verify its logits."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from transformers.utils import logging as hf_logging

    from vlmctl.convert import convert as run_convert

    if not state.verbose:  # our own progress display replaces the per-file loading/saving bars
        hf_logging.disable_progress_bar()

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True,
                  disable=state.quiet or as_json or not console.is_terminal) as bar:
        task = bar.add_task("converting", total=None)

        def progress(message: str) -> None:
            bar.update(task, description=message)
            if state.verbose:
                console.print(f"[dim]{esc(message)}[/dim]")

        result = run_convert(
            src, out, to=to, from_=from_, tensor_parallel=tensor_parallel, dtype=dtype, max_shard_size=max_shard_size, merge_lora=merge_lora, adapter_only=adapter_only,
            base=base, verify=verify, force=force, progress=progress,
        )
    if as_json:
        print_json(result.to_dict())
        return
    table = Table(title=f"{result.out}", title_justify="left")
    table.add_column("file")
    table.add_column("bytes", justify="right")
    for name, size in result.files:
        table.add_row(esc(name), f"{size:,}")
    if not state.quiet:
        console.print(table)
    what = "LoRA adapter" if result.adapter_only else ("merged LoRA model" if result.merged_lora else "model")
    if to == "megatron":
        what = "Megatron torch_dist checkpoint"
    result_line(f"[green]Converted[/green] {result.kind} {esc(result.source)} -> {esc(what)} at {esc(result.out)} ({result.dtype})")
    for note in result.notes:
        info(f"[yellow]Note[/yellow]: {esc(note)}")
    v = result.verify
    if v is not None:
        info(f"[green]Verified[/green]: max |logit difference| {v.max_abs_diff:.3g} over {v.num_logits:,} logits (tolerance {v.tolerance:.3g})")
    else:
        info("[yellow]Not verified[/yellow] (--no-verify)")
