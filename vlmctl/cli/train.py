"""`vlmctl train`: resolve the project, build the launcher command, spawn it."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vlmctl.cli._common import ConfigOpt, OverridesArg, load_project
from vlmctl.cli._stub import not_implemented

EXAMPLE = "Example: vlmctl train --launcher torchrun --nproc-per-node 2 train.strategy=fsdp train.max_steps=50"


def train(
    config: ConfigOpt = None,
    overrides: OverridesArg = None,
    launcher: Annotated[Optional[str], typer.Option("--launcher", help="torchrun | accelerate | slurm | none (default: train.launcher).")] = None,
    strategy: Annotated[Optional[str], typer.Option("--strategy", help="ddp | fsdp | zero2 | zero3 (default: train.strategy).")] = None,
    nproc_per_node: Annotated[Optional[str], typer.Option("--nproc-per-node", help="Processes per node, or auto.")] = None,
    nnodes: Annotated[Optional[int], typer.Option("--nnodes", help="Number of nodes.")] = None,
    node_rank: Annotated[Optional[int], typer.Option("--node-rank", help="Rank of this node.")] = None,
    master_addr: Annotated[Optional[str], typer.Option("--master-addr", help="Rendezvous host.")] = None,
    master_port: Annotated[Optional[int], typer.Option("--master-port", help="Rendezvous port.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last complete checkpoint.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the exact launch command and exit.")] = False,
) -> None:
    """Train the model: spawn torchrun/accelerate/sbatch (or run in-process) for DDP, FSDP2 or ZeRO-2/3."""
    load_project(config, overrides)
    not_implemented("train")
