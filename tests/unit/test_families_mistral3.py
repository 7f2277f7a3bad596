"""The Mistral 3 family module: module paths and layer classes on the real class, `PixtralProcessor` made, saved and
loaded without torchvision, and the visual-token rule (rows of merged patches, `[IMG_BREAK]` per row, `[IMG_END]`)
against the real processor built from the tiny preset's config, under `model.image_size`, and from a published
config."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.families import get_family
from vlmctl.families.mistral3 import BREAK_TOKEN, END_TOKEN, mistral3_tokens, pixtral_grid, pixtral_processor_class

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10
SIZES = [(64, 64), (100, 60), (37, 211), (640, 480), (5, 5), (129, 17)]


def _processor(image_size: int | None = None):
    from vlmctl.models.build import make_processor, plan_build

    spec = get_family("mistral3")
    return make_processor(plan_build(ModelSection(preset=spec.tiny_preset, init="random", image_size=image_size)),
                          tokenizer_texts=TEXTS)


def _prompt(processor) -> str:
    return processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import count_parameters, decoder_layer_classes, vision_layer_classes
    from vlmctl.models.build import instantiate, plan_build

    spec = get_family("mistral3")
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == spec.model_class
    for path in (spec.vision_tower, *spec.projector, spec.language_model, spec.lm_head):
        model.get_submodule(path)
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == ["MistralDecoderLayer"]  # discovered
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == ["PixtralAttentionLayer"]
    projector = model.get_submodule("model.multi_modal_projector")
    assert count_parameters(model, spec)["projector"] == sum(p.numel() for p in projector.parameters())
    assert "patch_merger" in dict(projector.named_children())  # the merger counts as projector


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="checks the install without torchvision")
def test_the_processor_is_made_saved_and_loaded_without_torchvision(tmp_path):
    import transformers

    from vlmctl.models import build_model
    from vlmctl.models.load import load_processor

    with pytest.raises(ImportError, match="[Tt]orchvision"):
        transformers.PixtralProcessor.from_pretrained  # noqa: B018  transformers' own placeholder refuses
    cls = pixtral_processor_class()
    assert (cls.__name__, cls.__module__) == ("PixtralProcessor", "transformers.models.pixtral.processing_pixtral")
    # the torchvision image-processor module is not left shadowed by the PIL one
    assert "transformers.models.pixtral.image_processing_pixtral" not in sys.modules

    spec = get_family("mistral3")
    build_model(ModelSection(preset=spec.tiny_preset, init="random", output_dir=tmp_path / "m", dtype="fp32"), tokenizer_texts=TEXTS)
    loaded = load_processor(tmp_path / "m")
    assert type(loaded) is cls and type(loaded.image_processor).__name__ == "PixtralImageProcessorPil"
    assert (loaded.patch_size, loaded.spatial_merge_size) == (8, 2)

    from PIL import Image

    made = _processor()
    image = Image.new("RGB", (100, 60), (10, 200, 30))
    a = made(images=[image], text=[_prompt(made)], return_tensors="pt")
    b = loaded(images=[image], text=[_prompt(loaded)], return_tensors="pt")
    assert a["input_ids"].tolist() == b["input_ids"].tolist()
    assert a["pixel_values"].equal(b["pixel_values"]) and a["image_sizes"].tolist() == b["image_sizes"].tolist()


@pytest.mark.parametrize("image_size", [None, 128])
def test_visual_token_rule_matches_the_real_processor(image_size):
    from PIL import Image

    spec = get_family("mistral3")
    processor = _processor(image_size)
    assert (processor.patch_size, processor.spatial_merge_size) == (8, 2)  # from the preset's config
    assert processor.image_processor.size.longest_edge == (image_size or 64)
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in (spec.image_token, BREAK_TOKEN, END_TOKEN)}
    seen = set()
    for w, h in SIZES:
        batch = processor(images=[Image.new("RGB", (w, h))], text=[_prompt(processor)], return_tensors="pt")
        row = batch["input_ids"][0].tolist()
        count = {t: row.count(i) for t, i in ids.items()}
        rows, cols = pixtral_grid(w, h, longest_edge=image_size or 64, token_px=16)
        assert spec.num_visual_tokens(w, h, processor) == count[spec.image_token] == rows * cols, (w, h)
        assert (count[BREAK_TOKEN], count[END_TOKEN]) == (rows - 1, 1), (w, h)
        assert batch["image_sizes"].tolist() == [[rows * 16, cols * 16]]  # what the encoder and the merger cut
        # the whole text as the processor writes it (rows of [IMG], [IMG_BREAK] / [IMG_END]), for token counts
        assert tok(spec.expand_images(_prompt(processor), [(w, h)], processor), add_special_tokens=False)["input_ids"] == row
        seen.add(rows * cols)
    assert len(seen) > 1


def test_visual_token_rule_from_a_config_matches_the_published_processor_settings():
    # Mistral-Small-3.1-like: 14 px patches merged 2 x 2 (28 px per token), longest edge 1540 = vision image_size.
    from PIL import Image
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    config = {"vision_config": {"image_size": 1540, "patch_size": 14}, "spatial_merge_size": 2}
    tok = _processor().tokenizer
    published = pixtral_processor_class()(
        image_processor=PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14}),
        tokenizer=tok, patch_size=14, spatial_merge_size=2)
    image_id = tok.convert_tokens_to_ids("[IMG]")
    for w, h in [(1540, 1540), (2000, 1000), (300, 451)]:
        batch = published(images=[Image.new("RGB", (w, h))], text=["[IMG]"], return_tensors="pt")
        actual = int((batch["input_ids"] == image_id).sum())
        assert mistral3_tokens(w, h, config) == actual == mistral3_tokens(w, h, published), (w, h)
    assert mistral3_tokens(1540, 1540, config) == 55 * 55


def test_the_vision_tower_takes_per_image_boundaries_from_the_varlen_implementation():
    """Pixtral encodes a step's images as one sequence; under the varlen name (`vision_varlen`) it passes one
    segment per image instead of the dense block mask. A per-segment sdpa stands in for the CUDA kernel here: the
    vision tower's output must equal the dense-mask sdpa path's."""
    import torch
    import torch.nn.functional as F
    from transformers import AttentionInterface

    from vlmctl.models.build import instantiate, plan_build
    from vlmctl.train.kernels import VARLEN_NAME, VISION_VARLEN_NAME, register_varlen_attention, set_attention

    spec = get_family("mistral3")
    assert spec.vision_varlen
    torch.manual_seed(0)
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="cpu").float().eval()
    vision = model.get_submodule(spec.vision_tower)
    config = model.config.vision_config
    pixels = torch.randn(2, 3, config.image_size, config.image_size)
    sizes = torch.tensor([[config.image_size, config.image_size // 2], [config.image_size // 2, config.image_size]])
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dense = vision(pixels, image_sizes=sizes).last_hidden_state
    seen = []

    def per_segment(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cu = kwargs["cu_seq_lens_q"].tolist()
        seen.append((cu, attention_mask))
        parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scaling)
                 for a, b in zip(cu, cu[1:])]
        return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None

    try:
        AttentionInterface.register(VARLEN_NAME, per_segment)
        AttentionInterface.register(VISION_VARLEN_NAME, per_segment)
        set_attention(model, VARLEN_NAME, vision_varlen=True)
        with torch.no_grad():
            varlen = vision(pixels, image_sizes=sizes).last_hidden_state
    finally:
        register_varlen_attention()  # the real kernel under both names again
    patches = [int(h) // config.patch_size * (int(w) // config.patch_size) for h, w in sizes.tolist()]
    assert seen and all(cu == [0, patches[0], sum(patches)] and mask is None for cu, mask in seen)
    torch.testing.assert_close(varlen, dense, rtol=1e-4, atol=1e-5)
