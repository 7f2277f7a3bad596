"""The result of an evaluation, the samples it read (and skipped), and the atomic file write every output uses
(shared by `runner` and `report`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmctl.evaluation.metrics import ScoredRecord
from vlmctl.files import atomic_write  # here for the evaluation modules that import it from this one


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
    skipped: list[dict[str, Any]] = field(default_factory=list)  # samples the reader rejected (see SampleList)

    def summary(self) -> dict[str, Any]:
        """The content of metrics.json: task, model, data, n (samples scored), metrics, and `skipped` when samples
        were skipped: {"count", "reasons": {reason: count}, "file": "skipped.jsonl"}."""
        out = {"task": self.task, "model": self.model, "data": self.data, "n": len(self.records), "metrics": self.metrics}
        if self.skipped:
            out["skipped"] = {"count": len(self.skipped), "reasons": skipped_reasons(self.skipped), "file": SKIPPED_FILE}
        return out


SKIPPED_FILE = "skipped.jsonl"


class SampleList(list):
    """The samples to evaluate (a plain list of Samples) plus `skipped`: one dict per sample the reader rejected,
    {"source", "location", "reason", "detail", "id"}, in file order."""

    def __init__(self, items=(), skipped=()):
        super().__init__(items)
        self.skipped: list[dict[str, Any]] = list(skipped)


def skipped_reasons(skipped: list[dict[str, Any]]) -> dict[str, int]:
    """{reason: count} of skipped samples, most frequent first."""
    counts: dict[str, int] = {}
    for s in skipped:
        counts[s["reason"]] = counts.get(s["reason"], 0) + 1
    return dict(sorted(counts.items(), key=lambda x: (-x[1], x[0])))


__all__ = ["EvalResult", "SKIPPED_FILE", "SampleList", "atomic_write", "skipped_reasons"]
