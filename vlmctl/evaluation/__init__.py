"""`vlmctl eval`: generation on a validation set or benchmark file, standard metrics, reports.

    from vlmctl.evaluation import load_samples, run_eval

    samples = load_samples("val", prepared_dir, limit=200)
    result = run_eval(model_dir, samples, task="vqa", out_dir=Path("outputs/eval/run1-vqa"))
    result.metrics                               # {"vqa_accuracy": ..., "exact_match": ...}

- `metrics`: VQA accuracy, ANLS, relaxed accuracy, multiple-choice accuracy, BLEU-4, CIDEr (pure functions).
- `runner`: load samples (and the ones skipped, with reasons), answer them through `vlmctl.inference` (or score a
  predictions file), score, write a new output folder; shards samples over torchrun ranks.
- `loss`: teacher-forced loss / perplexity on assistant tokens (`--task loss`).
- `results`: `EvalResult` and the atomic write both `runner` and `report` use.
- `report`: the HTML page with example images, predictions and references.
- `lmms`: run the lmms-eval harness and fold its scores into metrics.json.

Submodules import each other, never this package, so importing any one of them has no cycle.
"""

from __future__ import annotations

from vlmctl.evaluation.loss import teacher_forced_loss
from vlmctl.evaluation.results import EvalResult, SampleList
from vlmctl.evaluation.runner import (
    default_output_dir,
    fold_into_metrics,
    load_samples,
    read_predictions,
    references_of,
    resolve_task,
    run_eval,
    score_predictions_file,
    unique_output_dir,
    write_outputs,
)

__all__ = [
    "EvalResult", "SampleList", "default_output_dir", "fold_into_metrics", "load_samples",
    "read_predictions", "references_of", "resolve_task", "run_eval", "score_predictions_file", "teacher_forced_loss",
    "unique_output_dir", "write_outputs",
]
