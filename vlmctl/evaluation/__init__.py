"""`vlmctl eval`: generation on a validation set or benchmark file, standard metrics, reports.

- `metrics`: VQA accuracy, ANLS, relaxed accuracy, multiple-choice accuracy, BLEU-4, CIDEr (pure functions).
- `runner`: load samples and a model, generate (greedy, batched, left padding), score, write the output folder.
- `report`: the HTML page with example images, predictions and references.
"""

from __future__ import annotations
