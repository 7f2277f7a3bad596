"""Straggler figures: per-rank forward + backward time and data-loader wait, turned into the rows' `balance` and
`data_wait` (`vlmctl.train.metrics.straggler_stats`), and the step loop's own timers on one process."""

from __future__ import annotations

import time

import pytest

from vlmctl.train.loop import StepResult
from vlmctl.train.metrics import format_row, straggler_stats


def _step(compute, data_wait, flops) -> StepResult:
    return StepResult(loss=1.0, grad_norm=1.0, label_tokens=1, text_tokens=1, visual_tokens=0, dummy_images=0,
                      samples=1, stop=False, bad=False, rank_compute_s=compute, rank_data_wait_s=data_wait,
                      rank_flops=flops)


def test_balance_is_the_mean_over_the_slowest_rank_summed_over_steps_and_data_wait_names_its_rank():
    steps = [_step([1.0, 2.0, 3.0], [0.0, 0.5, 0.1], [10.0, 20.0, 30.0]),
             _step([3.0, 3.0, 3.0], [0.0, 1.5, 0.1], [30.0, 30.0, 30.0])]
    stats = straggler_stats(steps, seconds=10.0)
    # the two steps take 3 s + 3 s of compute on the slowest rank; the average rank works 2 s + 3 s of them
    assert stats["balance"] == pytest.approx((2.0 + 3.0) / (3.0 + 3.0))
    assert stats["balance_flops"] == pytest.approx((20.0 + 30.0) / (30.0 + 30.0))
    assert stats["data_wait_rank"] == 1 and stats["data_wait"] == pytest.approx(2.0 / 10.0)
    assert stats["rank_compute_s"] == pytest.approx([2.0, 2.5, 3.0])
    assert stats["rank_data_wait_s"] == pytest.approx([0.0, 1.0, 0.1])
    assert stats["rank_sync_s"] == pytest.approx([3.0, 1.5, 1.9])  # 5 s per step less compute and data wait
    line = format_row({"loss": 1.0, "lr": 1e-4, "tokens_per_s": 1, "text_tokens_per_s": 1, "visual_tokens_per_s": 0, **stats})
    assert "balance 83.3%" in line and "data wait 20.0% (rank 1)" in line
    assert straggler_stats([_step([], [], [])], seconds=1.0) == {}  # a result without per-rank figures


def test_one_process_times_its_data_wait_apart_from_its_compute(monkeypatch):
    """A batch iterator that sleeps before each batch: the sleep is data wait, not forward + backward time."""
    import torch
    import torch.distributed as dist

    from vlmctl.distributed.env import init_distributed
    from vlmctl.distributed.engine import TorchEngine
    from vlmctl.train.loop import Trainer, TrainState
    from vlmctl.train.objectives import SFTObjective

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8)

        def forward(self, input_ids, attention_mask=None, use_cache=None):
            return type("Out", (), {"logits": self.head(self.emb(input_ids))})()

    def slow_batches(delay: float):
        while True:
            time.sleep(delay)
            ids = torch.tensor([[1, 2, 3, 4]])
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
                   "num_label_tokens": 3, "num_text_tokens": 4, "num_visual_tokens": 0, "num_dummy_images": 0}

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed()
    try:
        model = Tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        rows = []
        trainer = Trainer(engine=TorchEngine(model, opt, sched, max_grad_norm=0.0, device=env.device), objective=SFTObjective(),
                          batches=slow_batches(0.3), env=env, state=TrainState(), total_steps=2, grad_accum=2,
                          batches_per_epoch=100, save_steps=100, logging_steps=2, max_bad_steps=0, save=lambda *a: None,
                          log=rows.append, progress=type("P", (), {"update": lambda *a: None})(),
                          flops_of=lambda batch: 100.0)
        assert trainer.train() == "done"
    finally:
        dist.destroy_process_group()
    (row,) = rows
    # two micro-batches a step, each 0.3 s late: at least 0.6 s of data wait per step, most of the step time
    assert row["rank_data_wait_s"][0] >= 0.55 and row["data_wait"] > 0.6 and row["data_wait_rank"] == 0
    assert 0 < row["rank_compute_s"][0] < 0.3  # a 4-token forward and backward, not the sleep
    assert row["balance"] == 1.0 and row["balance_flops"] == 1.0  # one rank is balanced with itself
