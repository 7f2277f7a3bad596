"""Checkpoints: the engine's files (`distributed.engine.Engine.save`: torch DCP for ddp/fsdp, DeepSpeed's own
layout for zero2/zero3), atomic rename, pruning, discovery.

Layout of a run folder (readers such as `vlmctl convert` depend on it)::

    <train.output_dir>/<run name>/
      config.yaml                     the resolved project config
      command.json                    the `vlmctl train` command-line settings (`record_command`): what the resume
                                      hints repeat (`resume_command`)
      metrics.jsonl                   one JSON object per logged step
      checkpoints/checkpoint-<step>/  complete checkpoints only (written as .tmp-checkpoint-<step>, then renamed; one
                                      written again for its step replaces the old one through .old-checkpoint-<step>)
        trainer_state.json            {step, epoch, consumed_micro_batches, lora, model_source, family, world_size,
                                       strategy, format, ...}
        rng-<rank>.pt                 per-rank RNG states (python, numpy, torch CPU/CUDA)
        objective-<rank>.pt           per-rank objective state, when it has one (`state_dict()`: GRPO's rollouts
                                      buffered for its num_iterations reuse steps)
        ddp/fsdp: DCP files (.metadata, __<rank>_0.distcp) of {"model": <HF or peft state_dict keys>,
                  "optim": <optimizer state dict keyed by parameter names>, "scheduler": {...}}
        zero2/zero3: DeepSpeed's `engine.save_checkpoint` layout (latest, global_step<N>/...)
      final/                          HF export (model + processor), or a peft adapter with keep_adapter

DCP model keys are the unwrapped model's `state_dict()` keys (`torch.distributed.checkpoint.state_dict.
get_state_dict` strips DDP/FSDP wrappers), so the checkpoint's keys read `model.<hf key>`.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

# numpy and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not
# pay for them.
# rich is imported inside the functions that print: using vlmctl as a library does not load it.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (renamed into place, with trainer_state.json), oldest first."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = CHECKPOINT_RE.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    """trainer_state.json of `checkpoint`; raises CheckpointError naming the file when it is missing or broken."""
    from vlmctl.checkpoints import read_json

    return read_json(Path(checkpoint) / STATE_FILE)


def check_batching(checkpoint: Path, train, *, before_launch: bool = False) -> None:
    """Raise ConfigError when `train` batches differently from the run that wrote `checkpoint` (train.packing, or
    an explicit train.tokens_per_batch / train.micro_batch_size; a packed row is tokens_per_batch x
    train.sequence_parallel tokens, so a row split over other ranks is the same batching): the checkpoint's data position is a count of
    micro-batches of its own batching, so another one would resume at other samples (skipping or repeating some).
    `auto` sizes are not compared: a resumed run reuses the sizes its first run chose. `before_launch` (the
    launcher's check, before the model is known) lets a checkpoint without packing pass a config with it: a family
    that cannot take packed rows trains padded whatever the config says; the ranks check again once it is known."""
    from types import SimpleNamespace

    from vlmctl.config.plan import row_tokens
    from vlmctl.errors import ConfigError

    saved = read_state(checkpoint)
    changes = []  # (key, written with, set now, the value that resumes)
    if isinstance(saved.get("packing"), bool) and saved["packing"] != train.packing:
        if not (before_launch and train.packing):  # padded before: perhaps the family's fallback (see above)
            changes.append(("packing", saved["packing"], train.packing, saved["packing"]))
    else:
        key = "tokens_per_batch" if train.packing else "micro_batch_size"
        old, new = saved.get(key), getattr(train, key)
        if key == "tokens_per_batch" and isinstance(old, int) and isinstance(new, int):
            # a packed row is tokens_per_batch per rank x the ranks of a sequence-parallel group that split it: the
            # same row may be resumed over another split (sequence.SequenceShard)
            row = row_tokens(SimpleNamespace(sequence_parallel=int(saved.get("sequence_parallel") or 1)), old)
            if row != row_tokens(train, new):
                fix = row // train.sequence_parallel if row % train.sequence_parallel == 0 else old
                changes.append((key, old, new, fix))
        elif isinstance(old, int) and isinstance(new, int) and old != new:
            changes.append((key, old, new, old))
    if not changes:
        return
    key, old, new, fix = changes[0]
    shown = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    raise ConfigError(
        f"{checkpoint} was written with train.{key}={shown(old)}, the project now sets {shown(new)}: its data position "
        f"({saved.get('consumed_micro_batches')} micro-batches per rank) counts batches of the old size, so resuming "
        "would skip or repeat samples",
        hint=f"resume with train.{key}={shown(fix)} (an override on the command line), or start a new run without --resume",
    )


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (what `torch.load(weights_only=True)` reads back):
    python's Mersenne Twister, numpy's legacy global generator, torch CPU (and CUDA)."""
    import numpy as np
    import torch

    version, mt, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state = {"python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
             "numpy": {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)), "pos": int(np_state["state"]["pos"]),
                       "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()`'s states (or the tuples of files written before they held tensors only)."""
    import numpy as np
    import torch

    py, npy = state["python"], state["numpy"]
    if isinstance(py, dict):
        py = (py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"])
    if isinstance(npy, dict):
        npy = ("MT19937", npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(run_dir: Path, step: int, trainer_state: dict[str, Any], *, rank: int, engine,
         total_limit: int | None = None, keep: int | None = None, objective=None) -> Path:
    """Save a checkpoint of `step` collectively (every rank calls this) and return its final path.

    The engine's model, optimizer and schedule (`Engine.save`: DCP or DeepSpeed's layout). Written to
    `.tmp-checkpoint-<step>` and renamed by rank 0 once every rank is done; then old checkpoints beyond
    `total_limit` are removed, except the one of step `keep` (the best, `train.save_best`). An `objective` with a
    non-empty `state_dict()` is saved per rank (objective-<rank>.pt). A write that fails on any rank (disk full, permissions) fails on every rank with
    the same CheckpointError naming the file (and the free space for a full disk); the temporary folder is removed.
    """
    folder = checkpoints_dir(run_dir)
    final, tmp = folder / f"checkpoint-{step}", folder / f".tmp-checkpoint-{step}"
    try:
        _agree(_attempt(lambda: _make_tmp(tmp) if rank == 0 else None, tmp))
        _agree(_attempt(lambda: _write_state(tmp, step, rank, engine, objective), tmp))
        _agree(_attempt(lambda: _install(run_dir, tmp, final, trainer_state, total_limit, keep) if rank == 0 else None, tmp))
    except Exception:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _make_tmp(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def _write_state(tmp: Path, step: int, rank: int, engine, objective=None) -> None:
    """This rank's part: the engine's files (DCP shards are collective), then its RNG states and objective state."""
    import torch

    engine.save(tmp, step)
    with open(tmp / f"rng-{rank}.pt", "wb") as f:  # through a Python file: a full disk raises OSError(ENOSPC), not a bare RuntimeError
        torch.save(rng_state(), f)
    from vlmctl.train.objectives import has_hook

    state = objective.state_dict() if has_hook(objective, "state") else {}
    if state:
        with open(tmp / f"objective-{rank}.pt", "wb") as f:
            torch.save(state, f)


def _install(run_dir: Path, tmp: Path, final: Path, trainer_state: dict[str, Any], total_limit: int | None,
             keep: int | None = None) -> None:
    """Rank 0, once every rank wrote its part: trainer_state.json, the rename into place, pruning (the checkpoint
    just written is the latest, whatever steps other checkpoints hold). A checkpoint of the same step already there
    (a run resumed from an earlier one) is moved aside first and removed after the rename, so a kill in between
    leaves it as `.old-checkpoint-<step>`, which `prune` puts back."""
    (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, default=str))
    aside = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)
    prune(run_dir, total_limit, keep=keep, latest=final)


def _attempt(action, where: Path):
    """Run `action`; return None, or the (message, hint) of the write error it raised (OSError, CheckpointError,
    torch.save's zip writer failing a file part-way, or DCP's CheckpointException around either)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from vlmctl.checkpoints import CheckpointError, rank_failures

    try:
        action()
    except CheckpointError as exc:
        return exc.message, exc.hint
    except OSError as exc:
        return write_error(exc, where)
    except CheckpointException as exc:
        cause = _os_error_in(exc)
        if cause is not None:
            return write_error(cause, where)
        found = next((e for e in rank_failures(exc) if isinstance(e, RuntimeError) and _short_write(e)), None)
        if found is None:
            raise
        return _short_write_error(found, where)
    except RuntimeError as exc:
        if not _short_write(exc):
            raise
        return _short_write_error(exc, where)
    return None


_SHORT_WRITE = ("file write failed", "unexpected pos", "No space left")
"""What torch.save's zip writer says when a file could not be written whole (it raises RuntimeError, no errno)."""


def _short_write(exc: RuntimeError) -> bool:
    return any(m in str(exc) for m in _SHORT_WRITE)


def _short_write_error(exc: RuntimeError, where: Path) -> tuple[str, str]:
    """(message, hint) for a file torch.save wrote only in part (DCP's shards, DeepSpeed's files): a full disk when
    the filesystem has (almost) no space left; otherwise the space may have been freed since (another process, this
    checkpoint's own temporary files), and the message says what torch reported and what is free now."""
    free = free_space(where)
    if free < LOW_SPACE:
        return write_error(OSError(errno.ENOSPC, "No space left on device"), where)
    from vlmctl.checkpoints import _first_line

    run = _run_of(Path(where))
    return (f"cannot write the checkpoint in {where}: torch wrote a file of it only in part ({_first_line(exc)}); "
            f"{human_bytes(free)} are free on that filesystem now",
            "a full disk or quota is the usual cause (another process may have freed space since): free some space, "
            f"then continue with `{resume_command(run)}`")


def _os_error_in(exc: BaseException) -> OSError | None:
    """The first OSError among DCP's per-rank failures (or the exception's causes)."""
    from vlmctl.checkpoints import rank_failures

    for cause in rank_failures(exc):
        if isinstance(cause, OSError):
            return cause
    seen = exc.__cause__ or exc.__context__
    return seen if isinstance(seen, OSError) else None


def write_error(exc: OSError, where: Path, run_dir: Path | None = None) -> tuple[str, str]:
    """(message, hint) for a failed write: a full disk names the file, the free space left and, when the run has
    an earlier checkpoint, the space one checkpoint takes; the earlier checkpoints are untouched. The hint's resume
    command is the one of `run_dir` (default: the run `where` lies in)."""
    path = Path(exc.filename) if exc.filename else Path(where)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_space(path)
        size = _last_checkpoint_bytes(Path(where))
        needed = f"; a checkpoint of this run takes {human_bytes(size)}" if size else ""
        kept = "; the previous checkpoint is intact" if size else ""
        return (f"disk full while writing {path} ({human_bytes(free)} free on that filesystem{needed}{kept})",
                "free some space (or lower train.save_total_limit, or move train.output_dir), then continue with "
                f"`{resume_command(run_dir or _run_of(Path(where)))}`")
    return (f"cannot write {path}: {exc.strerror or exc}", "check that train.output_dir is writable")


def _run_of(where: Path) -> Path:
    """The run folder of `where`: the run itself, its checkpoints folder, or a (temporary) checkpoint in it."""
    for candidate in (where, *where.parents):
        if candidate.name == "checkpoints":
            return candidate.parent
    return where


COMMAND_FILE = "command.json"


def record_command(run_dir: Path, args: list[str]) -> None:
    """Write the arguments of the `vlmctl train` command that runs `run_dir` (without --resume, --dry-run,
    train.run_name and train.resume: the hint adds them) into `run_dir/command.json`, through a temporary file."""
    kept = [a for a in args if not a.startswith(("train.run_name=", "train.resume="))]
    tmp = Path(run_dir) / f".{COMMAND_FILE}.tmp"
    tmp.write_text(json.dumps({"args": kept}) + "\n")
    os.replace(tmp, Path(run_dir) / COMMAND_FILE)


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in `run_dir` with the command-line settings it was started with
    (`record_command`; none recorded: the bare command), shell-quoted: `vlmctl train ARGS --resume
    train.run_name=NAME`. Values shaped like access tokens are masked (`mask_secrets`)."""
    import shlex

    from vlmctl.config import mask_secrets

    args: list[str] = []
    try:
        recorded = json.loads((Path(run_dir) / COMMAND_FILE).read_text())
        if isinstance(recorded, dict) and isinstance(recorded.get("args"), list):
            args = [str(a) for a in recorded["args"]]
    except (OSError, ValueError):
        pass
    return mask_secrets(shlex.join(["vlmctl", "train", *args, "--resume", f"train.run_name={Path(run_dir).name}"]))


LOW_SPACE = 64 << 20
"""Free bytes under which a write failure without an errno is taken for a full disk."""


def _last_checkpoint_bytes(where: Path) -> int:
    """Bytes of the newest complete checkpoint next to `where` (a checkpoint being written), 0 when there is none."""
    folder = where if where.name == "checkpoints" else where.parent
    done = sorted((p for p in folder.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()),
                  key=lambda p: int(p.name.split("-")[-1]))
    if not done:
        return 0
    return sum(f.stat().st_size for f in done[-1].rglob("*") if f.is_file())


def free_space(path: Path) -> int:
    """Free bytes on the filesystem of `path` (its nearest existing ancestor)."""
    for candidate in (Path(path), *Path(path).parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _agree(error: tuple[str, str] | None) -> None:
    """Every rank learns whether any rank failed (all_gather of the errors); all raise the first rank's error."""
    import torch.distributed as dist

    from vlmctl.checkpoints import CheckpointError

    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(*first)


def load(checkpoint: Path, *, rank: int, engine) -> dict[str, Any]:
    """Restore the engine's model, optimizer, scheduler (`Engine.load`) and this rank's RNG states in place; return
    trainer_state.json.

    Every rank calls this. Every file is read through `vlmctl.checkpoints` (JSON, weights-only tensors, DCP with
    the allow-listed metadata reader and planner, DeepSpeed with weights-only loads) after `check_checkpoint`, so
    every rank raises the same CheckpointError naming the file for a missing, truncated, damaged or refused one.
    """
    from vlmctl import checkpoints as safe

    checkpoint = Path(checkpoint)
    state = safe.check_checkpoint(checkpoint)
    for key in ("step", "consumed_micro_batches"):  # the loop's position (TrainState.from_checkpoint)
        if not isinstance(state.get(key), int) or state[key] < 0:
            raise safe.corrupt(checkpoint / STATE_FILE, f"{key} is {state.get(key)!r}, not a step count")
    engine.load(checkpoint)
    rng_file = checkpoint / f"rng-{rank}.pt"
    if rng_file.is_file():
        set_rng_state(safe.load_tensors(rng_file))
    return state


def prune(run_dir: Path, total_limit: int | None, keep: int | None = None, latest: Path | None = None) -> list[Path]:
    """Remove stale temporary folders and the oldest complete checkpoints beyond `total_limit`; return removed.
    `latest`: the checkpoint just saved (default: the highest step), never removed; a run resumed from an earlier
    checkpoint writes steps below ones of its abandoned continuation, which then go first. The checkpoint of step
    `keep` (the best one) stays and, unless it is the latest, does not count against the limit. A checkpoint moved
    aside by a save killed before its replacement was renamed into place (`.old-checkpoint-<step>`) is put back.

    Called by rank 0 after a save completed, when no other save is in flight."""
    removed = []
    folder = checkpoints_dir(run_dir)
    for p in folder.glob(".tmp-checkpoint-*") if folder.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)  # left by a run killed while saving; no save is in flight now
        removed.append(p)
    removed += restore_moved(run_dir)
    found = complete_checkpoints(run_dir)
    if not found:
        return removed
    latest = latest if latest is not None and latest in found else found[-1]
    others = [p for p in found if p != latest and p.name != f"checkpoint-{keep}"]
    if total_limit is not None and len(others) + 1 > total_limit:
        step = lambda p: int(CHECKPOINT_RE.match(p.name).group(1))  # noqa: E731
        # kept first: the newest ones before the latest; an abandoned continuation's steps (above it) go first
        order = sorted(others, key=lambda p: (step(p) > step(latest), -step(p)))
        for p in order[max(total_limit - 1, 0):]:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def restore_moved(run_dir: Path) -> list[Path]:
    """Put back a checkpoint that a save killed mid-replacement left as `.old-checkpoint-<step>` (`_install`), or
    remove it when its replacement is in place; returns what was removed. Call only while no save is in flight."""
    folder = checkpoints_dir(run_dir)
    removed = []
    for p in folder.glob(".old-checkpoint-*") if folder.is_dir() else []:
        final = folder / p.name.removeprefix(".old-")
        if final.exists():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        else:
            os.replace(p, final)
    return removed


def resolve_resume(run_dir: Path, resume: str | None) -> Path | None:
    """The checkpoint to resume from: None, the latest complete one (`auto`), or a given path. Raises ConfigError
    for a path that holds no complete checkpoint."""
    from vlmctl.errors import ConfigError

    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"train.resume = {resume}: no complete checkpoint there (trainer_state.json is missing)",
                          hint="use train.resume=auto, or a checkpoints/checkpoint-<step> folder of a run")
    return path

