"""The LLaVA family module: the compose family (any vision encoder + any causal LM), its module paths and the
layer classes discovered on the real class, its visual-token rule, and the encoders it refuses."""

from __future__ import annotations

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.errors import ModelError
from vlmctl.families import compose_family, count_parameters, get_family

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10


def test_llava_is_the_compose_family():
    spec = compose_family()
    assert spec is get_family("llava") and spec.compose
    assert (spec.vision_tower, spec.projector, spec.language_model) == (
        "model.vision_tower", ("model.multi_modal_projector",), "model.language_model")
    assert dict(spec.modalities) == {"image": "<image>"} and not spec.mrope
    assert spec.decoder_layer_classes == spec.vision_layer_classes == ()  # discovered: the parts can be anything


def test_tiny_preset_paths_layers_and_visual_tokens():
    from PIL import Image

    from vlmctl.families import decoder_layer_classes, decoder_layers, vision_layer_classes
    from vlmctl.models.build import make_model, make_processor, plan_build

    spec = get_family("llava")
    plan = plan_build(ModelSection(preset=spec.tiny_preset, init="random", dtype="fp32"))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    model = make_model(plan, processor)
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == ["Qwen2DecoderLayer"]
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == ["SiglipEncoderLayer"]
    assert len(decoder_layers(model, spec)) == model.config.text_config.num_hidden_layers
    image_id = processor.tokenizer.convert_tokens_to_ids(spec.image_token)
    for w, h in [(64, 64), (300, 200)]:  # fixed resize: the size does not matter
        batch = processor(images=[Image.new("RGB", (w, h))], text=["<image>hi"], return_tensors="pt")
        assert int((batch["input_ids"] == image_id).sum()) == spec.num_visual_tokens(w, h, processor) == \
            spec.num_visual_tokens(w, h, model.config) == model.config.image_seq_length


def test_visual_token_rule_with_a_cls_token():
    from vlmctl.families.llava import llava_tokens

    config = {"vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
              "vision_feature_select_strategy": "default"}
    assert llava_tokens(10, 10, config) == 576  # LLaVA-1.5: 24 x 24 patches, CLS dropped
    assert llava_tokens(10, 10, {**config, "vision_feature_select_strategy": "full"}) == 577


def test_composed_real_presets_on_meta():
    from vlmctl.models.build import instantiate, plan_build

    plan = plan_build(ModelSection(vision="siglip-so400m", llm="qwen2.5-0.5b", init="random"))
    model = instantiate(plan, device="meta")
    counts = count_parameters(model, get_family("llava"))
    # SigLIP so400m without its pooling head ~400M; Qwen2.5-0.5B 494M (tied embeddings).
    assert 0.39e9 < counts["vision"] < 0.42e9 and abs(counts["llm"] - 494e6) / 494e6 < 0.01
    assert plan.feature_strategy == "full" and model.config.image_seq_length == (384 // 14) ** 2


def test_compose_refuses_naflex_encoders(tmp_path):
    from transformers import Siglip2VisionConfig

    from vlmctl.models.build import plan_build

    Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="NaFlex"):
        plan_build(ModelSection(vision=str(tmp_path), llm="qwen2.5-0.5b", init="random"))


def test_families_that_do_not_compose_say_so():
    spec = get_family("gemma3")  # idefics3 composes (model.projector=pixel_shuffle)
    assert not spec.compose
    with pytest.raises(ModelError, match="does not compose"):
        spec.compose_config(None, None, token_ids={}, feature_layer=-1, feature_strategy="full", projector_config={})
