"""`vlmctl.inference.fused`: the fused query/key/value and gate/up products give the language model's outputs of
the separate projections for every family's tiny preset, gradients still reach each projection's parameters, a copy
into a projection's weight reaches the fused product, and layers that are not plain linears are left alone."""

from __future__ import annotations

import pytest
import torch

from vlmctl.families.registry import FAMILIES
from vlmctl.families.spec import _find_prefix, decoder_layers
from vlmctl.inference import load_for_generation
from vlmctl.inference.fused import fuse_projections

GENERATING = sorted(name for name, f in FAMILIES.items() if f.tiny_preset)


def expected_groups(model, family) -> int:
    """Groups a decoder layer offers: q/k/v plain linears in its attention, gate/up in its MLP."""
    count = 0
    for layer in decoder_layers(model, family):
        for parent in layer.modules():
            for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                if all(type(parent._modules.get(n)) is torch.nn.Linear for n in names):
                    count += 1
    return count


@pytest.mark.parametrize("name", GENERATING)
def test_fused_projections_give_the_language_models_outputs(name, tiny_models):
    family = FAMILIES[name]
    model, _ = load_for_generation(tiny_models(family.tiny_preset), device="cpu", dtype="fp32")
    lm = model.get_submodule(_find_prefix(model, family.language_model))
    hidden = model.get_input_embeddings().weight.shape[1]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lm.parameters():  # larger random weights: outputs that differ wherever a projection is wrong
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(2, 9, hidden, generator=g)
    positions = torch.arange(9)[None].expand(2, -1)

    def run():
        return lm(inputs_embeds=x, position_ids=positions, use_cache=False)[0]

    with torch.no_grad():
        before = run()
    x.requires_grad_(True)
    run().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)

    groups, layers = fuse_projections(lm), expected_groups(model, family)
    assert groups >= layers  # Phi-4's decoder has its own fused projections (0 here); its encoders' are fused
    assert layers > 0 or name == "phi4_multimodal"
    assert fuse_projections(lm) == 0  # once only
    with torch.inference_mode():
        after = run()
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    run().square().mean().backward()  # with autograd each projection runs alone: its parameters get their gradients
    for n, p in lm.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_a_copy_into_a_weight_reaches_the_fused_product_and_lora_layers_stay(tiny_models):
    family = FAMILIES["llava"]
    model, _ = load_for_generation(tiny_models(family.tiny_preset), device="cpu", dtype="fp32")
    layer = decoder_layers(model, family)[0]
    attn = layer.self_attn
    x = torch.randn(3, attn.q_proj.in_features)
    fuse_projections(layer)
    new = torch.randn_like(attn.k_proj.weight)
    with torch.no_grad():
        attn.k_proj.weight.copy_(new)  # how GRPO's replica takes the policy's weights
    with torch.inference_mode():
        q, k = attn.q_proj(x), attn.k_proj(x)
    torch.testing.assert_close(k, x @ new.T + (attn.k_proj.bias if attn.k_proj.bias is not None else 0))
    torch.testing.assert_close(q, torch.nn.functional.linear(x, attn.q_proj.weight, attn.q_proj.bias))

    from peft import LoraConfig, get_peft_model

    fresh, _ = load_for_generation(tiny_models(family.tiny_preset), device="cpu", dtype="fp32")
    wrapped = get_peft_model(fresh, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    mlp_only = sum(1 for l in decoder_layers(fresh, family) if type(l.mlp.gate_proj) is torch.nn.Linear)
    assert fuse_projections(wrapped) == mlp_only  # the attention's LoRA layers are not plain linears
