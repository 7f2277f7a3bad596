"""Throughput rows leave checkpoint time out (`save_s` apart)."""

from __future__ import annotations

import time


def test_checkpoint_time_is_left_out_of_tokens_per_s(monkeypatch):
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

    def batch() -> dict:
        ids = torch.tensor([[1, 2, 3, 4]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(), "num_label_tokens": 3,
                "num_text_tokens": 4, "num_visual_tokens": 0, "num_dummy_images": 0}

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed()
    try:
        model = Tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        rows, saves = [], []

        def save(step, state, reason):  # a slow checkpoint after steps 2 and 4
            saves.append(step)
            time.sleep(0.5)

        trainer = Trainer(engine=TorchEngine(model, opt, sched, max_grad_norm=0.0, device=env.device), objective=SFTObjective(),
                          batches=(batch() for _ in range(100)), env=env, state=TrainState(), total_steps=4, grad_accum=1,
                          batches_per_epoch=100, save_steps=2, logging_steps=2, max_bad_steps=0, save=save,
                          log=rows.append, progress=type("P", (), {"update": lambda *a: None})())
        assert trainer.train() == "done"
    finally:
        dist.destroy_process_group()
    assert saves == [2, 4] and [r["step"] for r in rows] == [2, 4]
    assert rows[0]["save_s"] == 0.0
    after = rows[1]  # the interval that holds the save of checkpoint 2
    assert 0.45 <= after["save_s"] < 2.0
    assert after["step_time_s"] * 2 < 0.45  # two tiny steps, without the half-second save
    assert after["tokens_per_s"] > 8 / 0.45
