"""ORPO (`vlmctl.train.orpo`): the odds-ratio term, its metrics and gradients equal TRL's `ORPOTrainer.odds_ratio_loss`
on the same length-normalised log-probs, the whole loss of a pair equals TRL's NLL minus its odds-ratio term (the
prompt's labels masked), and the objective trains padded pairs as their packed rows on a tiny LLaVA."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vlmctl.train.dpo import pair_segments, segment_logps
from vlmctl.train.orpo import orpo_loss

from test_dpo import make_pairs, packed_layout, trl_layout

trl = pytest.importorskip("trl")
from trl.experimental.orpo.orpo_trainer import ORPOTrainer  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-6}


def trl_odds_ratio(chosen_logps, rejected_logps, beta):
    """TRL's ORPOTrainer.odds_ratio_loss on length-normalised log-probs [P]."""
    t = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=torch.device("cpu")))
    return ORPOTrainer.odds_ratio_loss(t, chosen_logps, rejected_logps)


def ours(seqs, beta):
    """vlmctl's per-pair ORPO outputs from the packed row of `seqs` (per-token log-probs as leaves)."""
    logps, labels, lens = packed_layout(seqs, "policy")
    sums, counts = segment_logps(logps, labels, lens)
    chosen, rejected = pair_segments(sums, len(seqs) // 2)
    n_chosen, n_rejected = pair_segments(counts, len(seqs) // 2)
    return orpo_loss(chosen, rejected, n_chosen, n_rejected, beta=beta)


def trl_mean_logps(seqs):
    """TRL's `get_batch_logps(..., average_log_prob=True)` of its padded [chosen; rejected] batch: (chosen [P],
    rejected [P])."""
    logps, mask = trl_layout(seqs, "policy")
    shifted = mask[:, 1:].float()
    per_seq = (logps[:, : shifted.shape[1]] * shifted).sum(-1) / shifted.sum(-1)
    pairs = len(seqs) // 2
    return per_seq[:pairs], per_seq[pairs:]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_odds_ratio_term_its_metrics_and_gradients_equal_trl(seed):
    seqs = make_pairs(seed)
    out = ours(seqs, beta=0.25)
    losses, chosen_rewards, rejected_rewards, ratio, log_odds = trl_odds_ratio(*trl_mean_logps(seqs), beta=0.25)
    torch.testing.assert_close(0.25 * out.ratio, losses, **TOL)
    torch.testing.assert_close(out.chosen_rewards, chosen_rewards, **TOL)
    torch.testing.assert_close(out.rejected_rewards, rejected_rewards, **TOL)
    assert float(out.ratio.detach().mean()) == pytest.approx(float(ratio.detach()), rel=1e-5)
    assert float(out.log_odds.detach().mean()) == pytest.approx(float(log_odds.detach()), rel=1e-5, abs=1e-6)
    leaves = [s["policy"] for s in seqs]
    want = torch.autograd.grad(-losses.mean(), leaves)
    got = torch.autograd.grad(-(0.25 * out.ratio).mean(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert any(float(g.abs().sum()) > 0 for g in got)


def test_a_pairs_loss_is_trls_nll_minus_its_odds_ratio_term():
    # one pair: TRL's NLL (the mean over the chosen sequence's labelled tokens) is its answer's mean token NLL
    for seed in range(3):
        seqs = make_pairs(seed, n_pairs=1)
        out = ours(seqs, beta=0.1)
        chosen_logps, rejected_logps = trl_mean_logps(seqs)
        losses, *_ = trl_odds_ratio(chosen_logps, rejected_logps, beta=0.1)
        expected = -chosen_logps.mean() - losses.mean()  # TRL: policy_nll_loss - losses.mean()
        torch.testing.assert_close(out.losses.mean(), expected, **TOL)
        want = torch.autograd.grad(expected, seqs[0]["policy"])[0]
        torch.testing.assert_close(torch.autograd.grad(out.losses.mean(), seqs[0]["policy"])[0], want, **TOL)
    with pytest.raises(ValueError, match="beta must be > 0"):
        orpo_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), torch.ones(1), beta=0.0)


def test_log1mexp_is_stable_on_both_sides_of_minus_log_2():
    from vlmctl.train.orpo import log1mexp

    x = torch.tensor([-1e-6, -0.5, -0.6931471805599453, -1.0, -30.0], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), torch.log(1 - torch.exp(x)), rtol=1e-9, atol=1e-12)
    assert math.isfinite(float(log1mexp(torch.tensor(-1e-12))))


def test_the_objective_trains_padded_pairs_as_their_packed_rows(tiny_llava):
    from vlmctl.config.objective import ORPOSection
    from vlmctl.data.collate import PaddedPairCollator, PairCollator, model_inputs
    from vlmctl.models import load_model
    from vlmctl.train.objectives import check_batch
    from vlmctl.train.orpo import ORPOObjective

    from preference_data import pair_samples

    model, processor, family = load_model(tiny_llava, dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    objective = ORPOObjective(ORPOSection(beta=0.2))
    engine = SimpleNamespace(model=model, module=model, inputs=model_inputs)
    samples = pair_samples(3)
    packed = objective.loss(engine, PairCollator(processor, family, tokens_per_batch=10**6, dummy_image=False)(samples))
    packed.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    batch = PaddedPairCollator(processor, family, dummy_image=False)(samples)
    check_batch(objective, batch)  # the keys the loop asks of the first window
    padded = objective.loss(engine, batch)
    padded.loss.backward()
    assert packed.tokens == padded.tokens == 3
    torch.testing.assert_close(padded.loss, packed.loss, rtol=1e-4, atol=1e-6)
    logged = objective.metrics({k: float(v) for k, v in padded.metrics.items()}, 3)
    assert set(logged) == set(ORPOObjective.METRICS) and 0.0 <= logged["rewards/accuracies"] <= 1.0
    assert logged["nll_loss"] > 0 and logged["log_odds_ratio"] < 0
    for name, grad in want.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-6)


def test_orpo_is_one_registered_objective_with_its_section():
    from vlmctl.config import TrainSection
    from vlmctl.config.objective import objective_card
    from vlmctl.train.registry import get_objective

    spec = get_objective("orpo")
    assert (spec.data, spec.workload, spec.frozen(TrainSection(objective="orpo")), spec.hooks) == ("preference", "pairs", (), frozenset())
    assert spec.run_word(TrainSection(objective="orpo")) == "orpo"
    assert objective_card({"objective": "orpo", "orpo": {"beta": 0.5}}) == "orpo (beta 0.5, no reference model; arXiv 2403.07691)"
    with pytest.raises(ValueError, match="set train.sequence_parallel: 1"):
        TrainSection(objective="orpo", sequence_parallel=2)


def test_orpo_is_named_only_in_its_module_its_registry_line_and_its_config_section():
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "vlmctl"
    naming = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py") if "orpo" in p.read_text().lower())
    assert naming == ["config/objective.py", "config/train.py", "train/orpo.py", "train/registry.py"]
