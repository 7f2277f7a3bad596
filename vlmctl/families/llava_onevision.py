"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): a SigLIP encoder, LLaVA's MLP projector and Qwen2,
with LLaVA-NeXT's anyres tiling capped at `anyres_max_N` (Li et al. 2024, https://arxiv.org/abs/2408.03326).

Module paths (transformers 5.23, checked by tests/unit/test_families_llava_onevision.py):

| part           | path                        |
|----------------|-----------------------------|
| vision tower   | model.vision_tower          |
| projector      | model.multi_modal_projector |
| language model | model.language_model        |
| lm head        | lm_head                     |

As in LLaVA-NeXT (whose helpers this module shares), `model.image_newline` is a parameter that counts with the
language model, and the processor's padded tiles are dropped before batching. Differences: the base view has
`num_image_tokens` features, and a tile grid with more than N tiles' worth of features is shrunk
(`vision_aspect_ratio` "anyres_max_N"). The processor's `batch_num_images` (images per sample) goes to the model,
which tiles only the images of single-image samples. The data pipeline passes a sample's images as one flat list,
which the processor counts as single images: every image is tiled, as the visual-token rule assumes (called with
nested lists `[[img, img]]`, the images of a multi-image sample become one view each and the rule over-counts).
Images only (videos need torchvision for their processor).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from vlmctl.families.llava_next import LlavaNextSpec, anyres_tokens, drop_padded_tiles
from vlmctl.families.registry import register
from vlmctl.families.spec import setting, split_source

PUBLISHED_PINPOINTS = [[384 * r, 384 * c] for r in range(1, 7) for c in range(1, 7)]
"""`LlavaOnevisionConfig`'s default `image_grid_pinpoints` (1 to 6 tiles of 384 px a side)."""


def _max_tiles(aspect_ratio: str) -> int:
    # "anyres_max_9" -> 9 (LlavaOnevisionProcessor strips the prefix the same way)
    return int(aspect_ratio.strip("anyres_max_"))


def llava_onevision_tokens(width: int, height: int, source: Any) -> int:
    """LLaVA-OneVision, an image alone in its sample: `anyres_tokens` with `num_image_tokens` = (tile / patch)**2
    features per tile and for the base view, the tile grid capped by `anyres_max_N`; the `default` feature
    strategy drops one.

    Source: transformers `LlavaOnevisionProcessor.replace_image_token` / `_get_number_of_features` (5.23).
    """
    proc, improc, cfg = split_source(source)
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        tile, patch = int(setting(vcfg, "image_size", default=384)), int(setting(vcfg, "patch_size", default=14))
        per_tile = (tile // patch) ** 2
        pinpoints = setting(cfg, "image_grid_pinpoints", default=PUBLISHED_PINPOINTS)
        aspect = setting(cfg, "vision_aspect_ratio", default="anyres_max_9")
        strategy = setting(cfg, "vision_feature_select_strategy", default="full")
    else:
        tile = int(setting(improc, "size")["height"])
        per_tile = int(setting(proc, "num_image_tokens"))
        pinpoints = setting(improc, "image_grid_pinpoints")
        aspect = setting(proc, "vision_aspect_ratio", default="anyres_max_9")
        strategy = setting(proc, "vision_feature_select_strategy", default="full")
    grid = int(math.sqrt(per_tile))
    n = anyres_tokens(height, width, tile=tile, grid=grid, pinpoints=pinpoints, base=per_tile,
                      max_num_patches=_max_tiles(aspect))
    return n - (1 if strategy == "default" else 0)


class LlavaOnevisionSpec(LlavaNextSpec):
    """LLaVA-OneVision's build recipe and batching (LLaVA-NeXT's, with its own processor settings)."""

    def processor_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`num_image_tokens` = (image_size / patch_size)**2, the feature strategy and `vision_aspect_ratio`."""
        vision = config["vision_config"]
        return {"num_image_tokens": (int(vision["image_size"]) // int(vision["patch_size"])) ** 2,
                "vision_feature_select_strategy": config.get("vision_feature_select_strategy", "full"),
                "vision_aspect_ratio": config.get("vision_aspect_ratio", "anyres_max_9")}

    def default_image_size(self, image_processor: Any) -> int | None:
        """The tile side: an image of that side is one tile plus the base view."""
        return int(image_processor.size["height"])

    def processor_outputs(self, outputs: Mapping[str, Any], processor: Any) -> dict[str, Any]:
        """Padded tiles dropped (`drop_padded_tiles`); the images of a multi-image sample are one view each."""
        per_sample = outputs.get("batch_num_images")
        tiled = None if per_sample is None else [int(n) == 1 for n in per_sample.tolist() for _ in range(int(n))]
        return drop_padded_tiles(outputs, processor, tiled)


LLAVA_ONEVISION = register(LlavaOnevisionSpec(
    name="llava_onevision",
    model_types=("llava_onevision",),
    model_class="LlavaOnevisionForConditionalGeneration",
    config_class="LlavaOnevisionConfig",
    processor_class="LlavaOnevisionProcessor",
    vision_tower="model.vision_tower",
    projector=("model.multi_modal_projector",),
    language_model="model.language_model",
    decoder_layer_classes=("Qwen2DecoderLayer",),
    vision_layer_classes=("SiglipEncoderLayer",),
    modalities={"image": "<image>"},
    visual_token_rule=llava_onevision_tokens,
    image_grid_args=("image_sizes", "batch_num_images"),
    special_tokens=("<|im_start|>", "<|im_end|>", "<image>", "<video>", "<pad>"),
    extra_special_tokens={"video_token": "<video>"},
    config_token_ids={"image_token_id": "<image>", "video_token_id": "<video>"},
    image_processor_class="LlavaOnevisionImageProcessor",
    video_processor_class="LlavaOnevisionVideoProcessor",
    tiny_preset="tiny-llava-onevision",
    lmms_model="llava_hf",
    notes="SigLIP + Qwen2; anyres tiles + a base view, capped at anyres_max_N tiles' worth of features.",
))
