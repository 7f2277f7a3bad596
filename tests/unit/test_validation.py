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


def _drawn(run_dir, **kwargs):
    """plot_loss(run_dir, **kwargs) with every Axes.plot label and axvline x recorded."""
    import matplotlib.pyplot as plt

    from vlmctl.train.metrics import plot_loss

    drawn, lines = [], []
    real_plot, real_vline = plt.Axes.plot, plt.Axes.axvline
    plt.Axes.plot = lambda self, *a, **k: drawn.append(k.get("label")) or real_plot(self, *a, **k)
    plt.Axes.axvline = lambda self, x=0, *a, **k: lines.append(x) or real_vline(self, x, *a, **k)
    try:
        assert plot_loss(run_dir, **kwargs).is_file()
    finally:
        plt.Axes.plot, plt.Axes.axvline = real_plot, real_vline
    return drawn, lines


def test_loss_png_draws_the_objectives_curves_the_best_step_and_the_early_stop(tmp_path):
    from vlmctl.train.registry import get_objective

    dpo = get_objective("dpo")
    rows = [{"step": s, "loss": 0.7 - s / 100, "lr": 1e-4, "rewards/margins": s / 10, "rewards/accuracies": 0.5 + s / 20,
             "rewards/chosen": s / 20, "rewards/rejected": -s / 20} for s in range(1, 7)]
    rows[2].update(val_loss=0.65, best_val_loss=0.65, best_step=3, **{"val_rewards/margins": 0.25})
    rows[5].update(val_loss=0.66, best_val_loss=0.65, best_step=3, early_stop=True, **{"val_rewards/margins": 0.2})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn, lines = _drawn(tmp_path, curves=dpo.curves, loss=dpo.plots_loss)
    assert drawn == ["loss", "val loss", "best", "lr", "rewards/margins", "val rewards/margins", "rewards/accuracies",
                     "rewards/chosen", "rewards/rejected"]  # the last two in one panel
    assert lines == [6]  # the early stop
    # GRPO: its loss is ~0 by construction; the reward is drawn instead
    grpo = get_objective("grpo")
    rows = [{"step": s, "loss": 1e-8, "lr": 1e-6, "reward": s / 10, "reward_std": 0.3, "completions/mean_length": 5.0}
            for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn, _ = _drawn(tmp_path, curves=grpo.curves, loss=grpo.plots_loss)
    assert drawn == ["reward", "reward_std", "completions/mean_length"]


def test_dpo_validation_logs_the_val_rewards_as_trl_does(monkeypatch):
    import torch
    import torch.distributed as dist

    from vlmctl.config.objective import DPOSection
    from vlmctl.distributed.env import init_distributed
    from vlmctl.train.dpo import DPOObjective
    from vlmctl.train.objectives import MicroLoss
    from vlmctl.train.validation import Best, Validator

    class Engine:  # each val micro-batch of 2 pairs: summed loss and rewards as DPOObjective.loss sums them
        model = torch.nn.Linear(1, 1)

        def forward(self, objective, batch):
            k = float(batch["k"])
            return MicroLoss(loss=torch.tensor(2 * k), tokens=2, metrics={
                "rewards/chosen": torch.tensor(k), "rewards/rejected": torch.tensor(-k),
                "rewards/margins": torch.tensor(2 * k), "rewards/accuracies": torch.tensor(1.0)})

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed()
    try:
        validator = Validator(engine=Engine(), objective=DPOObjective(DPOSection()), device=env.device, eval_steps=1,
                              batches=[([0], True), ([1], True), ([0], False)], best=Best(),
                              load=lambda indices: {"k": torch.tensor(indices[0] + 1.0), "num_pairs": 2})
        row = validator.evaluate(step=1)
    finally:
        dist.destroy_process_group()
    # 4 pairs counted (the third batch is a rank's uncounted repeat): means over them
    assert row["val_loss"] == pytest.approx((2 + 4) / 4)
    assert row["val_rewards/margins"] == pytest.approx((2 + 4) / 4) and row["val_rewards/chosen"] == pytest.approx(3 / 4)
    assert row["val_rewards/accuracies"] == pytest.approx(2 / 4) and row["val_label_tokens"] == 4
