"""The finished training runs of a project, and the model that chat, generate, eval and serve use when none is given.

    choice = project_model(cfg.train.output_dir, cfg.model.output_dir)
    choice.path        # the folder to load (RUN/final, RUN/export-<step> or model.output_dir)
    choice.reason      # one line naming the choice and why, for the command to print
    choice.export_from # a checkpoint to export into choice.path first (`vlmctl convert`'s default output), or None

The choice, in order:
1. Among the finished runs under `train.output_dir` (a `final/` export), the one that trained longest: the most
   tokens (`tokens_seen` of its last `metrics.jsonl` row), counting those of the run whose export it started from
   (an SFT run's for a DPO run on `RUN/final`), so a short smoke run never outweighs the run it was not built on;
   the newest of equals.
2. Within that run, its best checkpoint when `train.save_best` named one (`final/best_checkpoint.json`) before the
   last step (early stopping, or a best value that did not last): `RUN/export-<step>`, exported once from
   `RUN/checkpoints/checkpoint-<step>`. Else `RUN/final`.
3. Without a finished run, the project's model (`model.output_dir`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# PyYAML is imported inside the function that reads a run's config: the CLI's start-up does not load it through here.

METRICS_TAIL_BYTES = 1 << 16
"""How much of the end of `metrics.jsonl` is read for a run's last row (rows are under 2 KiB)."""


@dataclass
class RunSummary:
    """A finished run: its folder, the tokens it trained (`own_tokens`) and with the run it started from (`tokens`),
    its last step, its best checkpoint record (`final/best_checkpoint.json`, or None) and when it finished."""

    folder: Path
    own_tokens: int
    tokens: int
    last_step: int | None
    best: dict[str, Any] | None
    finished: float
    parent: Path | None = None


@dataclass
class ModelChoice:
    """The model a command uses when none is given (see the module docstring)."""

    path: Path
    reason: str
    export_from: Path | None = None
    run: RunSummary | None = None


def _last_row(metrics: Path) -> dict[str, Any]:
    """The last JSON row of `metrics` (a run's metrics.jsonl) that has a step; {} without one."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - METRICS_TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a partial first line of the tail, or a line cut by a kill
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            return row
    return {}


def _started_from(run: Path) -> Path | None:
    """The model folder the run trained (`model.output_dir` of its config.yaml, else `model.base`), resolved; None
    when the config cannot be read or names no local folder."""
    import yaml

    try:
        model = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("model") or {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    for key in ("output_dir", "base"):
        value = model.get(key) if isinstance(model, dict) else None
        if isinstance(value, str) and Path(value).is_absolute() and Path(value).is_dir():
            return Path(value).resolve()
    return None


def _best_record(final: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((final / "best_checkpoint.json").read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def finished_runs(train_output_dir: Path | str) -> list[RunSummary]:
    """Every run under `train_output_dir` with a `final/` export, oldest first, with its tokens counted over the
    chain of runs it started from (a run whose model is another run's export)."""
    root = Path(train_output_dir)
    if not root.is_dir():
        return []
    runs: dict[Path, RunSummary] = {}
    for final in root.glob("*/final"):
        if not final.is_dir():
            continue
        run = final.parent.resolve()
        row = _last_row(run / "metrics.jsonl")
        tokens = row.get("tokens_seen") if isinstance(row.get("tokens_seen"), int) else 0
        runs[run] = RunSummary(run, tokens, tokens, row.get("step"), _best_record(final), final.stat().st_mtime)
    for summary in runs.values():
        source = _started_from(summary.folder)
        parent = source.parent if source is not None else None
        summary.parent = parent if parent in runs and parent != summary.folder else None
    for summary in runs.values():
        seen, parent = {summary.folder}, summary.parent
        while parent is not None and parent not in seen:  # a chain SFT -> DPO -> ...; a loop is cut
            seen.add(parent)
            summary.tokens += runs[parent].own_tokens
            parent = runs[parent].parent
    return sorted(runs.values(), key=lambda r: r.finished)


def _shown(path: Path) -> str:
    """`path` relative to the current folder when it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def project_model(train_output_dir: Path | str, model_output_dir: Path | str) -> ModelChoice:
    """The model a command uses when none is given (see the module docstring), with the line that says which and
    why. Reads only small files (metrics tails, configs, best_checkpoint.json); exports nothing."""
    runs = finished_runs(train_output_dir)
    if not runs:
        path = Path(model_output_dir)
        return ModelChoice(path, f"{_shown(path)}: the project's model (model.output_dir; no finished training run in "
                                 f"{_shown(Path(train_output_dir))})")
    chosen = max(runs, key=lambda r: (r.tokens, r.finished))
    why = f"run {chosen.folder.name}"
    if len(runs) > 1:
        newest = runs[-1]
        why += f", the longest-trained of {len(runs)} finished runs ({chosen.tokens:,} tokens"
        why += f"; the newest, {newest.folder.name}, {newest.tokens:,})" if newest is not chosen else ")"
    best = chosen.best
    if best is not None and chosen.last_step is not None and best["step"] < chosen.last_step:
        checkpoint = Path(str(best.get("checkpoint") or f"checkpoints/checkpoint-{best['step']}"))
        checkpoint = checkpoint if checkpoint.is_absolute() else chosen.folder / checkpoint
        value = best.get("value")
        figure = f"{best.get('metric', 'val_loss')} {value:.4f} " if isinstance(value, (int, float)) else ""
        export = chosen.folder / f"export-{best['step']}"
        reason = (f"{_shown(export)}: the best checkpoint of {why} ({figure}at step {best['step']}; final/ is step "
                  f"{chosen.last_step})")
        if (export / "config.json").is_file():
            return ModelChoice(export, reason, run=chosen)
        if checkpoint.is_dir():
            return ModelChoice(export, reason, export_from=checkpoint, run=chosen)
    final = chosen.folder / "final"
    return ModelChoice(final, f"{_shown(final)}: the final export of {why}", run=chosen)


__all__ = ["ModelChoice", "RunSummary", "finished_runs", "project_model"]