def resume(checkpoint: Path, *, rank: int, world_size: int, engine, objective=None) -> dict[str, Any]:
    """`load` for resuming a run on `world_size` ranks; returns trainer_state.json.

    DCP reshards weights and optimizer state onto another world size (rank 0 says so; the loop rescales its per-rank
    data position, `loop.TrainState.from_checkpoint`, so the run continues at the same global micro-batch; the
    steps see the same samples when ranks x gradient_accumulation_steps is unchanged); an engine that does not
    reshard (`Engine.reshards`: DeepSpeed) raises ConfigError. `objective.load_state_dict` gets this rank's
    objective-<rank>.pt (weights-only load) when the checkpoint has one and was written by as many ranks (a per-rank
    state does not reshard); CheckpointError names a damaged one.
    """
    import sys

    from vlmctl import checkpoints as safe
    from vlmctl.errors import ConfigError

    saved = load(checkpoint, rank=rank, engine=engine)
    written = saved.get("world_size")
    if written != world_size:
        if not engine.reshards:
            raise ConfigError(f"{checkpoint} was written by {written} ranks; {saved.get('strategy') or 'this strategy'} resumes with the same number",
                              hint=f"launch with {written} processes in total")
        if rank == 0:
            print(f"note: {checkpoint} was written by {written} ranks, resuming with {world_size}: weights and "
                  "optimizer state resharded, data continued at the same global micro-batch", file=sys.stderr)
    state_file = Path(checkpoint) / f"objective-{rank}.pt"
    from vlmctl.train.objectives import has_hook

    if written == world_size and has_hook(objective, "state") and state_file.is_file():
        objective.load_state_dict(safe.load_tensors(state_file))
    return saved


