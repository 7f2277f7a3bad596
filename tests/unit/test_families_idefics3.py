"""The Idefics3 family module: module paths and layer classes on the real class, the tile-position tokens of a
trained tokenizer, and the visual-token rule against the real processor (also under `model.image_size`)."""

from __future__ import annotations

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.families import get_family
from vlmctl.families.idefics3 import ROW_COL_TOKENS, idefics3_tokens

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import count_parameters, decoder_layer_classes, vision_layer_classes
    from vlmctl.models.build import instantiate, plan_build

    spec = get_family("idefics3")
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == spec.model_class
    assert (spec.vision_tower, spec.projector, spec.language_model) == ("model.vision_model", ("model.connector",), "model.text_model")
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == ["LlamaDecoderLayer"]  # discovered
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == ["Idefics3EncoderLayer"]
    counts = count_parameters(model, spec)
    assert counts["projector"] == sum(p.numel() for p in model.get_submodule("model.connector").parameters())


@pytest.mark.parametrize("image_size", [None, 128])
def test_visual_token_rule_matches_the_real_processor(image_size):
    from PIL import Image

    from vlmctl.models.build import make_processor, plan_build

    spec = get_family("idefics3")
    plan = plan_build(ModelSection(preset=spec.tiny_preset, init="random", image_size=image_size))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    assert processor.image_seq_len == (64 // 16) ** 2 // 2**2
    assert processor.image_processor.size["longest_edge"] == (image_size or 256)
    for token in ROW_COL_TOKENS:  # the processor writes them around each tile: one token each
        assert len(processor.tokenizer.encode(token, add_special_tokens=False)) == 1
    image_id = processor.tokenizer.convert_tokens_to_ids(spec.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    seen = set()
    for w, h in [(64, 64), (100, 60), (37, 211), (640, 480)]:
        batch = processor(images=[Image.new("RGB", (w, h))], text=[text], return_tensors="pt")
        actual = int((batch["input_ids"] == image_id).sum())
        assert spec.num_visual_tokens(w, h, processor) == actual, (w, h)
        seen.add(actual)
    assert len(seen) > 1


def test_visual_token_rule_from_a_config():
    # SmolVLM-256M-like: 512 px tiles, patch 16, scale factor 4 -> 64 tokens per tile; longest edge 4 tiles.
    config = {"vision_config": {"image_size": 512, "patch_size": 16}, "scale_factor": 4}
    assert idefics3_tokens(512, 512, config) == 64 * (4 * 4 + 1)
    assert idefics3_tokens(2048, 512, config) == 64 * (4 * 1 + 1)
