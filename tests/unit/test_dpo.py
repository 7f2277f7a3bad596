"""DPO: vlmctl's loss from packed rows equals TRL's `DPOTrainer._compute_loss` on the same per-token log-probs,
for each loss type, in value, metrics and gradient (float32, rtol 1e-5, atol 1e-6)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vlmctl.train.dpo import (DPOOutput, dpo_loss, packed_dpo_loss, pair_segments, segment_logps, token_logps)

trl = pytest.importorskip("trl")
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-6}


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x

    gather = gather_for_metrics


class _FusedHeadModel(torch.nn.Module):
    """Stands in for a model with TRL's fused LM head: `model(..., fused_lm_head=True)` returns the given per-token
    log-probs [B, L - 1] (zero where the shifted completion mask is 0), as `add_fused_lm_head` does."""

    is_gradient_checkpointing = False

    def __init__(self, log_probs):
        super().__init__()
        self.log_probs = log_probs

    def forward(self, **kwargs):
        assert kwargs["fused_lm_head"]
        zeros = torch.zeros_like(self.log_probs)
        return SimpleNamespace(log_probs=self.log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def trl_loss(policy, ref, completion_mask, *, loss_type, beta, label_smoothing=0.0):
    """TRL's DPOTrainer._compute_loss (reference from a second model) on a padded [chosen; rejected] batch."""
    t = DPOTrainer.__new__(DPOTrainer)
    t.model, t.ref_model = _FusedHeadModel(policy), _FusedHeadModel(ref)
    t.accelerator, t.args = _Accelerator(), SimpleNamespace(gradient_checkpointing_kwargs=None)
    t.aux_loss_enabled, t.ld_alpha, t.precompute_ref_logps, t.use_weighting = False, None, False, False
    t.f_divergence_type, t.loss_types, t.loss_weights = "reverse_kl", [loss_type], [1.0]
    t.beta, t.label_smoothing = beta, label_smoothing
    t._metrics = {"train": __import__("collections").defaultdict(list)}
    t._total_train_tokens, t._tp_size = 0, 1
    inputs = {"input_ids": torch.ones_like(completion_mask), "attention_mask": torch.ones_like(completion_mask),
              "completion_mask": completion_mask}
    loss = DPOTrainer._compute_loss(t, t.model, inputs, False)
    return loss, {k: v[-1] for k, v in t._metrics["train"].items()}


def make_pairs(seed, n_pairs=3):
    """Random pairs: per sequence (chosen 0, rejected 0, chosen 1, ...) a prompt, an answer and leaf per-token
    log-probs for every position after the first."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n_pairs):
        prompt = int(torch.randint(2, 6, (1,), generator=g))
        for _answer in range(2):
            n = int(torch.randint(1, 7, (1,), generator=g))
            seqs.append({"prompt": prompt, "answer": n,
                         "policy": (-3 * torch.rand(prompt + n - 1, generator=g)).requires_grad_(),
                         "ref": -3 * torch.rand(prompt + n - 1, generator=g)})
    return seqs


def trl_layout(seqs, key):
    """TRL's padded batch: chosen sequences then rejected, right-padded; log-probs zero outside the answers."""
    order = seqs[0::2] + seqs[1::2]
    width = max(s["prompt"] + s["answer"] for s in order)
    rows, mask = [], torch.zeros(len(order), width, dtype=torch.long)
    for i, s in enumerate(order):
        n = s["prompt"] + s["answer"]
        mask[i, s["prompt"]:n] = 1
        shifted = mask[i, 1:n].float()
        rows.append(torch.cat([s[key] * shifted, torch.zeros(width - n)]))
    return torch.stack(rows), mask


