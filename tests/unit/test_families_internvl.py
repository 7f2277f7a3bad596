"""The InternVL family module: module paths and layer classes on the real class, the tokenizer attributes the
processor reads, and the visual-token rule (tiles + thumbnail) against the real processor and from a config."""

from __future__ import annotations

from vlmctl.config.model import ModelSection
from vlmctl.families import get_family
from vlmctl.families.internvl import internvl_tiles, internvl_tokens

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import count_parameters, decoder_layer_classes, vision_layer_classes
    from vlmctl.models.build import instantiate, plan_build

    spec = get_family("internvl")
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == spec.model_class
    for path in (spec.vision_tower, *spec.projector, spec.language_model, spec.lm_head):
        model.get_submodule(path)
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == ["Qwen3DecoderLayer"]  # discovered
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == list(spec.vision_layer_classes)
    counts = count_parameters(model, spec)
    assert counts["projector"] == sum(p.numel() for p in model.get_submodule("model.multi_modal_projector").parameters())


def test_visual_token_rule_matches_the_real_processor():
    from PIL import Image

    from vlmctl.models.build import make_processor, plan_build

    spec = get_family("internvl")
    processor = make_processor(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), tokenizer_texts=TEXTS)
    assert processor.image_seq_length == (64 // 16) ** 2 // 4  # pixel shuffle 0.5
    tok = processor.tokenizer
    assert processor.image_token == spec.image_token
    assert tok.convert_tokens_to_ids(["<img>", "</img>"]) == [processor.start_image_token_id, processor.end_image_token_id]
    image_id = tok.convert_tokens_to_ids(spec.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    seen = set()
    for w, h in [(64, 64), (100, 60), (37, 211), (300, 200), (640, 480)]:
        batch = processor(images=[Image.new("RGB", (w, h))], text=[text], return_tensors="pt")
        actual = int((batch["input_ids"] == image_id).sum())
        assert spec.num_visual_tokens(w, h, processor) == actual, (w, h)
        assert batch["pixel_values"].shape[0] * processor.image_seq_length == actual  # one tile per pixel_values row
        seen.add(actual)
    assert len(seen) > 1


def test_visual_token_rule_from_a_config():
    # InternVL3-1B-hf: 448 px tiles, patch 14, pixel shuffle 0.5 -> 256 tokens per tile, up to 12 tiles + thumbnail.
    config = {"vision_config": {"image_size": [448, 448], "patch_size": [14, 14]}, "downsample_ratio": 0.5}
    assert internvl_tokens(448, 448, config) == 256
    assert internvl_tokens(896, 448, config) == 256 * (2 + 1)
    assert internvl_tiles(4000, 100, 448, 1, 12) == 12 + 1  # a very wide image: the widest grid


def test_the_8b_preset_has_the_published_shape():
    """The `internvl3-8b` preset builds InternVL3-8B's architecture (meta device, no weights): 7.94B parameters of
    which 0.30B in InternViT-300M, and 256 visual tokens per 448 px tile (pixel shuffle 0.5 of 32 x 32 patches)."""
    import torch
    import transformers

    from vlmctl.models.build import make_config, plan_build

    cfg = make_config(plan_build(ModelSection(preset="internvl3-8b", init="random")))
    with torch.device("meta"):
        model = transformers.InternVLForConditionalGeneration(cfg)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.vision_tower.parameters())
    assert 7.90e9 < total < 7.98e9 and 0.29e9 < vision < 0.31e9
    assert internvl_tokens(448, 448, cfg) == 256
