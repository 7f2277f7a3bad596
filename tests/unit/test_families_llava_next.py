"""The LLaVA-NeXT family module: module paths and layer classes on the real class, the anyres visual-token rule
against the real processor and from a config, and the padded tiles dropped before batching."""

from __future__ import annotations

from vlmctl.config.model import ModelSection
from vlmctl.families import get_family
from vlmctl.families.llava_next import llava_next_tokens

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import count_parameters, decoder_layer_classes, vision_layer_classes
    from vlmctl.models.build import instantiate, plan_build

    spec = get_family("llava_next")
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == spec.model_class
    for path in (spec.vision_tower, *spec.projector, spec.language_model, spec.lm_head):
        model.get_submodule(path)
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == ["MistralDecoderLayer"]  # discovered
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == ["CLIPEncoderLayer"]
    counts = count_parameters(model, spec)
    assert counts["projector"] == sum(p.numel() for p in model.get_submodule("model.multi_modal_projector").parameters())
    assert model.config.image_grid_pinpoints[0] == [32, 64]


def _processor():
    from vlmctl.models.build import make_processor, plan_build

    spec = get_family("llava_next")
    return spec, make_processor(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), tokenizer_texts=TEXTS)


def test_visual_token_rule_matches_the_real_processor():
    from PIL import Image

    spec, processor = _processor()
    # the config's pinpoints reached the image processor; CLIP's CLS token and the `default` strategy cancel out
    assert processor.image_processor.image_grid_pinpoints[0] == [32, 64]
    assert (processor.patch_size, processor.num_additional_image_tokens, processor.vision_feature_select_strategy) == (8, 1, "default")
    image_id = processor.tokenizer.convert_tokens_to_ids(spec.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    seen = set()
    for w, h in [(64, 64), (100, 60), (37, 211), (300, 200), (640, 480), (20, 20)]:
        batch = processor(images=[Image.new("RGB", (w, h))], text=[text], return_tensors="pt")
        actual = int((batch["input_ids"] == image_id).sum())
        assert spec.num_visual_tokens(w, h, processor) == actual, (w, h)
        seen.add(actual)
    assert len(seen) > 2


def test_visual_token_rule_from_a_config():
    # llava-v1.6-mistral-7b-hf: 336 px CLIP tiles of 24 x 24 patches, `default` strategy.
    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    config = {"vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
              "image_grid_pinpoints": pinpoints, "vision_feature_select_strategy": "default"}
    # a square image: 2 x 2 tiles -> 48 x 48 features + 48 newlines, plus the 576-feature base view
    assert llava_next_tokens(672, 672, config) == 48 * 48 + 48 + 576


def test_processor_outputs_drop_the_padded_tiles():
    import torch
    from PIL import Image

    spec, processor = _processor()
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}])
    images = [Image.new("RGB", (64, 64)), Image.new("RGB", (37, 211))]  # 4 + 1 and 3 + 1 tiles
    out = processor(images=images, text=[text], return_tensors="pt")
    assert tuple(out["pixel_values"].shape) == (2, 5, 3, 32, 32)  # padded to the largest image's tiles
    flat = spec.processor_outputs(out, processor)
    assert tuple(flat["pixel_values"].shape) == (9, 3, 32, 32)
    assert torch.equal(flat["pixel_values"][5:], out["pixel_values"][1, :4])
    assert spec.processor_outputs(flat, processor)["pixel_values"] is flat["pixel_values"]  # already flat
