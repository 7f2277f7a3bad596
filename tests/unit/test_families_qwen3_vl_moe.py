"""The Qwen3-VL MoE family module: built by the Qwen-VL factory (shared spec class, mRoPE hook), module paths and
layer classes on the real class, the MoE decoder layers as FSDP2 units holding every expert weight, and the
visual-token rule against Qwen3-VL's processor."""

from __future__ import annotations

from vlmctl.config.model import ModelSection
from vlmctl.families import get_family, qwen_vl
from vlmctl.families.qwen_vl import QwenVLSpec

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10


def test_shares_the_qwen_vl_spec():
    spec, dense = get_family("qwen3_vl_moe"), get_family("qwen3_vl")
    assert type(spec) is QwenVLSpec and spec.mrope and spec.image_grid_args == ("image_grid_thw",)
    assert (spec.model_class, spec.config_class, spec.processor_class) == \
        ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig", "Qwen3VLProcessor")
    assert (spec.projector, dict(spec.modalities), spec.special_tokens) == (dense.projector, dict(dense.modalities), dense.special_tokens)
    assert spec.liger_patch == "apply_liger_kernel_to_qwen3_vl_moe"
    config = {"vision_config": {"patch_size": 16, "spatial_merge_size": 2}}
    assert spec.num_visual_tokens(640, 480, config) == dense.num_visual_tokens(640, 480, config)


def test_position_hook_goes_through_the_qwen_vl_module(monkeypatch):
    calls = []
    monkeypatch.setattr(qwen_vl, "mrope_prepare", lambda model, image_token_id: calls.append(image_token_id) or "hook")
    assert get_family("qwen3_vl_moe").position_hook(object(), 3) == "hook" and calls == [3]


def test_module_paths_and_moe_layers_are_the_fsdp_units():
    from vlmctl.families import count_parameters, decoder_layer_classes, vision_layer_classes
    from vlmctl.models.build import instantiate, plan_build
    from vlmctl.train.setup import model_parts

    spec = get_family("qwen3_vl_moe")
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == spec.model_class
    for path in (spec.vision_tower, *spec.projector, spec.language_model, spec.lm_head):
        model.get_submodule(path)
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == list(spec.decoder_layer_classes)
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == list(spec.vision_layer_classes)
    units = model_parts(model, spec).decoder_layers
    assert [type(u).__name__ for u in units] == ["Qwen3VLMoeTextDecoderLayer"] * model.config.text_config.num_hidden_layers
    # every expert weight (3-D: [experts, ...]) and router lives inside one decoder-layer unit
    in_units = {id(p) for u in units for p in u.parameters()}
    moe = [(n, p) for n, p in model.named_parameters() if ".mlp.experts." in n or ".mlp.gate." in n]
    assert moe and all(id(p) in in_units for _, p in moe)
    assert {p.shape[0] for n, p in moe if ".experts." in n} == {model.config.text_config.num_experts}
    counts = count_parameters(model, spec)
    merger = sum(p.numel() for path in spec.projector for p in model.get_submodule(path).parameters())
    assert counts["projector"] == merger


def test_visual_token_rule_matches_the_real_processor():
    from PIL import Image

    from vlmctl.models.build import make_processor, plan_build

    spec = get_family("qwen3_vl_moe")
    processor = make_processor(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), tokenizer_texts=TEXTS)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    image_id = processor.tokenizer.convert_tokens_to_ids(spec.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    for w, h in [(64, 64), (300, 200), (37, 211), (640, 480)]:
        batch = processor(images=[Image.new("RGB", (w, h))], text=[text], return_tensors="pt")
        assert spec.num_visual_tokens(w, h, processor) == int((batch["input_ids"] == image_id).sum()), (w, h)
