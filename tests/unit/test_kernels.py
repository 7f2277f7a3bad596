"""The vision tower's GPU kernels are exact rewrites: same parameters, same outputs and gradients (checked on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch


def tiny_qwen25_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    # vision MLP width 36: not a multiple of 64, so it is padded to 64
    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, intermediate_size=40, bos_token_id=1, eos_token_id=2),
                           vision_config=dict(depth=2, hidden_size=32, intermediate_size=36, num_heads=2, out_hidden_size=32,
                                              fullatt_block_indexes=[1], window_size=56),
                           image_token_id=3, video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(cfg).float()


@pytest.mark.parametrize("compile", [False, True])
def test_aligned_mlp_and_linear_patch_embedding_are_exact(compile, monkeypatch):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    from vlmctl.families import get_family
    from vlmctl.train.kernels import apply_encoder_kernels

    # the compiled rotary replaces the module's function: put the original back for the other tests
    monkeypatch.setattr(modeling_qwen2_5_vl, "apply_rotary_pos_emb_vision", modeling_qwen2_5_vl.apply_rotary_pos_emb_vision)

    ref = tiny_qwen25_vl()
    fast = copy.deepcopy(ref)
    shapes = {n: p.shape for n, p in fast.named_parameters()}
    # the kernels Qwen2.5-VL's image encoder declares (`EncoderSpec.kernels`)
    applied = apply_encoder_kernels(fast, get_family("qwen2_5_vl"), compile=compile)
    assert any("aligned MLP" in a for a in applied) and "patch embedding as GEMM" in applied
    assert ("compiled rotary" in applied) == compile
    assert {n: p.shape for n, p in fast.named_parameters()} == shapes  # checkpoints are unchanged
    pixels = torch.randn(2 * 64, 3 * 2 * 14 * 14)  # two 112 px images: 8 x 8 patches each
    grid = torch.tensor([[1, 8, 8], [1, 8, 8]])
    out_ref = ref.model.visual(pixels, grid_thw=grid)
    out_fast = fast.model.visual(pixels, grid_thw=grid)
    out_ref, out_fast = (getattr(o, "pooler_output", o) for o in (out_ref, out_fast))
    torch.testing.assert_close(out_fast, out_ref, rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(out_ref)
    (out_ref * weights).sum().backward()
    (out_fast * weights).sum().backward()
    for (name, a), (_, b) in zip(ref.model.visual.named_parameters(), fast.model.visual.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_an_encoder_gets_only_the_kernels_its_family_declares():
    import dataclasses

    from vlmctl.families import get_family
    from vlmctl.train.kernels import apply_encoder_kernels

    family = get_family("qwen2_5_vl")
    model = tiny_qwen25_vl()
    forwards = [type(m).forward for m in model.modules()]
    plain = dataclasses.replace(family, encoders={"image": dataclasses.replace(family.encoders["image"], kernels=())})
    assert apply_encoder_kernels(model, plain, compile=False) == []
    assert [type(m).forward for m in model.modules()] == forwards and not any("forward" in vars(m) for m in model.modules())
    mlp_only = dataclasses.replace(family, encoders={"image": dataclasses.replace(family.encoders["image"], kernels=("aligned_mlp",))})
    assert apply_encoder_kernels(model, mlp_only, compile=False) == ["aligned MLP"]
    assert "forward" not in vars(model.model.visual.patch_embed)  # the patch embedding was not declared


def test_aligned_mlp_leaves_aligned_or_adapted_mlps_alone():
    from vlmctl.train.kernels import align_vision_mlp

    model = tiny_qwen25_vl()
    blocks = list(model.model.visual.blocks)
    blocks[0].mlp.gate_proj = torch.nn.Sequential(blocks[0].mlp.gate_proj)  # stands for a LoRA wrapper
    assert align_vision_mlp(blocks) == 1
    assert align_vision_mlp(blocks, multiple=4) == 0  # 36 is a multiple of 4: nothing to pad


def test_liger_kernels_stay_off_where_compile_runs_over_the_modules_they_replace():
    # liger patches the decoder layers' and the vision blocks' norms; dynamo cannot trace its autograd functions
    from vlmctl.config.plan import DeviceFacts, build_plan
    from vlmctl.config.train import TrainSection

    gpu = DeviceFacts(kind="cuda", liger=True, triton=True, varlen=True)
    kernels = lambda **kw: build_plan(TrainSection(**kw), gpu).liger_kernels.value  # noqa: E731
    assert kernels(compile="off", compile_vision="kernels")
    assert not kernels(compile="on", compile_vision="kernels")
    assert not kernels(compile="off", compile_vision="blocks")
    assert not kernels(compile="off", compile_vision="kernels", liger="off")  # no fused loss, no patches


def test_under_the_varlen_kernel_each_encoder_keeps_the_attention_its_family_declares():
    import dataclasses

    from vlmctl.families import get_family
    from vlmctl.train.kernels import VARLEN_NAME, VISION_VARLEN_NAME, register_varlen_attention, set_attention

    register_varlen_attention()
    family = get_family("qwen2_5_vl")
    model = tiny_qwen25_vl()
    set_attention(model, VARLEN_NAME, vision_varlen=True, encoders=family.encoders.values())
    assert model.config.text_config._attn_implementation == VARLEN_NAME
    assert model.config.vision_config._attn_implementation == VISION_VARLEN_NAME  # a `varlen` encoder, on CUDA
    model = tiny_qwen25_vl()
    set_attention(model, VARLEN_NAME, vision_varlen=False, encoders=family.encoders.values())
    assert model.config.vision_config._attn_implementation == "sdpa"  # its own attention, one call per window
    follows = dataclasses.replace(family.encoders["image"], attention=None, varlen=False)
    model = tiny_qwen25_vl()
    set_attention(model, VARLEN_NAME, vision_varlen=True, encoders=[follows])
    assert model.config.vision_config._attn_implementation == VARLEN_NAME  # the language model's


def test_a_compiled_layer_calls_the_varlen_kernel_without_tracing_its_signature(monkeypatch):
    """The varlen forward inside a compiled decoder layer: the kernel's keyword names are read when the attention is
    registered, not traced by Dynamo in every layer (which warned that it skips an lru_cache). The kernel is CUDA
    only, so a segment-masked SDPA with its signature stands in for it."""
    import warnings

    import torch.nn.attention.varlen as varlen

    from vlmctl.train import kernels

    def stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
        pos = torch.arange(query.shape[0])
        seg = torch.searchsorted(cu_seq_q[1:].long(), pos, right=True)
        mask = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
        out = torch.nn.functional.scaled_dot_product_attention(query.transpose(0, 1).float(), key.transpose(0, 1).float(),
                                                               value.transpose(0, 1).float(), attn_mask=mask, scale=scale)
        return out.transpose(0, 1).to(query.dtype)

    class Causal(torch.nn.Module):
        is_causal = True

    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    monkeypatch.setattr(kernels, "_VARLEN_PARAMS", None, raising=False)
    kernels.register_varlen_attention()
    assert {"window_size", "enable_gqa"} <= kernels._varlen_params()

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    def layer(q, k, v):
        return kernels.varlen_attention_forward(Causal(), q, k, v, None, scaling=0.5, packed_cu_seqlens=cu)[0]

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(layer, backend="eager")(q, k, v)
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    torch.testing.assert_close(got, layer(q, k, v))
    # the first segment's tokens attend within it only: the stand-in's mask reached the kernel
    alone = kernels.varlen_attention_forward(Causal(), q[:, :, :5], k[:, :, :5], v[:, :, :5], None, scaling=0.5)[0]
    torch.testing.assert_close(got[:, :5], alone)


def test_the_fused_loss_warm_up_meets_every_class_triton_specializes_a_label_count_on():
    # Triton compiles a kernel once per class of each plain int argument (1, a multiple of 16, any other) and of
    # each pointer's alignment. The warm-up must reach each count class with labels starting at an even and at an
    # odd element (liger's own shift), with gradients asked for, in the dtype, vocabulary and device given.
    from vlmctl.train.kernels import warm_fused_loss

    seen = []

    def loss_fn(hidden, weight, target, *, reduction, ignore_index):
        seen.append((int((target != ignore_index).sum()), target.storage_offset() % 2, hidden.requires_grad,
                     hidden.dtype, weight.shape[0], reduction))
        return torch.nn.functional.cross_entropy(hidden @ weight.t(), target, reduction=reduction,
                                                 ignore_index=ignore_index)

    assert warm_fused_loss(100, torch.bfloat16, "cpu", loss_fn=loss_fn) == len(seen)
    for parity in (0, 1):
        counts = [count for count, odd, *_ in seen if odd == parity]
        assert 1 in counts and any(c % 16 == 0 for c in counts) and any(c != 1 and c % 16 for c in counts)
    assert {tuple(rest) for _, _, *rest in seen} == {(True, torch.bfloat16, 100, "sum")}
