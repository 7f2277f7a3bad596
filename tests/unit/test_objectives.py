"""`train.objectives`: the loop trains any `Objective` it is given (none by name): its token count normalises the
loss, its extra metrics reach the metrics rows, and batches without its keys stop the run with a DataError."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


def test_the_step_line_shows_each_objectives_own_metrics():
    from vlmctl.train.metrics import format_row
    from vlmctl.train.registry import get_objective

    base = {"step": 3, "loss": 0.6, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 100.0, "text_tokens_per_s": 80.0,
            "visual_tokens_per_s": 20.0}
    dpo = {**base, "rewards/chosen": 0.12, "rewards/rejected": -0.08, "rewards/margins": 0.2, "rewards/accuracies": 0.75}
    line = format_row(dpo, get_objective("dpo").step_line)
    assert "margin 0.200 | acc 0.75 | chosen +0.120 | rejected -0.080" in line and "nll" not in line
    assert "nll 0.310" in format_row({**dpo, "nll_loss": 0.31}, get_objective("dpo").step_line)
    grpo = {**base, "reward": 0.5, "reward_std": 0.25, "kl": 0.0012, "clip_ratio/region_mean": 0.05,
            "completions/mean_length": 7.5, "time/rollout_s": 1.5, "time/train_s": 0.25}
    line = format_row(grpo, get_objective("grpo").step_line)
    for words in ("reward 0.500", "std 0.250", "kl 0.0012", "clipped 0.050", "length 7.5", "rollout 1.50s", "train 0.25s"):
        assert words in line, words
    assert format_row(dpo, get_objective("sft").step_line) == format_row(dpo)  # SFT adds nothing


def test_the_demo_summary_says_what_its_final_loss_sums(capsys):
    from vlmctl.cli.demo import _render_post
    from vlmctl.config.objective import DPOSection, GRPOSection
    from vlmctl.demo import DemoResult
    from vlmctl.demo_post import PostDemoResult

    before = DemoResult(folder=Path("demo"), launcher="none", nproc=1, strategy="ddp", steps=150)
    post = PostDemoResult(objective="dpo", before=before, steps=60, final_loss=0.733,
                          loss_terms=DPOSection(rpo_alpha=1.0).loss_terms(), metrics={"rewards/accuracies": 0.969})
    _render_post(post, {})
    text = " ".join(capsys.readouterr().out.split())
    assert "final loss 0.733 (the sigmoid DPO loss + rpo_alpha 1 x the chosen answers' mean token NLL (nll_loss))" in text
    assert DPOSection().loss_terms() == "the sigmoid DPO loss" and "about 0" in GRPOSection().loss_terms()


def test_an_objective_declares_the_fused_loss_exactly_when_its_loss_hands_the_model_labels(tiny_llava):
    # `ObjectiveSpec.fused_loss` decides whether training compiles liger's fused loss before the first step: it must
    # hold for the objectives whose loss is the model's forward given labels (what liger patches), and only for them.
    import torch

    from vlmctl.config.objective import ORPOSection
    from vlmctl.data.collate import PairCollator, model_inputs
    from vlmctl.models import load_model
    from vlmctl.train.objectives import SFTObjective
    from vlmctl.train.orpo import ORPOObjective

    from preference_data import pair_samples

    model, processor, family = load_model(tiny_llava, dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("labels") is not None),
                                    with_kwargs=True)
    engine = type("Engine", (), {"model": model, "module": model, "inputs": staticmethod(model_inputs)})()
    batch = PairCollator(processor, family, tokens_per_batch=10**6, dummy_image=False)(pair_samples(2))
    for objective in (SFTObjective(liger=True), ORPOObjective(ORPOSection(beta=0.2))):
        seen.clear()
        assert torch.isfinite(objective.loss(engine, batch).loss)
        assert seen and all(s == objective.spec.fused_loss for s in seen), (objective.spec.name, seen)
