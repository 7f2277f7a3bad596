"""The launcher side of `vlmctl train`: prepare the run folder, build the launch command, spawn it.

    run_dir = prepare_run(cfg, resume=False)          # <train.output_dir>/<run name>/config.yaml
    cmd = launch_command(cfg.train, run_dir)          # torchrun / accelerate / sbatch line
    code = spawn(cmd)                                 # streams output, forwards SIGTERM/SIGINT

Every launcher runs the same worker module (`python -m vlmctl.train.worker RUN_DIR`); the worker decides the
strategy from the config, so accelerate is only a process spawner here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vlmctl.errors import ConfigError, UsageError

WORKER_MODULE = "vlmctl.train.worker"


def resolve_nproc(value: int | str) -> int:
    """`auto` = the visible GPUs (CUDA_VISIBLE_DEVICES honoured by torch), else 1."""
    if value != "auto":
        return int(value)
    try:
        import torch

        return torch.cuda.device_count() or 1
    except Exception:  # noqa: BLE001 - no usable CUDA runtime means one CPU process
        return 1


def default_run_name(cfg) -> str:
    return f"{cfg.project.name}-{cfg.train.stage}-{time.strftime('%Y%m%d-%H%M%S')}"


def find_resumable_run(cfg) -> Path | None:
    """The newest run folder of this project and stage (under train.output_dir) that has a complete checkpoint."""
    from vlmctl.train.checkpoint import latest_checkpoint

    root = Path(cfg.train.output_dir)
    if not root.is_dir():
        return None
    prefix = f"{cfg.project.name}-{cfg.train.stage}-"
    runs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix) and latest_checkpoint(p) is not None]
    return max(runs, key=lambda p: p.name) if runs else None


def prepare_run(cfg, resume: bool = False) -> Path:
    """Create (or reuse, when resuming) the run folder and write the resolved config into it.

    With `resume`, `train.resume` becomes `auto` and the run is `train.run_name`, else the newest run of this
    project and stage with a checkpoint. Raises UsageError when there is nothing to resume, DataError/ModelError
    when the prepared data or the model is missing (see `preflight`).
    """
    from vlmctl.config import dump_config

    train = cfg.train
    if resume and train.resume is None:
        train.resume = "auto"
    fresh_slurm = train.launcher == "slurm" and train.resume is None
    if train.run_name:
        run_dir = Path(train.output_dir) / train.run_name
    elif train.resume not in (None, "auto"):
        run_dir = Path(train.resume).resolve().parent.parent  # <run>/checkpoints/checkpoint-<step>
    elif train.resume is not None:
        found = find_resumable_run(cfg)
        if found is None:
            raise UsageError(f"no run with a checkpoint to resume under {train.output_dir}",
                             hint="start a new run without --resume, or set train.run_name to the run folder's name")
        run_dir = found
    else:
        run_dir = Path(train.output_dir) / default_run_name(cfg)
    if train.launcher != "slurm":  # an sbatch script runs elsewhere, later: its nodes check for themselves
        preflight(cfg)
    train.run_name = run_dir.name
    if fresh_slurm:
        train.resume = "auto"  # a requeued job continues from its last checkpoint
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(dump_config(cfg))
    os.replace(tmp, run_dir / "config.yaml")
    return run_dir


def preflight(cfg) -> None:
    """Fail before spawning processes when the prepared data or the model is missing (DataError / ModelError)."""
    from vlmctl.errors import DataError
    from vlmctl.train.setup import model_source

    train_dir = Path(cfg.data.prepared_dir) / "train"
    if not any(train_dir.glob("*.parquet")):
        raise DataError(f"no prepared training shards in {train_dir}", hint="run `vlmctl data prepare` first")
    model_source(cfg)  # raises ModelError without a built model or model.base


@dataclass
class Launch:
    """A launch: the command to run, and for SLURM the script it submits."""

    command: list[str]
    script: Path | None = None
    script_text: str | None = None

    def render(self) -> str:
        return shlex.join(self.command)


def _torchrun() -> list[str]:
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "torch.distributed.run"]


def _accelerate() -> list[str]:
    # The console script next to this interpreter, else the module: a venv need not be on PATH.
    exe = Path(sys.executable).parent / "accelerate"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]


def launch_command(train, run_dir: Path, module: str = WORKER_MODULE) -> Launch:
    """Build the command of `train.launcher` (torchrun, accelerate, slurm, none) running `python -m MODULE
    run_dir` (the training worker unless given, e.g. `vlmctl.bench`).

    Raises ConfigError when a multi-node setting is missing.
    """
    nproc = resolve_nproc(train.nproc_per_node)
    worker = ["-m", module, str(run_dir)]
    endpoint = f"{train.master_addr}:{train.master_port}"
    if train.nnodes > 1 and train.master_addr in ("127.0.0.1", "localhost"):
        raise ConfigError(f"train.nnodes={train.nnodes} needs the rendezvous host of node 0",
                          hint="pass --master-addr <node 0 address> (and --node-rank on each node)")
    if train.launcher == "torchrun":
        cmd = [*_torchrun(), "--nproc-per-node", str(nproc), "--nnodes", str(train.nnodes), "--node-rank",
               str(train.node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, *worker]
        return Launch(cmd)
    if train.launcher == "accelerate":
        cmd = [*_accelerate(), "launch", "--num_processes", str(nproc * train.nnodes), "--num_machines", str(train.nnodes),
               "--machine_rank", str(train.node_rank), "--main_process_ip", train.master_addr, "--main_process_port",
               str(train.master_port), "--mixed_precision", "no", "--dynamo_backend", "no"]
        if nproc * train.nnodes > 1:
            cmd.append("--multi_gpu")  # accelerate's torch.distributed spawner; it works for CPU processes too
        cmd += ["--module", module, str(run_dir)]
        return Launch(cmd)
    if train.launcher == "slurm":
        script = run_dir / "sbatch.sh"
        text = sbatch_script(train, run_dir, nproc)
        return Launch(["sbatch", str(script)], script=script, script_text=text)
    if train.launcher == "none":
        return Launch([sys.executable, *worker])
    raise UsageError(f"unknown launcher {train.launcher!r}", hint="use torchrun, accelerate, slurm or none")


def sbatch_script(train, run_dir: Path, nproc: int) -> str:
    """An sbatch script running one torchrun per node, rendezvous on the first node of the allocation.

    Requeue-friendly: SLURM sends SIGTERM 120 s before the time limit (`--signal`), the workers save a checkpoint
    and exit, and the requeued job resumes from it (`prepare_run` sets `train.resume: auto` in the run's config.yaml for
    SLURM runs; with no checkpoint yet it starts from scratch).
    """
    name = run_dir.name
    torchrun = " ".join(shlex.quote(p) for p in _torchrun())
    return f"""#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={train.nnodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={nproc}
#SBATCH --output={run_dir}/slurm-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=TERM@120
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT={train.master_port}
srun --kill-on-bad-exit=1 {torchrun} \\
  --nproc-per-node {nproc} --nnodes "$SLURM_NNODES" \\
  --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\
  -m {WORKER_MODULE} {shlex.quote(str(run_dir))}
"""


def launch_env(train) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if train.strategy in ("zero2", "zero3") and not _has_cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def spawn(command: list[str], env: dict[str, str] | None = None) -> tuple[int, int | None]:
    """Run `command`, streaming its output; SIGTERM/SIGINT are forwarded to it (the workers then save a
    checkpoint and exit). Returns (exit code, the forwarded signal or None)."""
    proc = subprocess.Popen(command, env=env)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return code, (received[0] if received else None)


def run_in_process(run_dir: Path) -> str:
    """`--launcher none`: run the worker in this process (one rank)."""
    from vlmctl.train.worker import run

    clear_rank_env()
    return run(run_dir)


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
