"""The SmolVLM family module: its own transformers classes on Idefics3's recipe (module paths and layer classes on the
real class), the image-only `SmolVLMProcessor` made, saved and loaded without torchvision, and the visual-token rule
and marker text against the real processor (also under `model.image_size`) and from a published config."""

from __future__ import annotations

import importlib.util

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.families import get_family
from vlmctl.families.idefics3 import ROW_COL_TOKENS, Idefics3Spec

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10


def _processor(image_size: int | None = None):
    from vlmctl.models.build import make_processor, plan_build

    spec = get_family("smolvlm")
    return make_processor(plan_build(ModelSection(preset=spec.tiny_preset, init="random", image_size=image_size)),
                          tokenizer_texts=TEXTS)


def _prompt(processor) -> str:
    return processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import count_parameters, decoder_layer_classes, vision_layer_classes
    from vlmctl.models.build import instantiate, plan_build

    spec = get_family("smolvlm")
    assert isinstance(spec, Idefics3Spec) and spec is not get_family("idefics3") and not spec.compose
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == spec.model_class == "SmolVLMForConditionalGeneration"
    for path in (spec.vision_tower, *spec.projector, spec.language_model, spec.lm_head):
        model.get_submodule(path)
    assert type(model.get_submodule(spec.vision_tower)).__name__ == "SmolVLMVisionTransformer"
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == ["LlamaDecoderLayer"]  # discovered
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == ["SmolVLMEncoderLayer"]
    counts = count_parameters(model, spec)
    assert counts["projector"] == sum(p.numel() for p in model.get_submodule("model.connector").parameters())


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="checks the install without torchvision")
def test_an_image_only_processor_is_made_saved_and_loaded_without_torchvision(tmp_path):
    import transformers
    from PIL import Image

    from vlmctl.models import build_model
    from vlmctl.models.load import load_processor

    with pytest.raises(ImportError, match="[Tt]orchvision"):
        transformers.SmolVLMVideoProcessor()  # why the processor is image-only here
    made = _processor()
    assert type(made).__name__ == "SmolVLMProcessor" and "video_processor" not in made.get_attributes()
    assert made.video_processor.num_frames is None  # what its chat template reads: no video settings
    assert type(made.image_processor).__name__ == "SmolVLMImageProcessorPil"
    spec = get_family("smolvlm")
    build_model(ModelSection(preset=spec.tiny_preset, init="random", output_dir=tmp_path / "m", dtype="fp32"), tokenizer_texts=TEXTS)
    loaded = load_processor(tmp_path / "m")
    assert type(loaded).__name__ == "SmolVLMProcessor" and loaded.image_seq_len == made.image_seq_len
    image = Image.new("RGB", (100, 60), (10, 200, 30))
    a = made(images=[image], text=[_prompt(made)], return_tensors="pt")
    b = loaded(images=[image], text=[_prompt(loaded)], return_tensors="pt")
    assert a["input_ids"].tolist() == b["input_ids"].tolist() and a["pixel_values"].equal(b["pixel_values"])


@pytest.mark.parametrize("image_size", [None, 128])
def test_visual_token_rule_and_markers_match_the_real_processor(image_size):
    from PIL import Image

    spec = get_family("smolvlm")
    processor = _processor(image_size)
    assert type(processor).__name__ == spec.processor_class
    assert processor.image_seq_len == (64 // 16) ** 2 // 2**2
    assert processor.image_processor.size["longest_edge"] == (image_size or 256)
    tok = processor.tokenizer
    for token in ROW_COL_TOKENS:  # the processor writes them around each tile: one token each
        assert len(tok.encode(token, add_special_tokens=False)) == 1
    image_id = tok.convert_tokens_to_ids(spec.image_token)
    seen = set()
    for w, h in [(64, 64), (100, 60), (37, 211), (640, 480)]:
        batch = processor(images=[Image.new("RGB", (w, h))], text=[_prompt(processor)], return_tensors="pt")
        row = batch["input_ids"][0].tolist()
        actual = row.count(image_id)
        assert spec.num_visual_tokens(w, h, processor) == actual, (w, h)
        # the tiles and the global view with their markers, as the processor writes them (token counts)
        assert tok(spec.expand_images(_prompt(processor), [(w, h)], processor), add_special_tokens=False)["input_ids"] == row
        seen.add(actual)
    assert len(seen) > 1


def test_visual_token_rule_from_a_config_matches_the_published_processor_settings():
    # SmolVLM2-2.2B-like: 384 px tiles, patch 14, scale factor 3 -> 81 tokens per view; images resized to a longest
    # edge of 4 tiles (1536 px) first, as the published processor does.
    from PIL import Image
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from vlmctl.families.smolvlm import image_only_processor_class

    spec = get_family("smolvlm")
    config = {"vision_config": {"image_size": 384, "patch_size": 14}, "scale_factor": 3}
    tok = _processor().tokenizer
    published = image_only_processor_class()(
        image_processor=SmolVLMImageProcessorPil(size={"longest_edge": 1536}, max_image_size={"longest_edge": 384}),
        tokenizer=tok, video_processor=None, image_seq_len=81)
    image_id = tok.convert_tokens_to_ids(spec.image_token)
    seen = set()
    for w, h in [(384, 384), (1536, 768), (300, 1000)]:
        batch = published(images=[Image.new("RGB", (w, h))], text=["<image>"], return_tensors="pt")
        actual = int((batch["input_ids"] == image_id).sum())
        assert spec.num_visual_tokens(w, h, config) == actual == spec.num_visual_tokens(w, h, published), (w, h)
        assert actual % 81 == 0
        seen.add(actual)
    assert len(seen) > 1
