"""Helpers shared by the convert tests and their distributed workers: the tiny model and its probe logits."""

from __future__ import annotations

from pathlib import Path

TEXTS = [
    "What color is the triangle? The triangle is red.",
    "What shape is the blue object? It is a circle.",
    "How many squares are there? There are 2 squares.",
    "Is the square left of the circle? yes no",
    "What is in the image? Describe the colors and shapes.",
] * 20


def make_tiny_model(out: Path, seed: int = 0) -> Path:
    """Build the tiny random LLaVA preset (model + processor, fp32) into `out` with `vlmctl model build`'s library."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    out = Path(out)
    build_model(ModelSection(preset="tiny", init="random", output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS, seed=seed)
    return out


def source_logits(model_dir: Path):
    """Probe logits [1, T, vocab] of an HF folder (or adapter folder) loaded with the Auto classes."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.convert import probe_inputs, probe_logits

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype="auto").eval()
    return probe_logits(model, probe_inputs(AutoProcessor.from_pretrained(str(model_dir))))


def make_preset(out: Path, preset: str, seed: int = 0) -> Path:
    """Build the random whole-model `preset` (model + processor, fp32) into `out`."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    out = Path(out)
    build_model(ModelSection(preset=preset, init="random", output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS, seed=seed)
    return out


def make_clip_llava(out: Path, tiny: Path, seed: int = 0) -> Path:
    """A tiny random CLIP (64 px, patch 8, class token dropped: `default` strategy) + the tiny preset's Qwen2, LLaVA
    layout, saved with the tiny preset's tokenizer and a CLIP image processor into `out`. `tiny`: a tiny preset
    folder (`make_tiny_model`)."""
    import torch
    from transformers import AutoProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from vlmctl.models.load import image_processor_class

    base = LlavaConfig.from_pretrained(str(tiny))
    vision = CLIPVisionConfig(image_size=64, patch_size=8, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                              num_attention_heads=4, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    config = LlavaConfig(vision_config=vision, text_config=base.text_config, image_token_id=base.image_token_id,
                         vision_feature_layer=-1, vision_feature_select_strategy="default", image_seq_length=64,
                         tie_word_embeddings=base.tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    source = AutoProcessor.from_pretrained(str(tiny))
    image = image_processor_class("CLIPImageProcessor")(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    processor = LlavaProcessor(image_processor=image, tokenizer=source.tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=source.chat_template)
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return Path(out)
