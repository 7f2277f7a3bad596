"""The pieces of validation during training: how val samples are dealt to ranks, the best so far, the config
keys, and what the metrics sinks make of a validated row."""

from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_every_val_sample_is_counted_once_and_every_rank_runs_as_many_batches(packing, ranks):
    from vlmctl.train.validation import val_batches

    lengths = np.array([90, 30, 120, 60, 10, 200, 75, 40, 33])  # 200 is longer than a packed row of 128
    dealt = [val_batches(lengths, packing=packing, budget=128, micro_batch_size=2, dp_size=ranks, dp_rank=r)
             for r in range(ranks)]
    assert len({len(d) for d in dealt}) == 1
    counted = sorted(i for d in dealt for b, c in d if c for i in b)
    assert counted == ([0, 1, 2, 3, 4, 6, 7, 8] if packing else list(range(9)))
    if packing:
        assert all(lengths[b].sum() <= 128 for d in dealt for b, _ in d)
    else:
        assert all(len(b) <= 2 for d in dealt for b, _ in d)


def test_a_rank_without_a_batch_of_its_own_repeats_the_first_uncounted():
    from vlmctl.train.validation import val_batches

    dealt = [val_batches(np.array([10, 10]), packing=False, budget=0, micro_batch_size=2, dp_size=2, dp_rank=r)
             for r in range(2)]
    assert dealt == [[([0, 1], True)], [([0, 1], False)]]


def test_best_takes_only_improvements_and_counts_the_rest():
    from vlmctl.train.validation import Best

    best = Best()
    assert [best.update(v, s) for s, v in [(2, 3.0), (4, 2.5), (6, 2.7), (8, float("nan")), (10, 2.5)]] == \
        [True, True, False, False, False]
    assert (best.value, best.step, best.evals_since) == (2.5, 4, 3)
    again = Best.from_state(json.loads(json.dumps(best.as_dict())), "val_loss", save_best=True)
    assert (again.value, again.step, again.evals_since, again.save_best) == (2.5, 4, 3, True)
    assert Best.from_state(None, "val_loss", save_best=False).value is None


def test_save_best_and_patience_need_eval_steps():
    from pydantic import ValidationError

    from vlmctl.config.train import TrainSection

    for key in ("save_best", "early_stopping_patience"):
        value = "val_loss" if key == "save_best" else 2
        with pytest.raises(ValidationError, match="train.eval_steps"):
            TrainSection(**{key: value})
        assert getattr(TrainSection(eval_steps=10, **{key: value}), key) == value
    with pytest.raises(ValidationError):
        TrainSection(eval_steps=10, save_best="accuracy")


def test_the_step_line_and_the_trackers_show_validation(tmp_path):
    from vlmctl.train.metrics import format_row, plot_loss, tracker_tag

    row = {"step": 4, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 10.0, "text_tokens_per_s": 5.0,
           "visual_tokens_per_s": 5.0, "val_loss": 2.25, "best_val_loss": 2.125, "best_step": 2}
    assert "val loss 2.2500 (best 2.1250 at step 2)" in format_row(row)
    assert "val loss 2.1250 (best)" in format_row({**row, "val_loss": 2.125, "best_step": 4})
    assert "val loss" not in format_row({k: v for k, v in row.items() if not k.startswith(("val", "best"))})
    assert tracker_tag("val_loss") == "eval/loss" and tracker_tag("loss") == "train/loss"
    lines = [{**row, "step": s, "loss": 3.0 - s / 10} for s in range(1, 5)]
    for r in lines[:3]:
        del r["val_loss"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    import matplotlib.pyplot as plt

    drawn = []
    real = plt.Axes.plot
    plt.Axes.plot = lambda self, *a, **k: drawn.append(k.get("label")) or real(self, *a, **k)
    try:
        assert plot_loss(tmp_path).is_file()
    finally:
        plt.Axes.plot = real
    assert drawn == ["loss", "val loss", "best", "lr"]


def test_pruning_keeps_the_best_checkpoint_and_the_latest(tmp_path):
    from vlmctl.train.checkpoint import STATE_FILE, complete_checkpoints, prune

    for step in (2, 4, 6, 8):
        (tmp_path / "checkpoints" / f"checkpoint-{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"checkpoint-{step}" / STATE_FILE).write_text("{}")
    prune(tmp_path, 1, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-8"]
    prune(tmp_path, 1, keep=8)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-8"]
