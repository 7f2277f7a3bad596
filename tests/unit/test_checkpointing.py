"""Activation checkpointing modes: which layers recompute their forward in backward, and that gradients stay exact."""

from __future__ import annotations

import pytest
import torch

from vlmctl.distributed.checkpointing import apply_activation_checkpointing, describe


def tiny_lm(layers: int = 4):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).float()
    model.train()
    return model


def grads_and_calls(model, mode, limit=None):
    """Gradients of one forward/backward with `mode` on the first `limit` decoder layers (None: all) and how often
    each layer's MLP started (a recompute may stop early, once the tensors backward needs are back, so the count is
    taken when the MLP starts)."""
    layers = list(model.model.layers)
    apply_activation_checkpointing([layers], mode, layers=limit)
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
                                              (3, [True, False, False, True]), ("op", [True] * 4),
                                              ("keep_attention", [True] * 4)])
def test_modes_recompute_the_chosen_layers_and_keep_gradients_exact(mode, recomputed):
    model = tiny_lm()
    reference, calls = grads_and_calls(model, "off")
    assert calls == [1] * 4
    grads, calls = grads_and_calls(model, mode)
    assert calls == [2 if r else 1 for r in recomputed]
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode, layers, recomputed", [("full", 2, [True, True, False, False]),
                                                      ("keep_attention", 3, [True, True, True, False]),
                                                      (2, 3, [True, False, True, False]), ("full", 0, [False] * 4),
                                                      ("full", 9, [True] * 4)])
def test_a_layer_limit_checkpoints_only_the_first_decoder_layers(mode, layers, recomputed):
    """`train.activation_checkpointing_layers`: the mode applies to the first N decoder layers, the last ones run
    once, and the gradients equal those without checkpointing."""
    model = tiny_lm()
    reference, _ = grads_and_calls(model, "off")
    assert apply_activation_checkpointing([list(model.model.layers)], mode, layers=layers) == sum(recomputed)
    grads, calls = grads_and_calls(model, mode, layers)
    assert calls == [2 if r else 1 for r in recomputed]
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_the_layer_limit_leaves_the_vision_blocks_to_the_mode_and_is_named():
    from types import SimpleNamespace

    from vlmctl.config.train import TrainSection
    from vlmctl.distributed.checkpointing import describe_memory_helpers

    decoder, vision = tiny_lm(3), tiny_lm(2)
    groups = [list(decoder.model.layers), list(vision.model.layers)]
    assert apply_activation_checkpointing(groups, "full", layers=1) == 1 + 2
    assert apply_activation_checkpointing(groups, "vision", layers=1) == 2
    train = SimpleNamespace(activation_checkpointing="keep_attention", activation_checkpointing_layers=20,
                            activation_offload=False, tiled_mlp="off")
    assert describe_memory_helpers(train) == ", first 20 decoder layers"
    train.activation_checkpointing = "off"
    assert describe_memory_helpers(train) == ""
    assert TrainSection(activation_checkpointing_layers=4).activation_checkpointing_layers == 4
    with pytest.raises(ValueError):
        TrainSection(activation_checkpointing_layers=-1)


def test_a_mode_can_be_switched_back_off_on_the_same_model():
    model = tiny_lm()
    layers = list(model.model.layers)
    assert apply_activation_checkpointing([layers], "full") == 4
    assert apply_activation_checkpointing([layers], 2) == 2
    assert apply_activation_checkpointing([layers], "off") == 0
    assert not any(layer.gradient_checkpointing for layer in layers)


def test_unknown_modes_are_refused_and_any_module_can_be_checkpointed():
    with pytest.raises(ValueError, match="unknown activation checkpointing mode"):
        apply_activation_checkpointing([[]], "some")
    with pytest.raises(ValueError):
        apply_activation_checkpointing([[]], 0)
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    x = torch.randn(3, 4, requires_grad=True)
    linear(x).sum().backward()
    reference = x.grad.clone()
    x.grad = None
    assert apply_activation_checkpointing([[linear]], "full") == 1
    runs = []
    linear[1].register_forward_pre_hook(lambda m, i: runs.append(1))
    linear(x).sum().backward()
    assert len(runs) == 2 and torch.equal(x.grad, reference)
    assert apply_activation_checkpointing([[linear]], "off") == 0 and "forward" not in linear.__dict__


def test_hooks_of_a_checkpointed_layer_stay_outside_the_recompute():
    """A pre-forward hook that casts the inputs (as FSDP2's mixed precision does) runs once; the recompute sees the
    cast inputs."""
    model = tiny_lm()
    layers = list(model.model.layers)
    seen = []

    def cast(module, args, kwargs):
        seen.append(1)
        return tuple(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args), kwargs

    model.double()
    handle = layers[0].register_forward_pre_hook(cast, with_kwargs=True)
    apply_activation_checkpointing([layers], "full")
    ids = torch.arange(1, 9).view(1, 8)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # recompute with other dtypes would raise
    handle.remove()
    assert len(seen) == 1


