"""`train.objectives`: the loop trains any `Objective` it is given (none by name): its token count normalises the
loss, its extra metrics reach the metrics rows, and batches without its keys stop the run with a DataError."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


def _tiny():
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8)

        def forward(self, input_ids, attention_mask=None, use_cache=None):
            return type("Out", (), {"logits": self.head(self.emb(input_ids))})()

    torch.manual_seed(0)
    return Tiny()


def _batch(seed: int, drop: str | None = None) -> dict:
    import torch

    ids = torch.randint(0, 8, (1, 6), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(), "num_label_tokens": 5,
             "num_text_tokens": 6, "num_visual_tokens": 0, "num_dummy_images": 0}
    batch.pop(drop, None)
    return batch


@dataclass
class Doubled:
    """Another objective the loop does not know: SFT's loss and tokens doubled (so the mean is SFT's, exactly: a
    factor of 2 is exact in floating point), and a count of micro-batches as its own metric."""

    name: str = "doubled"
    batch_keys: tuple[str, ...] = ("input_ids", "labels", "num_label_tokens")

    def __post_init__(self):
        from vlmctl.train.objectives import SFTObjective

        self.sft, self.models = SFTObjective(), {}

    def label_tokens(self, batch):
        return 2 * batch["num_label_tokens"]

    def loss(self, engine, batch):
        from vlmctl.train.objectives import MicroLoss

        out = self.sft.loss(engine, batch)
        return MicroLoss(loss=2 * out.loss, tokens=2 * out.tokens, metrics={"micro_batches": 1.0})

    def metrics(self, sums, label_tokens):
        return {"micro_batches": sums["micro_batches"], "tokens_seen_by_objective": label_tokens}


def _declare_doubled():
    from vlmctl.train.objectives import ObjectiveSpec, sample_collator

    Doubled.spec = ObjectiveSpec(name="doubled", objective=Doubled, build=lambda *a, **k: Doubled(), collator=sample_collator)


_declare_doubled()  # its spec declares no hooks: the loop calls none


def _train(objective, batches, monkeypatch, steps: int = 3) -> list[dict]:
    import torch
    import torch.distributed as dist

    from vlmctl.distributed.engine import TorchEngine
    from vlmctl.distributed.env import init_distributed
    from vlmctl.train.loop import Trainer, TrainState

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed()
    try:
        model = _tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        rows: list[dict] = []
        trainer = Trainer(engine=TorchEngine(model, opt, sched, max_grad_norm=0.0, device=env.device), objective=objective,
                          batches=iter(batches), env=env, state=TrainState(), total_steps=steps, grad_accum=2,
                          batches_per_epoch=100, save_steps=100, logging_steps=1, max_bad_steps=0,
                          save=lambda *a: None, log=rows.append, progress=type("P", (), {"update": lambda *a: None})())
        trainer.train()
        return rows
    finally:
        dist.destroy_process_group()


def test_the_loop_trains_an_objective_it_does_not_know_and_logs_its_metrics(monkeypatch):
    from vlmctl.train.objectives import SFTObjective

    batches = [_batch(i) for i in range(6)]
    sft = _train(SFTObjective(), batches, monkeypatch)
    doubled = _train(Doubled(), batches, monkeypatch)
    assert [r["loss"] for r in doubled] == [r["loss"] for r in sft]  # 2 x loss over 2 x tokens: the same mean
    assert [r["grad_norm"] for r in doubled] == [r["grad_norm"] for r in sft]
    assert [r["micro_batches"] for r in doubled] == [2.0, 2.0, 2.0]  # summed over the window of 2
    assert [r["tokens_seen_by_objective"] for r in doubled] == [20.0, 20.0, 20.0]
    assert "micro_batches" not in sft[0]


def test_batches_without_the_objectives_keys_stop_the_run_naming_them(monkeypatch):
    from vlmctl.errors import DataError
    from vlmctl.train.objectives import SFTObjective

    with pytest.raises(DataError, match="needs batches with labels"):
        _train(SFTObjective(), [_batch(i, drop="labels") for i in range(6)], monkeypatch)


@pytest.mark.parametrize("train, words", [
    ({"objective": "dpo", "dpo": {"beta": 0.2, "loss_type": "ipo", "reference": "precomputed"}},
     "dpo (ipo, beta 0.2, reference precomputed; arXiv 2305.18290)"),
    ({"objective": "grpo", "grpo": {"group_size": 4, "rewards": [{"name": "exact_match"}, {"name": "format"}]}},
     "grpo (4 rollouts per prompt, rewards: exact_match, format; arXiv 2402.03300)"),
    ({"stage": "full"}, "sft (next-token cross-entropy on the assistant turns)"),
])
def test_the_model_card_names_the_objective_and_its_settings(tmp_path, train, words):
    import yaml

    from vlmctl.hub import training_summary

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"train": train}))
    assert ("objective", words) in training_summary(run).rows()
