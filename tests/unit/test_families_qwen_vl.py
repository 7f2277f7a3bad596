"""The Qwen-VL family module: three versions from one spec class, their module paths and layer classes on the real
transformers classes, the visual-token rule against the real processor (also under `model.image_size`), the
mRoPE position hook, and the 3B preset's parameter count."""

from __future__ import annotations

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.errors import ModelError
from vlmctl.families import count_parameters, get_family, qwen_vl
from vlmctl.families.qwen_vl import QwenVLSpec

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10
VERSIONS = {  # name -> (model class, decoder layer, vision block, video processor)
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLDecoderLayer", "Qwen2VLVisionBlock", "Qwen2VLVideoProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock", "Qwen2VLVideoProcessor"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLTextDecoderLayer", "Qwen3VLVisionBlock", "Qwen3VLVideoProcessor"),
}


def test_the_versions_share_one_spec_class():
    specs = [get_family(name) for name in VERSIONS]
    assert {type(s) for s in specs} == {QwenVLSpec}
    for spec, (model_class, decoder, block, video) in zip(specs, VERSIONS.values()):
        assert (spec.model_class, spec.decoder_layer_classes, spec.vision_layer_classes, spec.video_processor_class) == \
            (model_class, (decoder,), (block,), video)
        assert spec.mrope and spec.image_grid_args == ("image_grid_thw",)
        assert dict(spec.modalities) == {"image": "<|image_pad|>", "video": "<|video_pad|>"}
        assert spec.prompt("video") == "<|vision_start|><|video_pad|><|vision_end|>"
        assert spec.liger_patch == f"apply_liger_kernel_to_{spec.name}" and spec.lmms_model == spec.name
    assert get_family("qwen3_vl").projector == ("model.visual.merger", "model.visual.deepstack_merger_list")


@pytest.mark.parametrize("name", list(VERSIONS))
def test_module_paths_and_layer_classes_on_the_real_class(name):
    from vlmctl.families import decoder_layer_classes, parts, vision_layer_classes
    from vlmctl.models.build import instantiate, plan_build

    spec = get_family(name)
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == spec.model_class
    mods = parts(model, spec)
    assert all(m is not None for ms in mods.values() for m in ms)
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == list(spec.decoder_layer_classes)
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == list(spec.vision_layer_classes)
    # the merger sits inside the vision tower: its parameters count as projector, not vision
    counts = count_parameters(model, spec)
    merger = sum(p.numel() for m in mods["projector"] for p in m.parameters())
    assert counts["projector"] == merger and counts["vision"] == sum(p.numel() for p in mods["vision"][0].parameters()) - merger


@pytest.mark.parametrize("image_size", [None, 112])
def test_visual_token_rule_matches_the_real_processor(image_size):
    from PIL import Image

    from vlmctl.models.build import make_processor, plan_build

    spec = get_family("qwen2_5_vl")
    plan = plan_build(ModelSection(preset=spec.tiny_preset, init="random", image_size=image_size))
    if image_size:
        assert plan.processor_kwargs["max_pixels"] == image_size**2
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    image_id = processor.tokenizer.convert_tokens_to_ids(spec.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    for w, h in [(64, 64), (300, 200), (37, 211), (640, 480)]:
        batch = processor(images=[Image.new("RGB", (w, h))], text=[text], return_tensors="pt")
        assert spec.num_visual_tokens(w, h, processor) == int((batch["input_ids"] == image_id).sum()), (w, h)
    if image_size:
        assert spec.num_visual_tokens(640, 480, processor) <= (image_size // 28) ** 2


def test_position_hook_goes_through_the_module_function(monkeypatch):
    calls = []
    monkeypatch.setattr(qwen_vl, "mrope_prepare", lambda model, image_token_id: calls.append(image_token_id) or "hook")
    assert get_family("qwen2_vl").position_hook(object(), 7) == "hook" and calls == [7]
    assert get_family("llava").position_hook(object(), 7) is None  # 1-D positions: nothing to add


def test_mrope_hook_passes_padded_batches_and_needs_get_rope_index():
    import torch

    class WithRope(torch.nn.Module):
        def get_rope_index(self, *args, **kwargs):
            raise AssertionError("not called for padded batches")

    prepare = qwen_vl.mrope_prepare(WithRope(), 5)
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3)}
    assert prepare(batch) is batch
    with pytest.raises(ModelError, match="get_rope_index"):
        qwen_vl.mrope_prepare(torch.nn.Linear(1, 1), 5)


def test_qwen2_5_vl_3b_preset_parameter_count():
    from vlmctl.models.build import instantiate, plan_build

    model = instantiate(plan_build(ModelSection(preset="qwen2.5-vl-3b", init="random")), device="meta")
    counts = count_parameters(model, get_family("qwen2_5_vl"))
    assert abs(counts["total"] - 3.75e9) / 3.75e9 < 0.01, counts
    assert next(model.parameters()).is_meta