def packed_layout(seqs, key):
    """vlmctl's packed row: the sequences one after another (chosen, rejected, chosen, ...), log-probs aligned with
    the labels, labels -100 outside the answers."""
    logps, labels = [], []
    for s in seqs:
        n = s["prompt"] + s["answer"]
        lab = torch.full((n,), -100)
        lab[s["prompt"]:] = 7
        logps.append(torch.cat([torch.zeros(1), s[key]]))
        labels.append(lab)
    return torch.cat(logps)[None], torch.cat(labels)[None], [s["prompt"] + s["answer"] for s in seqs]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_loss_metrics_and_gradients_equal_trl(loss_type, seed):
    seqs = make_pairs(seed)
    beta = 0.1 if loss_type != "hinge" else 0.5
    policy, mask = trl_layout(seqs, "policy")
    ref, _ = trl_layout(seqs, "ref")
    expected, metrics = trl_loss(policy, ref, mask, loss_type=loss_type, beta=beta)
    expected_grads = torch.autograd.grad(expected, [s["policy"] for s in seqs])

    packed, labels, lens = packed_layout(seqs, "policy")
    packed_ref, _, _ = packed_layout(seqs, "ref")
    out = packed_dpo_loss(packed, packed_ref, labels, lens, num_pairs=len(seqs) // 2, beta=beta, loss_type=loss_type)
    grads = torch.autograd.grad(out.loss, [s["policy"] for s in seqs])
    torch.testing.assert_close(out.loss, expected, **TOL)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOL)
    assert any(float(g.abs().sum()) > 0 for g in grads)  # the comparison is not between zeros
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert math.isclose(out.metrics[name], metrics[name], rel_tol=1e-5, abs_tol=1e-6), name


def test_label_smoothing_is_conservative_dpo_as_trl_aot_on_one_pair():
    # TRL 1.x no longer smooths its sigmoid loss; its `aot` loss is -(1 - eps) log sigma(beta d) - eps log sigma(-beta d)
    # of the sorted log-ratio differences, which for a single pair is the conservative DPO (cDPO) loss.
    seqs = make_pairs(3)
    packed, labels, lens = packed_layout(seqs, "policy")
    packed_ref, _, _ = packed_layout(seqs, "ref")
    out = packed_dpo_loss(packed, packed_ref, labels, lens, num_pairs=3, beta=0.2, loss_type="sigmoid", label_smoothing=0.15)
    for k in range(3):
        policy, mask = trl_layout(seqs[2 * k:2 * k + 2], "policy")
        ref, _ = trl_layout(seqs[2 * k:2 * k + 2], "ref")
        expected, _ = trl_loss(policy, ref, mask, loss_type="aot", beta=0.2, label_smoothing=0.15)
        torch.testing.assert_close(out.losses[k], expected, **TOL)
    plain = packed_dpo_loss(packed, packed_ref, labels, lens, num_pairs=3, beta=0.2, loss_type="sigmoid")
    assert not torch.allclose(plain.losses, out.losses)


def test_token_logps_and_segments_from_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 9, 11, generator=g)
    labels = torch.tensor([[-100, 3, 4, -100, -100, 5, 6, 1, -100]])
    lp = token_logps(logits, labels)
    want = torch.log_softmax(logits[0], -1)
    assert lp[0, 1] == pytest.approx(float(want[0, 3])) and lp[0, 7] == pytest.approx(float(want[6, 1]))
    assert float(lp[0, 0]) == 0 and float(lp[0, 3]) == 0
    sums, counts = segment_logps(logits, labels, [3, 2, 4])
    assert counts.tolist() == [2, 0, 3]
    torch.testing.assert_close(sums, torch.stack([lp[0, 1:3].sum(), torch.tensor(0.0), lp[0, 5:8].sum()]))
    chosen, rejected = pair_segments(sums, 1)
    assert chosen.tolist() == [sums[0].item()] and rejected.tolist() == [sums[1].item()]
    with pytest.raises(ValueError, match="sum to 8 tokens, the row has 9"):
        segment_logps(logits, labels, [3, 5])


def test_errors_name_the_setting():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown DPO loss type 'kto'"):
        dpo_loss(x, x, x, x, loss_type="kto")
    with pytest.raises(ValueError, match="token counts"):
        dpo_loss(x, x, x, x, loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing applies to the sigmoid loss"):
        dpo_loss(x, x, x, x, loss_type="hinge", label_smoothing=0.1)
    assert isinstance(dpo_loss(x, x, x, x), DPOOutput)
