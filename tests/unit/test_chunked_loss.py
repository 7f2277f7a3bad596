"""The packed loss without logits: the LM head's chunked cross-entropy (`kernels.chunked_loss_head`) and the
next-token labels of a sequence-parallel slice (`sequence.local_shift_labels`, what liger's fused loss takes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlmctl.train import kernels


def tiny_lm(vocab: int = 500, **config):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, **config)
    return Qwen2ForCausalLM(cfg).float()


def row(vocab: int = 500, length: int = 60):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (1, length))
    labels = torch.full_like(ids, -100)
    labels[0, 10:25] = ids[0, 10:25]
    labels[0, 40:58] = ids[0, 40:58]
    return ids, labels


def reference(model, ids, labels):
    """Full logits, shifted cross-entropy of the labelled tokens, and the gradients of their sum."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits[0, :-1].float()
    target = labels[0, 1:]
    losses = F.cross_entropy(logits, target, reduction="none", ignore_index=-100)[target != -100]
    losses.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return losses.detach(), grads


def test_chunked_cross_entropy_equals_the_full_one_with_its_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    bias = torch.randn(30, requires_grad=True)
    targets = torch.randint(0, 30, (10,))
    targets[3] = -100
    full = F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction="none")
    want = torch.autograd.grad((full * torch.arange(10.0)).sum(), (hidden, weight, bias))
    got_losses = kernels.chunked_cross_entropy(hidden, weight, bias, targets, chunk_tokens=3)
    got = torch.autograd.grad((got_losses * torch.arange(10.0)).sum(), (hidden, weight, bias))
    assert got_losses.dtype == torch.float32 and got_losses[3] == 0
    torch.testing.assert_close(got_losses, full)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


_real_chunked = kernels.chunked_cross_entropy


def _chunked(h, w, b, t):
    return _real_chunked(h, w, b, t, chunk_tokens=8)


def test_token_losses_compute_logits_one_chunk_at_a_time_and_equal_full_logits(monkeypatch):
    model = tiny_lm()
    ids, labels = row()
    ref_losses, ref_grads = reference(model, ids, labels)
    chunks = []
    chunk_ce = kernels._cross_entropy_chunk
    monkeypatch.setattr(kernels, "_cross_entropy_chunk", lambda h, *a: chunks.append(h.shape[0]) or chunk_ce(h, *a))
    monkeypatch.setattr(kernels, "chunked_cross_entropy", _chunked)  # chunks of 8 tokens
    losses, index = kernels.token_losses(model, {"input_ids": ids, "labels": labels})
    losses.sum().backward()
    # 33 labelled targets in chunks of 8: forward 5 chunks, and each recomputed once in backward
    assert chunks[:5] == [8, 8, 8, 8, 1] and len(chunks) == 10
    assert index.tolist() == [p for p in range(1, 60) if labels[0, p] != -100]
    torch.testing.assert_close(losses.detach(), ref_losses, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert "forward" not in model.lm_head.__dict__  # the head is itself again


def test_a_forward_that_ignores_logits_to_keep_gets_the_labelled_positions(monkeypatch):
    # liger-kernel's patched forwards hand the head every position when no labels are given
    model = tiny_lm()
    ids, labels = row()
    ref_losses, ref_grads = reference(model, ids, labels)
    plain = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a, logits_to_keep=0, **kw: plain(self, *a, logits_to_keep=0, **kw))
    monkeypatch.setattr(kernels, "chunked_cross_entropy", _chunked)  # the 60-position row in chunks of 8
    losses, _ = kernels.token_losses(model, {"input_ids": ids, "labels": labels})
    losses.sum().backward()
    torch.testing.assert_close(losses.detach(), ref_losses, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_head_whose_logits_the_model_transforms_is_left_alone():
    # soft-capped logits (Gemma-style) go through the model's own head: the loss comes from the kept logits
    model = tiny_lm(final_logit_softcapping=30.0)
    ids, labels = row()
    ref_losses, _ = reference(model, ids, labels)
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    losses, _ = kernels.token_losses(model, {"input_ids": ids, "labels": labels})
    assert seen == [(1, 33, 500)]
    torch.testing.assert_close(losses.detach(), ref_losses, rtol=1e-5, atol=1e-6)


def test_the_head_of_a_wrapped_model_is_found_and_restored_after_an_error():
    model = tiny_lm()
    wrapper = torch.nn.Module()
    wrapper.module = model  # DDP and DeepSpeed's engine hold the model as .module
    with pytest.raises(RuntimeError, match="boom"):
        with kernels.chunked_loss_head(wrapper, torch.tensor([1, 2])) as head:
            assert head.chunked and "forward" in model.lm_head.__dict__
            raise RuntimeError("boom")
    assert "forward" not in model.lm_head.__dict__


@pytest.mark.parametrize("length, ranks", [(10, 2), (11, 2), (13, 4), (8, 4)])
def test_the_slice_labels_hold_each_target_on_the_rank_that_predicts_it(length, ranks):
    from vlmctl.distributed.sequence import SequenceShard, local_shift_labels, local_targets

    torch.manual_seed(length)
    labels = torch.randint(0, 50, (1, length))
    labels[0, torch.rand(length) < 0.4] = -100
    targets = torch.nonzero(labels[0] != -100).squeeze(1)
    targets = targets[targets > 0]
    seen = []
    for r in range(ranks):
        shard = SequenceShard(None, r, ranks)
        start, end = shard.bounds(length)
        shifted = local_shift_labels(labels, shard)
        assert shifted.shape == (1, end - start)
        mine, keep = local_targets(targets, length, shard)
        assert torch.equal(torch.nonzero(shifted[0] != -100).squeeze(1), keep)
        assert torch.equal(shifted[0, keep], labels[0, mine])
        seen += mine.tolist()
    assert sorted(seen) == targets.tolist()