def test_describe_names_the_modes():
    assert describe(2) == "every 2nd layer" and describe(4) == "every 4th layer" and describe(1) == "full"
    assert describe("op") == "op (selective)" and describe("off") == "off"
    assert describe("keep_attention") == "full, attention kept"


def test_the_older_gradient_checkpointing_key_keeps_its_meaning():
    from vlmctl.config.train import TrainSection

    assert TrainSection(gradient_checkpointing=True).activation_checkpointing == "full"
    assert TrainSection(gradient_checkpointing=False).activation_checkpointing == "off"
    assert TrainSection(gradient_checkpointing=True, activation_checkpointing=2).activation_checkpointing == 2
    assert TrainSection(activation_checkpointing="3").activation_checkpointing == 3
    # a bare `off` on the command line or in YAML arrives as a boolean
    assert TrainSection(activation_checkpointing=False).activation_checkpointing == "off"
    with pytest.raises(ValueError):
        TrainSection(activation_checkpointing=0)


def test_tiled_mlp_runs_each_mlp_over_slices_with_exact_gradients():
    from vlmctl.distributed.checkpointing import apply_tiled_mlp

    model = tiny_lm()
    reference, _ = grads_and_calls(model, "off")
    layers = list(model.model.layers)
    assert apply_tiled_mlp(layers, 3) == 4
    rows = []
    hooks = [layer.mlp.down_proj.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[-2])) for layer in layers]
    grads, calls = grads_and_calls(model, "full")
    for h in hooks:
        h.remove()
    # 24 tokens in 3 slices of 8; each slice runs in forward, in the checkpoint's recompute and in TiledMLP's backward
    assert set(rows) == {8} and len(rows) == 4 * 3 * 3
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert apply_tiled_mlp(layers, "off") == 0 and all("forward" not in layer.mlp.__dict__ for layer in layers)


def _bind_stand_in_forward(mlp, calls: list):
    """What liger-kernel does to each decoder MLP (`_patch_swiglu_module`): an instance `forward` bound in the
    module's __dict__. The stand-in computes the same SwiGLU and counts its calls."""
    import torch.nn.functional as F

    def forward(self, x):
        calls.append(x.shape[-2])
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    mlp.__dict__["forward"] = forward.__get__(mlp, type(mlp))


def test_tiled_mlp_and_checkpointing_keep_a_forward_another_library_installed():
    # liger binds its SwiGLU as each MLP's instance forward; tiling (or switching tiling off, as every run does)
    # must run and then restore that forward, not the class's
    from vlmctl.distributed.checkpointing import apply_tiled_mlp

    model = tiny_lm()
    layers = list(model.model.layers)
    calls: list[int] = []
    for layer in layers:
        _bind_stand_in_forward(layer.mlp, calls)
    stand_ins = [layer.mlp.__dict__["forward"] for layer in layers]
    assert apply_tiled_mlp(layers, "off") == 0
    assert [layer.mlp.__dict__.get("forward") for layer in layers] == stand_ins
    grads_and_calls(model, "full")
    assert calls and set(calls) == {24}  # the stand-in ran, over the whole row
    calls.clear()
    assert apply_tiled_mlp(layers, 3) == 4
    grads_and_calls(model, "off")
    assert calls and set(calls) == {8}  # each slice went through the stand-in
    apply_activation_checkpointing([layers], "full")
    apply_activation_checkpointing([layers], "off")
    assert apply_tiled_mlp(layers, "off") == 0
    assert [layer.mlp.__dict__.get("forward") for layer in layers] == stand_ins
    # a decoder layer's own instance forward survives checkpointing being switched on and off again
    marker = layers[0].forward
    layers[0].__dict__["forward"] = marker
    apply_activation_checkpointing([layers], 2)
    assert layers[0].forward is not marker
    apply_activation_checkpointing([layers], "off")
    assert layers[0].__dict__.get("forward") is marker


