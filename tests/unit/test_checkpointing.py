"""Activation checkpointing modes: which layers recompute their forward in backward, and that gradients stay exact."""

from __future__ import annotations

import pytest
import torch

from vlmctl.train.checkpointing import apply_activation_checkpointing, describe


def tiny_lm(layers: int = 4):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).float()
    model.train()
    return model


def grads_and_calls(model, mode):
    """Gradients of one forward/backward and how often each layer's MLP started (a recompute may stop early,
    once the tensors backward needs are back, so the count is taken when the MLP starts)."""
    layers = list(model.model.layers)
    apply_activation_checkpointing([layers], mode)
    calls = [0] * len(layers)
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, i, k=k: calls.__setitem__(k, calls[k] + 1))
             for k, layer in enumerate(layers)]
    ids = torch.arange(1, 25).view(1, 24) % 64
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for h in hooks:
        h.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("mode, recomputed", [("off", [False] * 4), ("full", [True] * 4), (2, [True, False, True, False]),
                                              (3, [True, False, False, True]), ("op", [True] * 4)])
def test_modes_recompute_the_chosen_layers_and_keep_gradients_exact(mode, recomputed):
    model = tiny_lm()
    reference, calls = grads_and_calls(model, "off")
    assert calls == [1] * 4
    grads, calls = grads_and_calls(model, mode)
    assert calls == [2 if r else 1 for r in recomputed]
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_mode_can_be_switched_back_off_on_the_same_model():
    model = tiny_lm()
    layers = list(model.model.layers)
    assert apply_activation_checkpointing([layers], "full") == 4
    assert apply_activation_checkpointing([layers], 2) == 2
    assert apply_activation_checkpointing([layers], "off") == 0
    assert not any(layer.gradient_checkpointing for layer in layers)


def test_unknown_modes_and_layers_that_cannot_checkpoint_are_refused():
    with pytest.raises(ValueError, match="unknown activation checkpointing mode"):
        apply_activation_checkpointing([[]], "some")
    with pytest.raises(ValueError):
        apply_activation_checkpointing([[]], 0)
    with pytest.raises(TypeError, match="GradientCheckpointingLayer"):
        apply_activation_checkpointing([[torch.nn.Linear(2, 2)]], "full")
    assert apply_activation_checkpointing([[torch.nn.Linear(2, 2)]], "off") == 0


def test_describe_names_the_modes():
    assert describe(2) == "every 2nd layer" and describe(4) == "every 4th layer" and describe(1) == "full"
    assert describe("op") == "op (selective)" and describe("off") == "off"


def test_the_older_gradient_checkpointing_key_keeps_its_meaning():
    from vlmctl.config.train import TrainSection

    assert TrainSection(gradient_checkpointing=True).activation_checkpointing == "full"
    assert TrainSection(gradient_checkpointing=False).activation_checkpointing == "off"
    assert TrainSection(gradient_checkpointing=True, activation_checkpointing=2).activation_checkpointing == 2
    assert TrainSection(activation_checkpointing="3").activation_checkpointing == 3
    with pytest.raises(ValueError):
        TrainSection(activation_checkpointing=0)