class Saver:
    """The `save(step, state, reason)` callback of the step loop: a collective checkpoint of the engine (model,
    optimizer, scheduler) with trainer_state.json = `info` + the loop's position, then `notify(path)`."""

    def __init__(self, run_dir: Path, *, rank: int, engine, total_limit: int | None,
                 batches_per_epoch: int, info: dict[str, Any], notify=None, objective=None):
        self.run_dir, self.rank, self.total_limit = Path(run_dir), rank, total_limit
        self.engine, self.objective = engine, objective
        self.batches_per_epoch, self.info, self.notify = batches_per_epoch, info, notify

    def __call__(self, step: int, state, reason: str) -> Path:
        """`state`: the loop's TrainState (consumed micro-batches per rank, bad steps, tokens seen)."""
        info = {"step": step, "epoch": state.consumed / self.batches_per_epoch, "consumed_micro_batches": state.consumed,
                "bad_steps": state.bad_steps, "tokens_seen": state.tokens, "reason": reason, **self.info}
        if state.best is not None:  # validation's best so far (`train.eval_steps`), its checkpoint kept
            info["best"] = state.best
        keep = state.best["step"] if state.best and state.best.get("save_best") else None
        path = save(self.run_dir, step, info, rank=self.rank, engine=self.engine, total_limit=self.total_limit, keep=keep,
                    objective=self.objective)
        if self.notify is not None and reason != "signal":  # the stop message names the checkpoint
            from rich.markup import escape

            self.notify(f"saved {escape(str(path))}")  # printed by rich: a folder name may hold [...]
        return path
