"""The result of an evaluation and the atomic file write every output uses (shared by `runner` and `report`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmctl.evaluation.metrics import ScoredRecord


@dataclass
class EvalResult:
    """What `run_eval` / `score_predictions_file` / `fold_into_metrics` produced: the task, the model folder (or a
    label), the data name, the corpus metrics (names and scales in `vlmctl.evaluation.metrics`), the scored records,
    the output folder once written, and the wall seconds of the run."""

    task: str
    model: str
    data: str
    metrics: dict[str, float]
    records: list[ScoredRecord] = field(default_factory=list)
    out_dir: Path | None = None
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The content of metrics.json."""
        return {"task": self.task, "model": self.model, "data": self.data, "n": len(self.records), "metrics": self.metrics}


def atomic_write(path: Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` through a temporary file in the same folder and a rename, so a reader never
    sees a half-written file. Returns `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


__all__ = ["EvalResult", "atomic_write"]
