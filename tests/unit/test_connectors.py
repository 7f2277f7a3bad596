"""Compose-mode connectors: `model.projector=pixel_shuffle` builds Idefics3 from a SigLIP encoder and any LLM, loads in
vanilla transformers, counts visual tokens like its processor, and stage `align` trains exactly the connector."""

from __future__ import annotations

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.errors import ConfigError, ModelError

TEXTS = ["What color is the circle? Answer with one word.", "blue", "How many squares are there?", "2"] * 10


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from vlmctl.models import build_model

    out = tmp_path_factory.mktemp("ps") / "model"
    result = build_model(ModelSection(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle",
                                      output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS)
    return result


def test_pixel_shuffle_builds_idefics3_that_vanilla_transformers_loads_and_generates(built):
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.families import get_family

    assert built.family == "idefics3" and built.info["model_class"] == "Idefics3ForConditionalGeneration"
    model = AutoModelForImageTextToText.from_pretrained(built.output_dir).eval()
    processor = AutoProcessor.from_pretrained(built.output_dir)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration" and model.config.scale_factor == 2
    # tiny encoder: 64 px / patch 8 = 8 x 8 patches -> 4 x 4 tokens per view after pixel shuffle by 2
    assert processor.image_seq_len == 16 and built.info["built_from"]["pixel_shuffle_scale"] == 2
    spec = get_family(built.family)
    assert built.visual_tokens_per_image == spec.num_visual_tokens(64, 64, processor)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color?"}]}],
                                         add_generation_prompt=True)
    for w, h in [(64, 64), (100, 60), (37, 211)]:
        batch = processor(images=[Image.new("RGB", (w, h), (10, 200, 30))], text=[text], return_tensors="pt")
        assert int((batch["input_ids"] == model.config.image_token_id).sum()) == spec.num_visual_tokens(w, h, processor)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 3


def test_align_trains_exactly_the_pixel_shuffle_connector(built):
    from vlmctl.models import load_model
    from vlmctl.train import setup

    model, _, family = load_model(built.output_dir)
    parts = setup.model_parts(model, family)
    counts = setup.apply_stage(model, parts, setup.trainable_parts("align", None))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["model.connector.modality_projection.proj.weight"]
    assert counts["vision"] == counts["llm"] == 0 and counts["projector"] == built.parameters["projector"]
    # 64-wide SigLIP features x 2**2 -> the LLM's 128 dims
    assert built.parameters["projector"] == 64 * 4 * 128


def test_pixel_shuffle_settings_are_checked_before_weights(tmp_path):
    from transformers import CLIPVisionConfig

    from vlmctl.models.build import plan_build

    CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                     patch_size=8).save_pretrained(tmp_path / "clip")
    with pytest.raises(ModelError, match="clip_vision_model.*SigLIP"):
        plan_build(ModelSection(vision=str(tmp_path / "clip"), llm="tiny", init="random", projector="pixel_shuffle"))
    with pytest.raises(ConfigError, match="does not divide the encoder's 8 x 8 patch grid"):
        plan_build(ModelSection(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle", pixel_shuffle_scale=3))
    with pytest.raises(ConfigError, match="vision_feature_layer does not apply"):
        plan_build(ModelSection(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle", vision_feature_layer=-1))
    with pytest.raises(ValueError, match="pixel_shuffle_scale applies to model.projector=pixel_shuffle only"):
        ModelSection(vision="tiny", llm="tiny", init="random", pixel_shuffle_scale=4)
    plan = plan_build(ModelSection(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle", pixel_shuffle_scale=4))
    assert plan.family.name == "idefics3" and plan.projector.config == {"scale_factor": 4}
    assert plan_build(ModelSection(vision="tiny", llm="tiny", init="random")).family.name == "llava"
