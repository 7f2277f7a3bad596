"""Odds ratio preference optimisation (ORPO, Hong et al. 2024, arXiv 2403.07691): a preference objective without a
reference model, the chosen answer's NLL plus a weighted odds-ratio term.

    out = orpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, beta=0.1)   # summed answer log-probs [P]
    out.losses   # [P]: nll + beta x L_OR per pair

For pair i with answers y_w (chosen) and y_l (rejected) of |y| tokens, the length-normalised log-probability
log P(y|x) = (sum of the answer tokens' log-probs) / |y| (Eq. 4, TRL's `average_log_prob=True`) and

    log odds(y|x) = log P(y|x) - log(1 - P(y|x))                                 (Eq. 4)
    L_OR = -log sigma(log odds(y_w|x) - log odds(y_l|x))                         (Eq. 7)
    loss_i = -log P(y_w|x) + beta x L_OR                                         (Eq. 6: L_SFT + lambda L_OR)

log(1 - P) is `log1mexp`, computed as TRL's `ORPOTrainer` computes it. The step's loss is the mean of loss_i over
the global batch's pairs (the loop divides by pairs). Two choices differ from TRL's `ORPOTrainer`, as vlmctl's DPO
with `rpo_alpha` does: the NLL term is each chosen answer's mean token NLL per pair (TRL: the mean over every token
of the batch's chosen sequences, the prompt's included; the paper's L_SFT is the answer's NLL); for one pair with
the prompt's labels masked the two are the same. Logged (TRL's names): rewards/chosen and rewards/rejected (beta x
the length-normalised log-probs), rewards/margins, rewards/accuracies, nll_loss, log_odds_ratio (the mean of
log sigma(log odds ratio)) and log_odds_chosen (the mean log odds ratio).

Pairs are trained as DPO's: packed rows of two segments per pair or padded rows (`dpo.pair_collator`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmctl.config.objective import ORPOSection
from vlmctl.train.dpo import PAIR_STEP_LINE, pair_collator, pair_segments, segment_logps_at
from vlmctl.train.objectives import MicroLoss, ObjectiveSpec, labelled_logps

# torch is imported inside the functions that use it: the registry imports this module, and importing vlmctl (the
# CLI's start-up) must not pay for it.


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (TRL's `log1mexp`, Maechler 2012)."""
    import torch

    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass
class ORPOOutput:
    """`losses` [P] (with grad); `nll` [P], the chosen answers' mean token NLL; `ratio` [P], log sigma(log odds
    ratio); `log_odds` [P]; `chosen_rewards` / `rejected_rewards` [P]: beta x length-normalised log-probs
    (detached)."""

    losses: Any
    nll: Any
    ratio: Any
    log_odds: Any
    chosen_rewards: Any
    rejected_rewards: Any


def orpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, *, beta: float = 0.1) -> ORPOOutput:
    """ORPO's per-pair loss (module docstring) from the summed answer log-probs of the chosen and rejected answers
    (`chosen`, `rejected`: [P] float, nats) and their token counts ([P], clamped to >= 1). Raises ValueError for
    beta <= 0."""
    import torch.nn.functional as F

    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen_mean = chosen.float() / chosen_tokens.clamp(min=1).to(chosen.device).float()
    rejected_mean = rejected.float() / rejected_tokens.clamp(min=1).to(rejected.device).float()
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    ratio = F.logsigmoid(log_odds)
    nll = -chosen_mean
    return ORPOOutput(losses=nll - beta * ratio, nll=nll, ratio=ratio, log_odds=log_odds,
                      chosen_rewards=beta * chosen_mean.detach(), rejected_rewards=beta * rejected_mean.detach())


@dataclass
class ORPOObjective:
    """ORPO on pairs (the module docstring): each sequence's answer log-prob summed from its labelled positions
    (`objectives.labelled_logps`, as DPO's), no reference model. `settings`: the `train.orpo` section (beta).
    `label_tokens` counts pairs, so the step's loss is the mean over pairs."""

    settings: Any
    name: str = "orpo"
    batch_keys: tuple[str, ...] = ("input_ids", "labels", "num_pairs")
    models: dict[str, Any] = field(default_factory=dict)

    METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "nll_loss",
               "log_odds_ratio", "log_odds_chosen")

    def label_tokens(self, batch: dict[str, Any]) -> int:
        return batch["num_pairs"]

    def loss(self, engine, batch: dict[str, Any]) -> MicroLoss:
        values, positions, seq_lens = labelled_logps(engine.model, engine.inputs(batch), batch)
        sums, counts = segment_logps_at(values, positions, seq_lens)
        pairs = batch["num_pairs"]
        if pairs == 0:  # a row of dummies only: keep every parameter in the graph, add nothing
            return MicroLoss(loss=sums.sum() * 0.0, tokens=0, metrics={k: 0.0 for k in self.METRICS})
        chosen, rejected = pair_segments(sums, pairs)
        n_chosen, n_rejected = pair_segments(counts, pairs)
        out = orpo_loss(chosen, rejected, n_chosen, n_rejected, beta=self.settings.beta)
        margins = out.chosen_rewards - out.rejected_rewards
        metrics = {"rewards/chosen": out.chosen_rewards.sum(), "rewards/rejected": out.rejected_rewards.sum(),
                   "rewards/margins": margins.sum(), "rewards/accuracies": (margins > 0).float().sum(),
                   "nll_loss": out.nll.detach().sum(), "log_odds_ratio": out.ratio.detach().sum(),
                   "log_odds_chosen": out.log_odds.detach().sum()}
        return MicroLoss(loss=out.losses.sum(), tokens=pairs, metrics=metrics)

    def metrics(self, sums: dict[str, float], label_tokens: float) -> dict[str, float]:
        """Means over the step's pairs."""
        return {key: sums[key] / label_tokens for key in self.METRICS if key in sums and label_tokens}


def build_orpo(tm, train, ctx, cfg=None, run_dir=None, reference_model=None) -> ORPOObjective:
    """ORPO of a run: `train.orpo`; no frozen model (`reference_model` is not used)."""
    return ORPOObjective(settings=train.orpo)


SPEC = ORPOObjective.spec = ObjectiveSpec(
    name="orpo", objective=ORPOObjective, build=build_orpo, collator=pair_collator, data="preference", workload="pairs",
    section=ORPOSection, step_line=(*PAIR_STEP_LINE, ("nll_loss", "nll {:.3f}"), ("log_odds_chosen", "log odds {:.3f}")),
    curves=("rewards/margins", "rewards/accuracies", ("rewards/chosen", "rewards/rejected"), "nll_loss"))
