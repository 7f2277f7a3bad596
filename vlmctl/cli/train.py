"""`vlmctl train`: resolve the project, build the launcher command, spawn it."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vlmctl.cli._common import ConfigOpt, OverridesArg, console, err_console, esc, info, load_project, result_line, state

# The vlmctl modules that load numpy when imported are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for it.
# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

EXAMPLE = "Example: vlmctl train --launcher torchrun --nproc-per-node 2 train.strategy=fsdp train.max_steps=50"


def train(
    config: ConfigOpt = None,
    overrides: OverridesArg = None,
    launcher: Annotated[Optional[str], typer.Option("--launcher", help="torchrun | accelerate | slurm | none (default: train.launcher).")] = None,
    strategy: Annotated[Optional[str], typer.Option("--strategy", help="ddp | fsdp | zero2 | zero3 (default: train.strategy).")] = None,
    nproc_per_node: Annotated[Optional[str], typer.Option("--nproc-per-node", help="Processes per node, or auto.")] = None,
    nnodes: Annotated[Optional[int], typer.Option("--nnodes", help="Number of nodes (torchrun/accelerate: run vlmctl train on each, with its --node-rank).")] = None,
    node_rank: Annotated[Optional[int], typer.Option("--node-rank", help="Rank of this node; node 0 owns the run folder.")] = None,
    master_addr: Annotated[Optional[str], typer.Option("--master-addr", help="Rendezvous host: node 0's address.")] = None,
    master_port: Annotated[Optional[int], typer.Option("--master-port", help="Rendezvous port.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last complete checkpoint.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the run plan (every auto decided, with the reason) and the exact launch commands (every node's, or the sbatch script), and exit.")] = False,
    rebuild_model: Annotated[bool, typer.Option("--rebuild-model", help="Build model.output_dir again first when a model.* key changed since `vlmctl model build`.")] = False,
) -> None:
    """Train the model: spawn torchrun/accelerate/sbatch (or run in-process) for DDP, FSDP2 or ZeRO-2/3.

    Settings are config keys, given as overrides after the options: train.max_steps, train.num_epochs,
    train.learning_rate, train.strategy, train.tokens_per_batch (packed rows) or train.micro_batch_size,
    train.eval_steps, train.save_steps, train.objective (sft, dpo, grpo), train.lora.r. Every key with its
    meaning: `vlmctl config show` and docs/config.md.

    Several nodes: start it on every node with the same train.run_name and --master-addr and the node's --node-rank
    (the run folder on a shared filesystem), or once with --launcher slurm."""
    from vlmctl.train import launch as L

    cfg = load_project(config, overrides)
    flags = {"launcher": launcher, "strategy": strategy, "nnodes": nnodes, "node_rank": node_rank,
             "master_addr": master_addr, "master_port": master_port}
    extra = [f"train.{k}={v}" for k, v in flags.items() if v is not None]
    if nproc_per_node is not None:
        extra.append(f"train.nproc_per_node={nproc_per_node}")
    if extra:
        cfg = load_project(config, [*(overrides or []), *extra])
    train_cfg = cfg.train
    if dry_run:  # the run folder the real command would use (the one --resume continues)
        from vlmctl.config.plan import plan_text

        text = L.dry_run_text(train_cfg, L.planned_run_dir(cfg, resume))
        L.preflight(cfg)  # what would stop the run before it starts stops the dry run too (data, model, packages)
        # the plan on stderr, as the run prints it: stdout stays the commands alone (scripts run them)
        err_console.print(plan_text(L.launch_plan(cfg)), soft_wrap=True, markup=False, highlight=False)
        console.print(text, soft_wrap=True, markup=False, highlight=False)
        return
    from vlmctl.train.rundir import release_run

    if rebuild_model:
        from vlmctl.models.build import rebuild_if_changed

        prepared = cfg.data.prepared_dir if (cfg.data.prepared_dir / "train").is_dir() else None
        if rebuild_if_changed(cfg.model, prepared_dir=prepared, seed=cfg.project.seed) is not None:
            info(f"rebuilt {esc(cfg.model.output_dir)} with the changed model settings")
    fresh = not resume and train_cfg.resume is None
    if fresh and not train_cfg.run_name and (left := L.interrupted_run(cfg)) is not None:
        from vlmctl.train.checkpoint import resume_command

        info(f"[yellow]note[/yellow]: the run {esc(left[0].name)} stopped at step {left[1]} without finishing; this "
             f"starts a new run. Continue that one instead with `{esc(resume_command(left[0]))}`.")
    run_dir = L.prepare_run(cfg, resume=resume)
    if not L.joins_run(train_cfg):  # what the resume hints repeat
        from vlmctl.train.checkpoint import record_command

        given = config or state.config
        record_command(run_dir, [*(["-c", str(given)] if given else []),
                                 *(a for k, v in flags.items() if v is not None for a in (f"--{k.replace('_', '-')}", str(v))),
                                 *(["--nproc-per-node", nproc_per_node] if nproc_per_node is not None else []), *(overrides or [])])
    started = False
    try:
        _run(train_cfg, run_dir)
        started = True
    finally:
        release_run(run_dir)
        if fresh and not started:
            L.discard_unstarted(run_dir)


def _run(train_cfg, run_dir) -> None:
    """Launch the prepared run and report how it ended: one line after a signal (exit 128 + signal), nothing more
    when the ranks reported their own failure (exit 1 or 2), a panel otherwise."""
    from vlmctl.train import launch as L

    info(f"run folder: {esc(run_dir)}")
    if train_cfg.launcher == "none":
        import signal

        outcome = L.run_in_process(run_dir)
        if outcome != "done":
            signum = signal.SIGINT if outcome == "interrupted" else signal.SIGTERM
            _stopped(run_dir, signum)
            raise typer.Exit(code=128 + signum)
        return
    launch = L.launch_command(train_cfg, run_dir)
    if train_cfg.launcher == "slurm":
        submitted, text = L.submit_slurm(launch)
        info(text if submitted else f"sbatch is not available here; submit the script with: sbatch {esc(text)}")
        return
    info(f"[dim]{esc(launch.render())}[/dim]")
    code, signum = L.spawn(launch.command, env=L.launch_env(train_cfg), log_path=run_dir / L.log_name(train_cfg))
    if signum is not None:
        _stopped(run_dir, signum)
        raise typer.Exit(code=128 + signum)
    if code in (1, 2):  # the ranks printed their panel (or traceback) already
        raise typer.Exit(code=code)
    if code != 0:
        from vlmctl.errors import VlmctlError

        raise VlmctlError(f"training failed (exit code {code})", hint=f"see the output above; the run folder is {run_dir}")
    result_line(f"done: {esc(run_dir / 'final')}")


def _stopped(run_dir, signum: int) -> None:
    """The one line of a run stopped by SIGTERM/SIGINT: where its last checkpoint is and how to continue (the
    command with the run's own command-line settings, `checkpoint.resume_command`)."""
    import signal

    from vlmctl.train.checkpoint import latest_checkpoint, resume_command

    last = latest_checkpoint(run_dir)
    where = f"last checkpoint: {esc(last)}" if last is not None else "no checkpoint was written"
    console.print(f"[yellow]stopped by signal {signum} ({signal.Signals(signum).name}); {where}. "
                  f"Continue with `{esc(resume_command(run_dir))}`[/yellow]", soft_wrap=True)
