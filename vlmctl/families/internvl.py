"""InternVL 3 / 3.5 (transformers-native, `InternVLForConditionalGeneration`): InternViT, a pixel-shuffle MLP
projector and any LLM (Qwen2.5 for InternVL 3, Qwen3 for InternVL 3.5).

Module paths (transformers 5.23, checked by tests/unit/test_families_internvl.py):

| part           | path                        |
|----------------|-----------------------------|
| vision tower   | model.vision_tower          |
| projector      | model.multi_modal_projector |
| language model | model.language_model        |
| lm head        | lm_head                     |

Images only (videos need torchvision for their processor): each image is cut into up to `max_patches` tiles of the
encoder's size on the grid whose aspect ratio is closest to the image's, plus a thumbnail when there is more than
one tile; every tile becomes `image_seq_length` `<IMG_CONTEXT>` tokens (patches after pixel shuffle), framed by
`<img>` / `</img>`. The decoder layer class is discovered (the LLM varies between versions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vlmctl.families.encoders import image_encoder, vision_cost
from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, replace_in_order, setting, split_source

# transformers is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for
# it.

PUBLISHED_MAX_PATCHES = 12
"""`max_patches` of the published InternVL 3 / 3.5 processors (tiles per image, the thumbnail not counted)."""


def _side(value: Any) -> int:
    # InternVL's vision config stores image_size / patch_size as [height, width]; square in every release
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


def internvl_tiles(width: int, height: int, tile: int, min_patches: int, max_patches: int) -> int:
    """Tiles one `width` x `height` image becomes: the grid of at most `max_patches` `tile`-px tiles with the
    closest aspect ratio, plus one thumbnail when the grid has more than one tile.

    Source: transformers `GotOcr2ImageProcessor.get_number_of_image_patches` and `get_optimal_tiled_canvas`
    (`models/got_ocr2/image_processing_pil_got_ocr2.py`, 5.23).
    """
    # The PIL module imports without torchvision (the default one does not).
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    if max_patches <= 1:
        return 1
    cols, rows = get_optimal_tiled_canvas((height, width), (tile, tile), min_patches, max_patches)
    return 1 if cols * rows == 1 else cols * rows + 1


def internvl_tokens(width: int, height: int, source: Any) -> int:
    """InternVL: `image_seq_length` `<IMG_CONTEXT>` tokens per tile (`internvl_tiles`), where
    `image_seq_length` = (image_size / patch_size)**2 * downsample_ratio**2.

    Source: transformers `InternVLProcessor.replace_image_token` (5.23). Counts `<IMG_CONTEXT>` only; the
    processor also writes `<img>` / `</img>` around each image. From a config, the published processor is assumed
    (tiles of the encoder's size, at most 12).
    """
    proc, improc, cfg = split_source(source)
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        tile = _side(setting(vcfg, "image_size", default=448))
        ratio = float(setting(cfg, "downsample_ratio", default=0.5))
        seq = int((tile // _side(setting(vcfg, "patch_size", default=14))) ** 2 * ratio**2)
        return seq * internvl_tiles(width, height, tile, 1, PUBLISHED_MAX_PATCHES)
    size = setting(improc, "size")
    tile = int(size["height"] if isinstance(size, dict) else size.height)
    # InternVLProcessor crops to tiles unless told otherwise (its images_kwargs default), whatever the image
    # processor's own attribute says.
    tiles = internvl_tiles(width, height, tile, int(setting(improc, "min_patches", default=1)),
                           int(setting(improc, "max_patches", default=PUBLISHED_MAX_PATCHES)))
    return int(setting(proc, "image_seq_length", default=256)) * tiles


class InternVLSpec(FamilySpec):
    """InternVL's build recipe: `image_seq_length` of the processor from the config; tile-size image settings."""

    def processor_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`image_seq_length` = (image_size / patch_size)**2 * downsample_ratio**2 (InternVLProcessor docstring)."""
        vision = config["vision_config"]
        ratio = float(config.get("downsample_ratio", 0.5))
        return {"image_seq_length": int((_side(vision["image_size"]) // _side(vision["patch_size"])) ** 2 * ratio**2)}

    def expand_images(self, text: str, sizes: Sequence[tuple[int, int]], processor: Any) -> str | None:
        """Each `<IMG_CONTEXT>` of `text` replaced by `<img>` + its tiles' `<IMG_CONTEXT>` tokens + `</img>`
        (transformers `InternVLProcessor.replace_image_token`, 5.23)."""
        return replace_in_order(text, self.image_prompt, [
            f"<img>{'<IMG_CONTEXT>' * internvl_tokens(w, h, processor)}</img>" for w, h in sizes])

    def default_image_size(self, image_processor: Any) -> int | None:
        """The tile size: an image of that side is one tile."""
        return int(image_processor.size["height"])


INTERNVL = register(InternVLSpec(
    name="internvl",
    model_types=("internvl",),
    model_class="InternVLForConditionalGeneration",
    config_class="InternVLConfig",
    processor_class="InternVLProcessor",
    encoders={"image": image_encoder("model.vision_tower", layer_classes=("InternVLVisionLayer",), cost=vision_cost(feature_layer=True))},
    projector=("model.multi_modal_projector",),
    language_model="model.language_model",
    decoder_layer_classes=(),  # the LLM varies (Qwen2.5, Qwen3, GPT-OSS): discovered
    modalities={"image": "<IMG_CONTEXT>"},
    visual_token_rule=internvl_tokens,
    special_tokens=("<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>", "<pad>"),
    # InternVLProcessor reads these tokenizer attributes (and their `_id`s)
    extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                          "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
    config_token_ids={"image_token_id": "<IMG_CONTEXT>"},
    image_processor_class="GotOcr2ImageProcessor",
    tiny_preset="tiny-internvl",
    liger_patch="apply_liger_kernel_to_internvl",
    lmms_model="internvl_hf",
    notes="InternVL 3 / 3.5 (-hf checkpoints). Images are cut into up to max_patches tiles + a thumbnail.",
))
