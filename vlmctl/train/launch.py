"""The launcher side of `vlmctl train`: prepare the run folder, build the launch command, spawn it.

    run_dir = prepare_run(cfg, resume=False)          # <train.output_dir>/<run name>/config.yaml + plan.json, locked
    cmd = launch_command(cfg.train, run_dir)          # torchrun / accelerate / sbatch line, a free rendezvous port
    code = spawn(cmd)                                 # streams output, passes SIGTERM/SIGINT to the ranks

Every launcher runs the same worker module (`python -m vlmctl.train.worker RUN_DIR`); the worker decides the
strategy from the config, so accelerate is only a process spawner here. torchrun and accelerate run through
`vlmctl.distributed.torchrun` / `.accelerate`, which die with this process and exit with the ranks' code when
they fail (`vlmctl.distributed.process`). Run folders are unique and locked while in use (`train.rundir`).

Several nodes (`train.nnodes` > 1, torchrun or accelerate): every node runs `vlmctl train` with the same project,
the same `train.run_name` and rendezvous (`train.master_addr:master_port`, node 0's address) and its own
`train.node_rank`. The run folder lies on a filesystem every node sees. Node 0 claims and locks it and writes
config.yaml; the other nodes only check their packages, data and model and start their agent: their ranks read
node 0's config.yaml once torchrun's c10d rendezvous has completed, which needs node 0's agent, started after
config.yaml was written. Each node's launcher copies its ranks' output into its own log (`log_name`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmctl.distributed.engine import is_deepspeed, is_fsdp
from vlmctl.distributed.mesh import SHARDING_ENV
from vlmctl.errors import ConfigError, UsageError

# pyarrow and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not
# pay for them.
# So are the vlmctl modules that load numpy when imported.
# rich is imported inside the functions that print: using vlmctl as a library does not load it.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

WORKER_MODULE = "vlmctl.train.worker"
TRAIN_LOG = "train.log"  # the ranks' combined output, in every run folder
AGENTS = ("torchrun", "accelerate")  # the launchers that start one process agent per node from this command


def launch_plan(cfg, *, processes: int | None = None):
    """The run's plan (`config.plan.build_plan`) as the launcher sees it: this machine's device (SLURM: the
    nodes' GPUs, assumed), the run's processes in all (`processes`, default `run_processes`), the model's family
    where the built model folder names it (else the ranks learn it when they load the model) and the packed row
    length `vlmctl data prepare` suggested for the prepared data (`config.plan.prepared_row_tokens`)."""
    from dataclasses import replace

    from vlmctl.config.plan import DeviceFacts, build_plan, prepared_row_tokens, run_processes

    train = cfg.train
    facts = DeviceFacts.here(cuda=True if train.launcher == "slurm" else None)
    facts = replace(facts, processes=run_processes(train, facts.gpus) if processes is None else processes)
    data = getattr(cfg, "data", None)
    data_tokens = prepared_row_tokens(data.prepared_dir) if data is not None else None
    return build_plan(train, facts, family=_family(cfg), data_tokens=data_tokens)


def _family(cfg):
    """The FamilySpec of the model the run trains, without loading it (`setup.planned_family`)."""
    from vlmctl.train.setup import planned_family

    return planned_family(cfg)


def run_prefix(cfg) -> str:
    """`<project.name>-<word>-`: the start of this project's default run names, the word the objective's
    (`ObjectiveSpec.run_word`: the stage for sft, else the objective, e.g. `demo-dpo-`), the project name reduced
    to safe characters."""
    from vlmctl.train.registry import get_objective
    from vlmctl.train.rundir import safe_part

    return f"{safe_part(cfg.project.name)}-{get_objective(cfg.train.objective).run_word(cfg.train)}-"


def default_run_name(cfg) -> str:
    """`<project.name>-<stage or objective>-<YYYYmmdd-HHMMSS>` (`run_prefix`)."""
    return f"{run_prefix(cfg)}{time.strftime('%Y%m%d-%H%M%S')}"


def find_resumable_run(cfg) -> Path | None:
    """The newest run folder of this project and stage (objective, for post-training: `run_prefix`) under
    train.output_dir that has a complete checkpoint."""
    from vlmctl.train.checkpoint import latest_checkpoint

    root = Path(cfg.train.output_dir)
    if not root.is_dir():
        return None
    prefix = run_prefix(cfg)
    runs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix) and latest_checkpoint(p) is not None]
    return max(runs, key=_run_order) if runs else None


def interrupted_run(cfg) -> tuple[Path, int] | None:
    """(folder, step of its last checkpoint) of the run a new `vlmctl train` of this project and stage would
    leave behind: the newest with a checkpoint and no final export (stopped by Ctrl-C, a signal or a crash);
    None when there is none."""
    from vlmctl.train.checkpoint import latest_checkpoint, read_state

    found = find_resumable_run(cfg)
    if found is None or (found / "final").is_dir():
        return None
    return found, int(read_state(latest_checkpoint(found)).get("step", 0))


def planned_run_dir(cfg, resume: bool = False) -> Path:
    """The run folder `prepare_run(cfg, resume)` would prepare (what `vlmctl train --dry-run` names), without
    creating anything. Raises UsageError when `resume` finds nothing to resume."""
    train = cfg.train.model_copy(update={"resume": "auto"} if resume and cfg.train.resume is None else {})
    root, name, _ = _run_location(cfg.model_copy(update={"train": train}))
    return root / name


def _run_order(path: Path) -> tuple[str, int]:
    """Newest last: the timestamp in the name, then the collision suffix (`-2` after the plain name)."""
    import re

    m = re.fullmatch(r"(.*-\d{8}-\d{6})(?:-(\d+))?", path.name)
    return (m.group(1), int(m.group(2) or 1)) if m else (path.name, 0)


def prepare_run(cfg, resume: bool = False) -> Path:
    """Create (or reuse, when resuming) the run folder, lock it and write the project config (config.yaml, as the
    project wrote it) and the run plan (plan.json: every `auto` decided, `launch_plan`) into it.

    With `resume`, `train.resume` becomes `auto` and the run is `train.run_name`, else the newest run of this
    project and stage with a checkpoint. A fresh run without `train.run_name` gets a folder of its own (a suffix
    when the name is taken); an explicit `train.run_name` that already holds a run needs `--resume`. The folder
    stays locked until `rundir.release_run` (or the end of this process); stale temporary files are removed.
    A node other than node 0 of a multi-node run (`joins_run`) only makes sure the folder exists
    (`rundir.join_run_dir`): node 0 locks it, writes config.yaml and checks the checkpoint.
    Raises ConfigError for a multi-node setting that is missing (`check_nodes`) or a plan this device cannot train
    with (`config.plan.check_plan`), UsageError when there is nothing
    to resume or the folder is in use, ConfigError for a taken run_name, DataError/ModelError when the prepared
    data or the model is missing and CheckpointError for a checkpoint that cannot be resumed (see `preflight`).
    """
    from vlmctl.config import dump_config
    from vlmctl.config.plan import check_plan, write_plan
    from vlmctl.train.rundir import claim_run_dir, join_run_dir, sweep_temporaries

    train = cfg.train
    check_nodes(train)
    plan = launch_plan(cfg)  # every auto decided once, before a process starts; plan.json in the run folder
    check_packages(train)  # a missing package first: its hint installs it
    check_plan(plan, train)  # what this device cannot train with is refused here, not by the ranks
    check_sharding(train, plan.strategy.value)
    if resume and train.resume is None:
        train.resume = "auto"
    fresh_slurm = train.launcher == "slurm" and train.resume is None
    root, name, explicit = _run_location(cfg)
    if train.resume is not None and not fresh_slurm:
        check_unfinished(root / name, train)
    if train.launcher != "slurm":  # an sbatch script runs elsewhere, later: its nodes check for themselves
        preflight(cfg, root / name if train.resume is not None and not joins_run(train) else None)
    if joins_run(train):
        train.run_name = name
        return join_run_dir(root, name)
    run_dir = claim_run_dir(root, name, explicit=explicit, resume=train.resume is not None)
    sweep_temporaries(run_dir)
    train.run_name = run_dir.name
    if fresh_slurm:
        train.resume = "auto"  # a requeued job continues from its last checkpoint
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(dump_config(cfg))
    os.replace(tmp, run_dir / "config.yaml")
    write_plan(run_dir, plan)
    return run_dir


def discard_unstarted(run_dir: Path) -> bool:
    """Remove the folder of a new run that failed before it held anything of a run (`rundir.holds_a_run`: no
    metrics, checkpoint or export), so the same command can run again under the same name; returns whether it
    was removed."""
    from vlmctl.train.rundir import holds_a_run

    if not run_dir.is_dir() or holds_a_run(run_dir):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def check_unfinished(run_dir: Path, train) -> None:
    """Raise UsageError when the run to resume already finished: its final export is there and its latest
    checkpoint reached `train.max_steps` (or, without it, `train.num_epochs`), so resuming would only export it
    again."""
    from vlmctl.train.checkpoint import latest_checkpoint, read_state

    last = latest_checkpoint(run_dir)
    if last is None or not (run_dir / "final").is_dir():
        return
    state = read_state(last)
    step = int(state.get("step", 0))
    done = step >= train.max_steps if train.max_steps else float(state.get("epoch", 0)) >= train.num_epochs
    if done:
        raise UsageError(f"the run {run_dir.name} is finished: step {step}, exported to {run_dir / 'final'}; there "
                         "is nothing to resume",
                         hint="raise train.max_steps (or train.num_epochs) to train it further, or start a new run "
                         "without --resume")


def _run_location(cfg) -> tuple[Path, str, bool]:
    """(output folder, run name, whether the name was given) of the run `prepare_run` prepares: `train.run_name`;
    the run of a checkpoint path in `train.resume`; the newest resumable run for `train.resume: auto`; else a new
    default name. Raises UsageError when `auto` finds nothing to resume."""
    train = cfg.train
    root, name, explicit = Path(train.output_dir), train.run_name, bool(train.run_name)
    if not explicit and train.resume not in (None, "auto"):
        run_dir = Path(train.resume).resolve().parent.parent  # <run>/checkpoints/checkpoint-<step>
        root, name = run_dir.parent, run_dir.name
    elif not explicit and train.resume is not None:
        found = find_resumable_run(cfg)
        if found is None:
            raise UsageError(f"no run with a checkpoint to resume under {train.output_dir}",
                             hint="start a new run without --resume, or set train.run_name to the run folder's name")
        name = found.name
    elif not explicit:
        name = default_run_name(cfg)
    return root, name, explicit


def joins_run(train) -> bool:
    """Whether this launch is a node other than node 0 of a multi-node torchrun/accelerate run: it uses the run
    folder node 0 prepared instead of claiming it."""
    return train.launcher in AGENTS and train.nnodes > 1 and train.node_rank > 0


def check_nodes(train) -> None:
    """Raise ConfigError for a node layout that cannot run (`check_layout`) and, for torchrun/accelerate over
    several nodes, for a missing `train.run_name`: every node must name the same run folder (a checkpoint path in
    `train.resume` names it too)."""
    check_layout(train)
    multi = train.launcher in AGENTS and train.nnodes > 1
    if multi and train.run_name is None and train.resume in (None, "auto"):
        raise ConfigError(f"train.nnodes={train.nnodes} needs train.run_name: every node must write into the same run folder",
                          hint="pass the same train.run_name=<name> on every node")


def check_layout(train) -> None:
    """Raise ConfigError for `train.node_rank` not below `train.nnodes`, for more than one node in one process
    (`launcher: none`), and for torchrun/accelerate over several nodes with the rendezvous host left at its
    default (it must be node 0's address, the same on every node; an explicit 127.0.0.1 runs every node here)."""
    if train.node_rank >= train.nnodes:
        raise ConfigError(f"train.node_rank={train.node_rank} is not below train.nnodes={train.nnodes}",
                          hint=f"number the nodes 0 to {train.nnodes - 1} (--node-rank), or raise --nnodes")
    if train.nnodes == 1 or train.launcher == "slurm":  # SLURM: the allocation names the nodes
        return
    if train.launcher not in AGENTS:
        raise ConfigError(f"train.launcher={train.launcher} runs one process here; train.nnodes={train.nnodes} needs a launcher",
                          hint="use --launcher torchrun (or accelerate, or slurm), or set --nnodes 1")
    if "master_addr" not in train.model_fields_set:
        raise ConfigError(f"train.nnodes={train.nnodes} needs the rendezvous host of node 0",
                          hint="pass --master-addr <node 0 address> (and --node-rank on each node)")


def check_sharding(train, strategy: str | None = None) -> None:
    """Raise ConfigError when `train.fsdp_sharding: hybrid` meets a strategy other than fsdp (`strategy`: the run
    plan's, by default planned here as `prepare_run` plans it)."""
    if train.fsdp_sharding == "full":
        return
    if strategy is None:
        from types import SimpleNamespace

        strategy = launch_plan(SimpleNamespace(train=train, model=None)).strategy.value
    if not is_fsdp(strategy):
        raise ConfigError(f"train.fsdp_sharding=hybrid needs train.strategy=fsdp, not {strategy}",
                          hint="set train.strategy=fsdp, or train.fsdp_sharding=full")


def require_package(module: str, setting: str, *, package: str | None = None, extra: str | None = None,
                    error: type = ConfigError) -> None:
    """Raise `error` (ConfigError unless given) naming `setting` when `module` cannot be imported here; the hint
    installs it through vlmctl's optional dependency `extra` (pyproject.toml) or as `package`. Looks the module up
    with `importlib.util.find_spec`, without importing it."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install counts as missing
        found = False
    if not found:
        package = package or module
        install = f"pip install 'vlmctl[{extra}]'" if extra else f"pip install {package}"
        raise error(f"{setting} needs the {package} package, which is not installed",
                    hint=f"{install}, or change {setting.split('=')[0]}")


def required_packages(train) -> list[tuple[str, str, str | None, str | None]]:
    """The optional packages `train` (a TrainSection) needs, as (module, setting, pip package, extra)."""
    needs = [(tracker, f"train.report_to={tracker}", None, "tracking") for tracker in train.report_to]
    if is_deepspeed(train.strategy):
        needs.append(("deepspeed", f"train.strategy={train.strategy}", None, "deepspeed"))
    if train.liger == "on":
        needs.append(("liger_kernel", "train.liger=on", "liger-kernel", "gpu"))
    if train.attn_implementation == "flash_attn":
        needs.append(("flash_attn", "train.attn_implementation=flash_attn", "flash-attn", "flash"))
    if train.lora is not None:
        needs.append(("peft", "train.lora", None, None))
        if train.lora.quantize != "none":
            needs.append(("bitsandbytes", f"train.lora.quantize={train.lora.quantize}", None, None))
    return needs


def check_packages(train) -> None:
    """Raise ConfigError (exit 2) for the first optional package `train` needs that is not installed
    (`required_packages`), before any process starts."""
    for module, setting, package, extra in required_packages(train):
        require_package(module, setting, package=package, extra=extra)


def _split_rows(folder: Path) -> int:
    """Samples in a prepared split folder (from the Parquet footers; 0 without shards)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in sorted(folder.glob("*.parquet")))


def check_built_settings(cfg, source: str) -> None:
    """Raise ConfigError when `source` is the folder `vlmctl model build` wrote and a model.* key differs from
    what it was built with: training would load the old model while the run's config.yaml records the new keys."""
    from vlmctl.models.build import changed_settings
    from vlmctl.models.load import read_build_info

    info = read_build_info(source) if Path(source) == Path(cfg.model.output_dir) else None
    changed = changed_settings(cfg.model, info) if info else {}
    if changed:
        what = "; ".join(f"model.{k}: built with {old!r}, now {new!r}" for k, (old, new) in changed.items())
        raise ConfigError(f"the model in {source} was built with other settings ({what}); training would use the old "
                          "model", hint="rebuild it with `vlmctl model build --force` (or train with --rebuild-model), "
                          "or set the keys back")


def preflight(cfg, run_dir: Path | None = None) -> None:
    """Fail before spawning processes when an optional package the config needs is missing (ConfigError,
    `check_packages`), the prepared data (the val split too with `train.eval_steps`) or the model is missing, the
    training shards hold no preference pairs for an objective that trains on them (`ObjectiveSpec.data`), the
    objective's own check refuses (`ObjectiveSpec.preflight`: grpo's reward functions) (DataError / ModelError /
    ConfigError), or when the checkpoint
    a resumed run (`run_dir`) would load is damaged or refused (`checkpoints.check_checkpoint`, CheckpointError
    naming the file) or was written with another batching (`checkpoint.check_batching`, ConfigError)."""
    from vlmctl.errors import DataError, MissingSourceError
    from vlmctl.train.checkpoint import check_batching, resolve_resume
    from vlmctl.train.registry import get_objective
    from vlmctl.train.setup import model_source

    check_packages(cfg.train)
    train_dir = Path(cfg.data.prepared_dir) / "train"
    if not any(train_dir.glob("*.parquet")):
        raise MissingSourceError(f"no prepared training shards in {train_dir}", hint="run `vlmctl data prepare` first")
    spec = get_objective(cfg.train.objective)
    if spec.data != "conversations":  # e.g. pairs: read from the first shard's schema
        import pyarrow as pa
        import pyarrow.parquet as pq

        from vlmctl.train.data import check_objective_data

        shard = min(train_dir.glob("*.parquet"))
        try:
            columns = pq.read_schema(shard).names
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{shard}: not a readable Parquet shard ({exc})", hint="re-run `vlmctl data prepare`") from None
        check_objective_data(columns, spec, train_dir)
    if spec.preflight is not None:  # e.g. grpo's reward functions, imported here before any process starts
        spec.preflight(cfg)
    val_dir = Path(cfg.data.prepared_dir) / "val"
    if cfg.train.eval_steps and not _split_rows(val_dir):
        raise DataError(f"train.eval_steps validates on the val split, but {val_dir} holds no prepared samples",
                        hint="set data.val_ratio above 0 (e.g. 0.05) and re-run `vlmctl data prepare`, or unset "
                        "train.eval_steps")
    check_built_settings(cfg, model_source(cfg))  # raises ModelError without a built model or model.base
    checkpoint = resolve_resume(run_dir, cfg.train.resume) if run_dir is not None else None
    if checkpoint is not None:
        from vlmctl.checkpoints import check_checkpoint

        check_checkpoint(checkpoint)
        check_batching(checkpoint, cfg.train, before_launch=True)


@dataclass
class Launch:
    """A launch: the command to run, for SLURM the script it submits, the claim on the rendezvous port
    (`distributed.env.claim_port`; held until the agent bound it) and the variables it needs beyond the
    environment of a default run (`rank_env`; `launch_env` sets them)."""

    command: list[str]
    script: Path | None = None
    script_text: str | None = None
    port_claim: Any = field(default=None, repr=False, compare=False)
    env: dict[str, str] = field(default_factory=dict)

    def render(self) -> str:
        """The command as one shell line, `NAME=value` words of `env` first."""
        return shlex.join([*(f"{k}={v}" for k, v in self.env.items()), *self.command])


def _torchrun() -> list[str]:
    """torchrun through `vlmctl.distributed.torchrun` (dies with vlmctl, no ChildFailedError dump)."""
    return [sys.executable, "-m", "vlmctl.distributed.torchrun"]


def _accelerate() -> list[str]:
    """`accelerate launch` through `vlmctl.distributed.accelerate` (dies with vlmctl, no traceback dump)."""
    return [sys.executable, "-m", "vlmctl.distributed.accelerate"]


def launch_command(train, run_dir: Path, module: str = WORKER_MODULE) -> Launch:
    """Build the command of `train.launcher` (torchrun, accelerate, slurm, none) running `python -m MODULE
    run_dir` (the training worker unless given, e.g. `vlmctl.bench`) on node `train.node_rank`.

    On one node the rendezvous is `train.master_addr` on `train.master_port` when that port is free and no other
    vlmctl launch here claimed it, else on a free port (so two runs on one machine never collide); over several
    nodes it is `master_addr:master_port` as given, torchrun's c10d rendezvous with the run folder's name as its
    id. Raises ConfigError when a multi-node setting is missing (`check_layout`), for hybrid sharding without fsdp
    (`check_sharding`) and for SLURM with `train.nproc_per_node: auto` (the nodes' GPUs are not visible here). The
    processes per node are the run plan's (`planned_nproc`).
    """
    check_layout(train)
    check_sharding(train)
    worker = ["-m", module, str(run_dir)]
    port, claim = train.master_port, None
    if train.nnodes == 1 and train.launcher in AGENTS:
        from vlmctl.distributed.env import claim_port

        port, claim = claim_port(train.master_port)
    nproc = planned_nproc(train, run_dir)
    if nproc is None:
        raise ConfigError("train.launcher=slurm needs train.nproc_per_node: the GPUs of the allocated nodes are not visible here",
                          hint="pass --nproc-per-node <GPUs per node>")
    if train.launcher == "slurm":
        script = run_dir / "sbatch.sh"
        return Launch(["sbatch", str(script)], script=script, script_text=sbatch_script(train, run_dir, nproc))
    if train.launcher == "torchrun":
        cmd = [*_torchrun(), "--nproc-per-node", str(nproc), "--nnodes", str(train.nnodes), "--node-rank",
               str(train.node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{train.master_addr}:{port}",
               "--rdzv-id", run_dir.name, *worker]
        return Launch(cmd, port_claim=claim, env=rank_env(train))
    if train.launcher == "accelerate":
        cmd = [*_accelerate(), "launch", "--num_processes", str(nproc * train.nnodes), "--num_machines", str(train.nnodes),
               "--machine_rank", str(train.node_rank), "--main_process_ip", train.master_addr, "--main_process_port",
               str(port), "--mixed_precision", "no", "--dynamo_backend", "no"]
        if nproc * train.nnodes > 1:
            cmd.append("--multi_gpu")  # accelerate's torch.distributed spawner; it works for CPU processes too
        cmd += ["--module", module, str(run_dir)]
        return Launch(cmd, port_claim=claim, env=rank_env(train))
    if train.launcher == "none":
        return Launch([sys.executable, *worker])
    raise UsageError(f"unknown launcher {train.launcher!r}", hint="use torchrun, accelerate, slurm or none")


def planned_nproc(train, run_dir: Path) -> int | None:
    """Processes per node: the run plan's decision (`config.plan.decide_nproc`), from `run_dir/plan.json` where
    `prepare_run` wrote it, else decided for this machine as the plan decides it (a dry run, the bench's ranks);
    None for SLURM with `train.nproc_per_node: auto`."""
    from vlmctl.config.plan import PLAN_FILE, decide_nproc, read_plan, visible_gpus

    plan = read_plan(run_dir) if (Path(run_dir) / PLAN_FILE).is_file() else None
    return (plan.nproc_per_node if plan is not None else decide_nproc(train, visible_gpus())).value


def dry_run_text(train, run_dir: Path) -> str:
    """What `vlmctl train --dry-run` prints: the launch command; for torchrun or accelerate over several nodes the
    command of every node (node_rank 0 to nnodes-1), each under a `# node N of M` line; for SLURM the sbatch line
    and the script. Nothing is written or started (a claimed port is released). Raises what `launch_command`
    raises."""
    check_nodes(train)  # this node's settings, before every node's are printed
    check_packages(train)  # a dry run says what the real one would refuse
    nodes = range(train.nnodes) if train.launcher in AGENTS and train.nnodes > 1 else [None]
    lines = []
    for rank in nodes:
        node = train if rank is None else train.model_copy(update={"node_rank": rank})
        launch = launch_command(node, run_dir)
        if launch.port_claim:
            launch.port_claim.close()
        if rank is not None:
            lines.append(f"# node {rank} of {train.nnodes} (vlmctl train --node-rank {rank} there)")
        lines.append(launch.render())
        if launch.script_text:
            lines.append(launch.script_text.rstrip("\n"))
    return "\n".join(lines)


def _script_word(value: object, key: str) -> str:
    """`value` quoted for the sbatch script (`shlex.quote`); ConfigError for control characters (a newline
    would end an `#SBATCH` line and start a command)."""
    text = str(value)
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ConfigError(f"{key} = {text!r} holds a control character (newline, tab, ...)",
                          hint="use a value without control characters")
    return shlex.quote(text)


def sbatch_script(train, run_dir: Path, nproc: int) -> str:
    """An sbatch script running one torchrun per node (`srun`, one task per node), rendezvous (torchrun's c10d,
    the job id as its id) on the first node of the allocation (`scontrol show hostnames`) at `train.master_port`.

    Requeue-friendly: SLURM sends SIGTERM 120 s before the time limit (`--signal`), the workers save a checkpoint
    and exit, and the requeued job resumes from it (`prepare_run` sets `train.resume: auto` in the run's config.yaml for
    SLURM runs; with no checkpoint yet it starts from scratch). Every value is quoted with `shlex.quote`;
    control characters are refused (ConfigError).
    """
    name = _script_word(run_dir.name, "train.run_name")
    folder = _script_word(run_dir, "train.output_dir")
    log = _script_word(f"{run_dir}/slurm-%j.out", "train.output_dir")
    port, nnodes, gpus = (_script_word(int(v), k) for v, k in ((train.master_port, "train.master_port"),
                                                               (train.nnodes, "train.nnodes"), (nproc, "train.nproc_per_node")))
    torchrun = " ".join(_script_word(p, "python") for p in _torchrun())
    sharding = _script_word(train.fsdp_sharding, "train.fsdp_sharding")
    return f"""#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={nnodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --output={log}
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=TERM@120
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT={port}
export {SHARDING_ENV}={sharding}
srun --kill-on-bad-exit=1 {torchrun} \\
  --nproc-per-node {gpus} --nnodes "$SLURM_NNODES" \\
  --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\
  -m {WORKER_MODULE} {folder}
"""


def rank_env(train) -> dict[str, str]:
    """The variables a launch needs beyond those of a default run: `VLMCTL_FSDP_SHARDING=hybrid` for
    `train.fsdp_sharding: hybrid` (the ranks build their mesh from it: `distributed.mesh.ParallelDims.for_strategy`)."""
    return {SHARDING_ENV: train.fsdp_sharding} if train.fsdp_sharding != "full" else {}


def launch_env(train) -> dict[str, str]:
    """The environment of a launch: this one, one OpenMP thread per rank unless set, CPU DeepSpeed without CUDA,
    `train.fsdp_sharding` for the ranks (`VLMCTL_FSDP_SHARDING`) and `VLMCTL_LAUNCHER_PID` (this process: the
    ranks exit when it is gone and leave the stop message to it)."""
    from vlmctl.distributed.process import LAUNCHER_ENV

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env[SHARDING_ENV] = train.fsdp_sharding
    env[LAUNCHER_ENV] = str(os.getpid())
    if is_deepspeed(train.strategy) and not _has_cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def log_name(train) -> str:
    """The file in the run folder a launcher copies its ranks' output into: `train.log`, and on node N > 0 of a
    multi-node run `train-node<N>.log` (every node's launcher writes its own file on the shared filesystem)."""
    return f"train-node{train.node_rank}.log" if joins_run(train) else TRAIN_LOG


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


STEP_LINE = re.compile(r"step (\d+)/(\d+) (.*) eta \d+s")
"""The plain progress line a rank prints when its output is not a terminal (`metrics.Progress`)."""


class ConsoleEcho:
    """Shows a launched run's output on this terminal: the ranks write plain lines into a pipe (so that train.log
    holds no control codes), and their `step N/M ...` lines drive one rich progress bar here; every other line is
    printed above it. Off a terminal, lines pass through unchanged."""

    def __init__(self):
        from rich.console import Console

        self.console = Console(highlight=False)
        self.bar = None
        self.task = None

    def write(self, text: str, stream) -> None:
        match = STEP_LINE.fullmatch(text.rstrip("\n")) if self.console.is_terminal else None
        if match is None:
            if self.bar is None:
                stream.write(text)
                stream.flush()
            else:
                self.bar.console.print(text.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
            return
        step, total, info = int(match[1]), int(match[2]), match[3]
        if self.bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                TimeRemainingColumn(), console=self.console)
            self.task = self.bar.add_task("train", total=total, completed=step, info=info)
            self.bar.start()
        self.bar.update(self.task, completed=step, total=total, info=info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class Running:
    """A launched process agent in a session of its own, its output (stdout and stderr) copied line by line into
    `log_path` (appended) and, with `echo`, to this process's stdout and stderr. `close()` waits for the copies
    to end (the pipes close when the last rank exits) and closes the log."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
                 echo: bool = True):
        self.log = Path(log_path).open("ab") if log_path is not None else None
        piped = subprocess.PIPE if self.log is not None else None
        if self.log is not None:
            env = dict(os.environ if env is None else env)
            env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the log as they are printed
            env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))  # rich tables as wide as the terminal
        self.proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=piped, stderr=piped)
        self._lock = threading.Lock()
        self._echo = ConsoleEcho() if echo else None
        self._threads = [threading.Thread(target=self._copy, args=(pipe, sink if echo else None), daemon=True)
                         for pipe, sink in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr)) if pipe]
        for thread in self._threads:
            thread.start()

    def _copy(self, pipe, sink) -> None:
        for line in iter(pipe.readline, b""):
            with self._lock:
                self.log.write(line)
                self.log.flush()
                if sink is not None:
                    try:
                        self._echo.write(line.decode(errors="replace"), sink)
                    except (OSError, ValueError):  # the console is gone: keep the log going
                        pass
        pipe.close()

    def close(self, timeout: float = 10.0) -> None:
        for thread in self._threads:
            thread.join(timeout)
        if self._echo is not None:
            self._echo.close()
        if self.log is not None:
            with self._lock:
                self.log.close()


def spawn(command: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
          grace_s: float | None = None) -> tuple[int, int | None]:
    """Run `command` (a process agent) in a session of its own, streaming its output (and, with `log_path`,
    copying it there: `Running`). SIGTERM/SIGINT go to the ranks under it (`process.signal_ranks`): they finish
    the step, save a checkpoint and exit. A second signal kills the whole session at once, and so does the end of
    `grace_s` seconds after the first (for ranks with nothing to save: a rank blocked in a CUDA call or a collective
    runs no Python signal handler, so a lone SIGTERM, as from `timeout`, would otherwise wait on it for ever).
    Returns (exit code, the first signal received or None)."""
    from vlmctl.distributed.process import signal_ranks

    running = Running(command, env=env, log_path=log_path)
    proc = running.proc
    received: list[int] = []
    timers: list[threading.Timer] = []

    def kill_session():
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def forward(signum, frame):
        received.append(signum)
        if len(received) > 1:  # asked twice: stop now, without saving
            kill_session()
            return
        try:
            signal_ranks(proc.pid, signum)
        except ProcessLookupError:
            pass
        if grace_s is not None:
            timers.append(threading.Timer(grace_s, kill_session))
            timers[-1].daemon = True
            timers[-1].start()

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for timer in timers:
            timer.cancel()
        for s, h in old.items():
            signal.signal(s, h)
        running.close()
    return code, (received[0] if received else None)


class _Tee:
    """A text stream writing to `stream` and to the binary `log` (shared lock: whole writes stay together)."""

    def __init__(self, stream, log, lock: threading.Lock):
        self.stream, self.log, self.lock = stream, log, lock

    def write(self, text: str) -> int:
        with self.lock:
            self.log.write(text.encode(errors="replace"))
            self.log.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:  # plain lines, as a launched rank writes them into its pipe
        return False

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class tee_output:
    """`with tee_output(path):` copy this process's sys.stdout and sys.stderr into `path` (appended) while they
    still reach the console; the in-process counterpart of `Running`."""

    def __init__(self, log_path: Path):
        self.log_path = Path(log_path)

    def __enter__(self):
        self.log = self.log_path.open("ab")
        self.saved = sys.stdout, sys.stderr
        lock = threading.Lock()
        sys.stdout, sys.stderr = _Tee(sys.stdout, self.log, lock), _Tee(sys.stderr, self.log, lock)
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout, sys.stderr = self.saved
        self.log.close()


def run_in_process(run_dir: Path) -> str:
    """`--launcher none`: run the worker in this process (one rank), its output copied into `<run>/train.log`.
    Returns the worker's outcome ("done", "stopped" after SIGTERM, "interrupted" after SIGINT); the caller
    reports a stop."""
    from vlmctl.distributed.process import LAUNCHER_ENV
    from vlmctl.train.worker import run

    clear_rank_env()
    previous = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # this process is the launcher: it reports a stop
    try:
        with tee_output(Path(run_dir) / TRAIN_LOG):
            return run(run_dir)
    finally:
        if previous is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = previous


def clear_rank_env() -> None:
    """Forget torchrun's rank variables, so a lone process makes its own one-rank group."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        os.environ.pop(key, None)


def submit_slurm(launch: Launch) -> tuple[bool, str]:
    """Write the sbatch script; submit it when `sbatch` exists. Returns (submitted, sbatch output or script path)."""
    assert launch.script is not None and launch.script_text is not None
    tmp = launch.script.with_suffix(".tmp")
    tmp.write_text(launch.script_text)
    tmp.chmod(0o755)
    os.replace(tmp, launch.script)
    if shutil.which("sbatch") is None:
        return False, str(launch.script)
    out = subprocess.run(["sbatch", str(launch.script)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        from vlmctl.errors import VlmctlError

        raise VlmctlError(f"sbatch failed: {out.stderr.strip()}", hint=f"check the script {launch.script}")
    return True, out.stdout.strip()
