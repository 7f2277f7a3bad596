"""LLaVA-NeXT (LLaVA-1.6, `LlavaNextForConditionalGeneration`): a CLIP encoder, LLaVA's MLP projector and any
causal LM, with "anyres" tiling (Liu et al. 2024, https://llava-vl.github.io/blog/2024-01-30-llava-next/).

Module paths (transformers 5.23, checked by tests/unit/test_families_llava_next.py):

| part           | path                        |
|----------------|-----------------------------|
| vision tower   | model.vision_tower          |
| projector      | model.multi_modal_projector |
| language model | model.language_model        |
| lm head        | lm_head                     |

The learned row separator `model.image_newline` is a parameter, not a module: it counts with the language model.

Images only, anyres: the image is resized into the grid resolution (`image_grid_pinpoints`) that best fits it,
cut into tiles of the encoder's size, and a resized base view is added; the tiles' features are unpadded to the
image's aspect ratio with one newline feature per row. So the number of `<image>` tokens depends on the image's
size (`anyres_tokens`). The processor returns `pixel_values` [n_images, max_tiles, 3, H, W] padded with empty tiles;
`processor_outputs` drops the padding to [tiles, 3, H, W] so images of different samples concatenate (the model
takes both layouts and counts each image's tiles from `image_sizes`). Layer classes are discovered (the LLM and
encoder vary between checkpoints).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from vlmctl.families.encoders import image_encoder, vision_cost
from vlmctl.families.registry import register
from vlmctl.families.spec import CLS_VISION_TYPES, FamilySpec, setting, split_source

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.


def anyres_tiles(height: int, width: int, pinpoints: list, tile: int) -> int:
    """Tiles (base view included) of one image in anyres: the grid of the best-fitting pinpoint resolution plus one.

    Source: transformers `image_size_to_num_patches` (`models/llava_next/modeling_llava_next.py`, 5.23).
    """
    from transformers.image_processing_utils import select_best_resolution

    best_h, best_w = select_best_resolution((height, width), [list(p) for p in pinpoints])
    return (best_h // tile) * (best_w // tile) + 1


def anyres_tokens(height: int, width: int, *, tile: int, grid: int, pinpoints: list, base: int,
                  max_num_patches: int | None = None) -> int:
    """Visual features of one `height` x `width` image in anyres: `base` (the base view) plus the tiles' feature
    grid (`grid` x `grid` per `tile`-px tile) unpadded to the image's aspect ratio, plus one newline per row;
    `max_num_patches` (LLaVA-OneVision's `anyres_max_N`) shrinks a grid larger than N tiles' worth of features.

    Source: transformers `LlavaNextProcessor._get_number_of_features` / `_get_unpadded_features` and
    `LlavaOnevisionProcessor._get_unpadded_features` (5.23).
    """
    from transformers.image_processing_utils import select_best_resolution

    best_h, best_w = select_best_resolution((height, width), [list(p) for p in pinpoints])
    cur_h, cur_w = grid * (best_h // tile), grid * (best_w // tile)
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new_h) // 2 * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new_w) // 2 * 2
    unpadded, newlines = cur_h * cur_w, cur_h
    if max_num_patches is not None:
        ratio = math.sqrt(cur_h * cur_w / (max_num_patches * grid**2))
        if ratio > 1.1:
            unpadded, newlines = int(cur_h // ratio) * int(cur_w // ratio), int(cur_h // ratio)
    return unpadded + newlines + base


def _tile(improc: Any) -> int:
    """The tile side (px) of a LLaVA-NeXT image processor: its crop size, else its size."""
    crop = setting(improc, "crop_size") if setting(improc, "do_center_crop", default=True) else None
    size = crop or setting(improc, "size")
    return int(size.get("height") or size.get("shortest_edge"))


def llava_next_tokens(width: int, height: int, source: Any) -> int:
    """LLaVA-NeXT: `anyres_tokens` with (tile / patch)**2 features per tile and a base view of as many plus the CLS
    token (`num_additional_image_tokens`); the `default` feature strategy drops one.

    Source: transformers `LlavaNextProcessor.replace_image_token` (5.23).
    """
    proc, improc, cfg = split_source(source)
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        tile, patch = int(setting(vcfg, "image_size", default=336)), int(setting(vcfg, "patch_size", default=14))
        pinpoints = setting(cfg, "image_grid_pinpoints")
        extra = 1 if setting(vcfg, "model_type", default="clip_vision_model") in CLS_VISION_TYPES else 0
        strategy = setting(cfg, "vision_feature_select_strategy", default="default")
    else:
        tile, patch = _tile(improc), int(setting(proc, "patch_size"))
        pinpoints = setting(improc, "image_grid_pinpoints")
        extra = int(setting(proc, "num_additional_image_tokens", default=0))
        strategy = setting(proc, "vision_feature_select_strategy", default="default")
    grid = tile // patch
    n = anyres_tokens(height, width, tile=tile, grid=grid, pinpoints=pinpoints, base=grid * grid + extra)
    return n - (1 if strategy == "default" else 0)


def drop_padded_tiles(outputs: Mapping[str, Any], processor: Any, tiled: list[bool] | None = None) -> dict[str, Any]:
    """`outputs` with `pixel_values` [n_images, max_tiles, 3, H, W] (padded with empty tiles) flattened to
    [total tiles, 3, H, W]. `tiled[i]` False: image i is its base view only (LLaVA-OneVision's multi-image samples).
    Other layouts are returned unchanged."""
    import torch

    pixels = outputs.get("pixel_values")
    if pixels is None or pixels.ndim != 5:
        return dict(outputs)
    improc = processor.image_processor
    tile = int(pixels.shape[-1])
    sizes = outputs["image_sizes"].tolist()
    tiled = [True] * len(sizes) if tiled is None else tiled
    counts = [anyres_tiles(h, w, improc.image_grid_pinpoints, tile) if t else 1 for (h, w), t in zip(sizes, tiled)]
    return {**outputs, "pixel_values": torch.cat([p[:n] for p, n in zip(pixels, counts)])}


class LlavaNextSpec(FamilySpec):
    """LLaVA-NeXT's build recipe and batching: the processor's patch size / feature strategy from the config, the
    grid pinpoints shared by config and image processor, padded tiles dropped before batching."""

    def processor_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`patch_size`, `vision_feature_select_strategy` and the CLS token count of the processor."""
        vision = config.get("vision_config") or {}
        return {"patch_size": int(vision.get("patch_size", 14)),
                "vision_feature_select_strategy": config.get("vision_feature_select_strategy", "default"),
                "num_additional_image_tokens": int(vision.get("model_type", "clip_vision_model") in CLS_VISION_TYPES)}

    def preset_processor(self, tokenizer: Any, chat_template: str | None, kwargs: Mapping[str, Any], config: Mapping[str, Any]):
        """The image processor gets the config's `image_grid_pinpoints` (one source for model and processor)."""
        kwargs = {**kwargs, "image_grid_pinpoints": config["image_grid_pinpoints"]}
        return super().preset_processor(tokenizer, chat_template, kwargs, config)

    def default_image_size(self, image_processor: Any) -> int | None:
        """The tile side: an image of that side is one tile plus the base view."""
        return _tile(image_processor)

    def processor_outputs(self, outputs: Mapping[str, Any], processor: Any) -> dict[str, Any]:
        """Padded tiles dropped: `pixel_values` [tiles of all images, 3, H, W] (`drop_padded_tiles`)."""
        return drop_padded_tiles(outputs, processor)


LLAVA_NEXT = register(LlavaNextSpec(
    name="llava_next",
    collate_prompts=True,
    model_types=("llava_next",),
    model_class="LlavaNextForConditionalGeneration",
    config_class="LlavaNextConfig",
    processor_class="LlavaNextProcessor",
    encoders={"image": image_encoder("model.vision_tower", cost=vision_cost(feature_layer=True))},
    projector=("model.multi_modal_projector",),
    language_model="model.language_model",
    modalities={"image": "<image>"},
    visual_token_rule=llava_next_tokens,
    image_grid_args=("image_sizes",),
    special_tokens=("<|im_start|>", "<|im_end|>", "<image>", "<pad>"),
    config_token_ids={"image_token_id": "<image>"},
    image_processor_class="LlavaNextImageProcessor",
    tiny_preset="tiny-llava-next",
    lmms_model="llava_hf",
    notes="LLaVA-1.6: anyres tiles + a base view; tokens depend on the image size. image_newline counts as llm.",
))
