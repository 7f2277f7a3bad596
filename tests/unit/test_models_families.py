"""Every registered family that takes images, built from its tiny preset: module paths on real transformers classes,
a forward/backward, and the visual-token rule against its real processor. Family-specific checks live in
tests/unit/test_families_<family>.py (audio families: tests/unit/test_audio_qwen2.py); the registry's in
tests/unit/test_families_registry.py."""

from __future__ import annotations

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.families import FAMILIES, count_parameters, decoder_layer_classes, decoder_layers, detect_family, parts, vision_layer_classes
from vlmctl.models import build_model, load_model

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10
TINY = {name: spec.tiny_preset for name, spec in FAMILIES.items() if spec.tiny_preset}
IMAGES = {name: preset for name, preset in TINY.items() if "image" in FAMILIES[name].modalities}
SIZES = [(64, 64), (100, 60), (37, 211), (300, 200), (640, 480)]


def test_every_family_has_a_tiny_preset():
    assert set(TINY) == set(FAMILIES)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, preset in IMAGES.items():
        build_model(ModelSection(preset=preset, init="random", output_dir=root / name, dtype="fp32"), tokenizer_texts=TEXTS)
        out[name] = load_model(root / name)
    return out


@pytest.mark.parametrize("name", list(IMAGES))
def test_family_paths_forward_backward(built, name):
    import torch
    from PIL import Image

    model, processor, fam = built[name]
    assert fam.name == name and type(model).__name__ == fam.model_class and detect_family(model.config) == name
    # Every parameter belongs to exactly one part, and each part has parameters.
    counts = count_parameters(model, fam)
    assert min(counts["vision"], counts["projector"], counts["llm"]) > 0
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    mods = parts(model, fam)
    assert sum(p.numel() for m in mods["projector"] for p in m.parameters()) == counts["projector"]
    assert len(decoder_layers(model, fam)) == model.config.get_text_config().num_hidden_layers
    assert all(isinstance(layer, decoder_layer_classes(model, fam)) for layer in decoder_layers(model, fam))
    assert vision_layer_classes(model, fam)
    # One forward/backward with an image through the real processor.
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    text = processor.apply_chat_template(messages)
    batch = processor(images=[Image.new("RGB", (96, 80), (220, 40, 40))], text=[text], return_tensors="pt")
    for arg in fam.image_grid_args:
        assert arg in batch
    model.train()
    torch.manual_seed(0)
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)
    # the image reached the loss: gradients in the encoder that takes images (a family may have others before it)
    image_encoder = next(e.path for e in fam.encoders.values() if "image" in e.modalities)
    vision_grads = [p.grad for n, p in model.named_parameters() if n.startswith(image_encoder + ".") and p.grad is not None]
    assert vision_grads and any(g.abs().sum() > 0 for g in vision_grads)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", list(IMAGES))
def test_visual_token_rule_matches_processor(built, name):
    from PIL import Image

    _, processor, fam = built[name]
    image_id = processor.tokenizer.convert_tokens_to_ids(fam.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    seen = set()
    for w, h in SIZES:
        batch = processor(images=[Image.new("RGB", (w, h), (0, 0, 255))], text=[text], return_tensors="pt")
        actual = int((batch["input_ids"] == image_id).sum())
        assert fam.num_visual_tokens(w, h, processor) == actual, (w, h)
        seen.add(actual)
    if not fam.fixed_image_tokens:  # dynamic-resolution families: the size matters
        assert len(seen) > 1


def test_visual_token_rule_from_config(built):
    model, processor, fam = built["llava"]
    assert fam.num_visual_tokens(64, 64, model.config) == fam.num_visual_tokens(64, 64, processor) == 64
    model, processor, fam = built["qwen2_5_vl"]
    # From a config the published processor settings are assumed: 28 px per token, 448x448 -> 256 tokens.
    assert fam.num_visual_tokens(448, 448, model.config) == 256