def test_offload_keeps_the_layer_inputs_on_the_host_and_gradients_exact(monkeypatch):
    # CPU stands in for the GPU: the copy goes to a plain host tensor and the layer sees a tensor it moved back
    from vlmctl.distributed import checkpointing

    class ToHost(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            moved.append(x.shape)
            return x.detach().clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    moved: list = []
    monkeypatch.setattr(checkpointing, "_to_host", lambda: ToHost)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self + 0)  # the copy back, kept in the graph
    model = tiny_lm()
    layers = list(model.model.layers)
    apply_activation_checkpointing([layers], "off")
    reference = {}
    ids = torch.arange(1, 25).view(1, 24) % 64
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    assert apply_activation_checkpointing([layers], "full", offload=True) == 4
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert moved == [torch.Size([1, 24, 32])] * 4  # each layer's input, once (the recompute reads the host copy)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_vision_mode_recomputes_the_vision_blocks_only_and_keeps_gradients_exact():
    """`vision` on a tiny Qwen2.5-VL: each vision block's forward runs twice, each decoder layer's once, and the
    gradients of one image + text forward/backward match off's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from vlmctl.families import get_family
    from vlmctl.train.setup import model_parts

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, intermediate_size=40, rope_parameters=rope),
                           vision_config=dict(depth=2, hidden_size=32, intermediate_size=36, num_heads=2,
                                              out_hidden_size=32, fullatt_block_indexes=[1], window_size=56),
                           image_token_id=3, video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).float()
    model.train()
    parts = model_parts(model, get_family("qwen2_5_vl"))
    groups = [parts.decoder_layers, parts.vision_layers]
    assert len(groups[0]) == 1 and len(groups[1]) == 2
    pixels = torch.randn(64, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))  # one 112 px image
    ids = torch.tensor([[1, 5] + [3] * 16 + [6, 7, 8, 9, 10]])  # 8 x 8 patches merged 2 x 2: 16 visual tokens

    def run(mode):
        assert apply_activation_checkpointing(groups, mode) == {"off": 0, "vision": 2, "full": 3}[mode]
        calls = {"vision": 0, "decoder": 0}
        hooks = [m.mlp.register_forward_pre_hook(lambda *a, k=k: calls.__setitem__(k, calls[k] + 1))
                 for k, layers in (("decoder", groups[0]), ("vision", groups[1])) for m in layers]
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([[1, 8, 8]]), labels=ids).loss.backward()
        for h in hooks:
            h.remove()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls

    reference, calls = run("off")
    assert calls == {"vision": 2, "decoder": 1}
    grads, calls = run("vision")
    assert calls == {"vision": 4, "decoder": 1}
    assert grads.keys() == reference.keys() and any(n.startswith("model.visual.") for n in grads)
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert describe("vision") == "vision tower only"


def test_probe_tries_vision_only_where_the_vision_tower_trains():
    from vlmctl.config.train import TrainSection
    from vlmctl.train.autotune import candidates

    decoder, vision = [torch.nn.Linear(2, 2)], [torch.nn.Linear(2, 2)]
    train = TrainSection(compile="on")
    assert candidates(train, [decoder, vision]) == ("off", "vision", 2, "full")
    vision[0].requires_grad_(False)
    assert candidates(train, [decoder, vision]) == ("off", 2, "full")
    assert candidates(train, [decoder, []]) == ("off", 2, "full")  # no vision tower


def op_runs(model, mode) -> tuple[int, int]:
    """How often an SDPA kernel and a matmul run in the forward work of one forward/backward of `model` under
    `mode` (the recompute included, the backward kernels not)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    runs = {"attention": 0, "matmul": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if "scaled_dot_product" in name and "backward" not in name:
                runs["attention"] += 1
            elif name.split(".")[0] in ("mm", "addmm", "bmm"):
                runs["matmul"] += 1
            return func(*args, **(kwargs or {}))

    apply_activation_checkpointing([list(model.model.layers)], mode)
    ids = torch.arange(1, 25).view(1, 24) % 64
    with Count():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return runs["attention"], runs["matmul"]


def test_selective_modes_keep_the_attention_kernels_output_where_full_recomputes_it():
    model = tiny_lm()
    model.config._attn_implementation = "sdpa"
    attention, matmuls = op_runs(model, "off")
    assert attention == 4  # one per layer
    assert op_runs(model, "full")[0] == 8  # and again in each layer's recompute
    assert op_runs(model, "op") == (4, matmuls)  # op keeps both: the recompute reruns only the elementwise work
    kept, recomputed = op_runs(model, "keep_attention")
    assert kept == 4 and recomputed > matmuls  # the attention is kept, the projections and MLP run again


@pytest.mark.parametrize("mode", ["op", "keep_attention"])
def test_selective_modes_keep_the_varlen_kernels_output(mode):
    # packed rows on CUDA attend through PyTorch's varlen kernel (CUDA only: its membership is what can be checked)
    from torch.utils.checkpoint import CheckpointPolicy

    from vlmctl.distributed.checkpointing import _save_policy

    pytest.importorskip("torch.nn.attention.varlen")
    policy = _save_policy(mode)
    assert policy(None, torch.ops.torch_attn._varlen_attn.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    keeps_matmuls = policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert keeps_matmuls == (mode == "op")
