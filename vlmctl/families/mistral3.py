"""Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2, Ministral 3): the Pixtral vision encoder,
the Mistral 3 projector (RMSNorm, a patch merger, a 2-layer MLP) and a Mistral-family LLM.

Module paths (transformers 5.23, checked by tests/unit/test_families_mistral3.py):

| part           | path                        |
|----------------|-----------------------------|
| vision tower   | model.vision_tower          |
| projector      | model.multi_modal_projector |
| language model | model.language_model        |
| lm head        | lm_head                     |

Images only, each at its own resolution: the image is scaled down (never up) to fit `size.longest_edge`, its sides
rounded up to multiples of `patch_size * spatial_merge_size` px, and cut into `patch_size` px patches; the encoder
runs every image of a batch in one sequence with a block-diagonal attention mask (one block per image), 2-D
rotary positions per image, and `image_sizes` [n_images, 2] (height, width in px) telling each image's real size
in the zero-padded `pixel_values` [n_images, 3, H_max, W_max]. The patch merger joins `spatial_merge_size`**2
neighbouring patches into one visual token. The processor writes one `[IMG]` per merged token, row by row, with an
`[IMG_BREAK]` after each row but the last, which ends with `[IMG_END]` instead.

Packing: supported. The language model takes packed rows (per-sample position ids, or `packed_cu_seqlens` for
varlen attention on CUDA); the vision tower already takes images of different sizes in one call and keeps them
apart with its own mask, so the images of the samples of a packed row run as one batch. The collator zero-pads
images of different sizes to the largest before concatenating them (`image_sizes` keeps the real sizes). Not
supported: varlen attention inside the vision tower (on CUDA it keeps sdpa, whose block-diagonal mask is dense over
all patches of the micro-batch), and `DataLoader` workers started with `spawn` (see `pixtral_processor_class`).

The decoder layer class is discovered (Mistral for Mistral Small 3.x, Ministral 3 for Ministral 3).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from vlmctl.families.encoders import image_encoder, vision_cost
from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, replace_in_order, setting, split_source

# numpy and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.

IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
"""`PixtralProcessor`'s defaults: one `[IMG]` per visual token, `[IMG_BREAK]` ends a row, `[IMG_END]` the image."""

DEFAULT_MERGE = 2
"""`Mistral3Config.spatial_merge_size` default (every released Mistral 3 checkpoint)."""

_PROCESSING = "transformers.models.pixtral.processing_pixtral"
_TORCHVISION_PROCESSING = "transformers.models.pixtral.image_processing_pixtral"
_PIL_PROCESSING = "transformers.models.pixtral.image_processing_pil_pixtral"


@lru_cache(maxsize=1)
def pixtral_processor_class() -> type:
    """transformers' `PixtralProcessor` class, also where torchvision is not installed.

    On transformers 5.23 the class is declared with `requires(backends=("torchvision", "torch"))`, so
    `transformers.PixtralProcessor` is a placeholder that raises ImportError without torchvision, and its module
    imports `get_resize_output_image_size` (used only by `_get_num_multimodal_tokens`) from the torchvision image
    processor module. Nothing else in the class needs torchvision: without it, the module
    (`models/pixtral/processing_pixtral.py`) is imported as it is, with that one name taken from the PIL image
    processor module (`image_processing_pil_pixtral.py`, the same function), and the class is returned. Processors
    made or loaded from it save and load as `PixtralProcessor` (with torchvision, `AutoProcessor` loads them).
    With torchvision installed this is `transformers.PixtralProcessor`.

    The class lives in a module only this function imports, so a process that unpickles a processor (a `spawn`ed
    `DataLoader` worker) must call it first; the default `fork` workers inherit it.
    """
    import transformers

    if importlib.util.find_spec("torchvision") is not None:
        return transformers.PixtralProcessor
    module = sys.modules.get(_PROCESSING)
    if module is None:
        saved = sys.modules.get(_TORCHVISION_PROCESSING)  # None: never imported (it cannot be without torchvision)
        sys.modules[_TORCHVISION_PROCESSING] = importlib.import_module(_PIL_PROCESSING)
        try:
            module = importlib.import_module(_PROCESSING)
        finally:
            if saved is None:
                del sys.modules[_TORCHVISION_PROCESSING]
            else:
                sys.modules[_TORCHVISION_PROCESSING] = saved
    return module.PixtralProcessor


def _side(value: Any) -> int:
    # patch sizes are ints in Mistral 3 configs, {"height": p, "width": p} in image processors
    if isinstance(value, Mapping):
        return int(value["height"])
    return int(value)


def _longest_edge(size: Any) -> int:
    # a plain dict, or transformers' SizeDict (attributes)
    return int(size["longest_edge"] if isinstance(size, Mapping) else size.longest_edge)


def pixtral_grid(width: int, height: int, *, longest_edge: int, token_px: int) -> tuple[int, int]:
    """(rows, cols) of visual tokens of one `width` x `height` px image: the image is scaled down to fit
    `longest_edge` (floor, never up), then each side is rounded up to a multiple of `token_px` =
    patch_size * spatial_merge_size (px per visual token a side).

    Source: transformers `get_resize_output_image_size` (`models/pixtral/image_processing_pil_pixtral.py`, 5.23),
    which `PixtralProcessor._process_images` calls with `patch_size * spatial_merge_size`; its
    `replace_image_token` then writes height // token_px rows of width // token_px tokens.
    """
    import numpy as np
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    shape_only = np.broadcast_to(np.uint8(0), (int(height), int(width), 3))  # the function reads the shape only
    h, w = get_resize_output_image_size(shape_only, size=(longest_edge, longest_edge), patch_size=(token_px, token_px),
                                        input_data_format="channels_last")
    return h // token_px, w // token_px


def mistral3_grid(width: int, height: int, source: Any) -> tuple[int, int]:
    """(rows, cols) of visual tokens of one `width` x `height` px image under `source` (`pixtral_grid` with
    token_px = patch_size * spatial_merge_size). From a config, the published processor is assumed
    (`size.longest_edge` = `vision_config.image_size`); from an image processor alone, `spatial_merge_size` = 2."""
    proc, improc, cfg = split_source(source)
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        longest = int(setting(vcfg, "image_size", default=1540))
        token_px = _side(setting(vcfg, "patch_size", default=14)) * int(setting(cfg, "spatial_merge_size", default=DEFAULT_MERGE))
    else:
        longest = _longest_edge(setting(improc, "size"))
        if proc is not None:
            token_px = int(setting(proc, "patch_size")) * int(setting(proc, "spatial_merge_size", default=1))
        else:
            token_px = _side(setting(improc, "patch_size")) * DEFAULT_MERGE
    return pixtral_grid(width, height, longest_edge=longest, token_px=token_px)


def mistral3_tokens(width: int, height: int, source: Any) -> int:
    """Mistral 3: rows x cols `[IMG]` tokens (`mistral3_grid`) for one `width` x `height` px image.

    Source: transformers `PixtralProcessor.replace_image_token` (`models/pixtral/processing_pixtral.py`, 5.23).
    Counts `[IMG]` only (the positions the projector's features fill); the processor also writes rows - 1
    `[IMG_BREAK]` and one `[IMG_END]` per image (`pixtral_image_text`), rows x (cols + 1) tokens in all.
    """
    rows, cols = mistral3_grid(width, height, source)
    return rows * cols


def pixtral_image_text(rows: int, cols: int) -> str:
    """The text `PixtralProcessor.replace_image_token` writes for one image of `rows` x `cols` visual tokens: each
    row `cols` x `[IMG]` then `[IMG_BREAK]`, the last row's `[IMG_BREAK]` replaced by `[IMG_END]`."""
    return ((IMAGE_TOKEN * cols + BREAK_TOKEN) * rows)[: -len(BREAK_TOKEN)] + END_TOKEN


class Mistral3Spec(FamilySpec):
    """Mistral 3's build recipe: the processor's `patch_size` / `spatial_merge_size` and the image processor's
    patch size and longest edge from the config; `PixtralProcessor` made and loaded without torchvision
    (`pixtral_processor_class`)."""

    def processor_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`patch_size` (the encoder's) and `spatial_merge_size` (the merger's) of `PixtralProcessor`."""
        return {"patch_size": _side(config["vision_config"]["patch_size"]),
                "spatial_merge_size": int(config.get("spatial_merge_size", DEFAULT_MERGE))}

    def preset_processor(self, tokenizer: Any, chat_template: str | None, kwargs: Mapping[str, Any], config: Mapping[str, Any]):
        """The image processor gets the encoder's `patch_size` and `size.longest_edge` = `vision_config.image_size`
        (as in the published processors) unless the preset's `processor:` settings say otherwise."""
        vision = config["vision_config"]
        patch = _side(vision["patch_size"])
        kwargs = {"patch_size": {"height": patch, "width": patch}, "size": {"longest_edge": int(vision["image_size"])}, **kwargs}
        return super().preset_processor(tokenizer, chat_template, kwargs, config)

    def make_processor(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None, **kwargs: Any):
        """`PixtralProcessor` from its parts (`pixtral_processor_class`: torchvision not needed)."""
        return pixtral_processor_class()(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs)

    def image_only_processor(self, ref: str, *, trust_remote_code: bool = False):
        """`PixtralProcessor` loaded from the saved processor at `ref` where `AutoProcessor` cannot build it (no
        torchvision); its image processor loads as `PixtralImageProcessorPil`."""
        return pixtral_processor_class().from_pretrained(ref, trust_remote_code=trust_remote_code)

    def expand_images(self, text: str, sizes: Sequence[tuple[int, int]], processor: Any) -> str | None:
        """Each `[IMG]` of `text` replaced by its rows of `[IMG]` with `[IMG_BREAK]` / `[IMG_END]`
        (`pixtral_image_text`), as `PixtralProcessor.__call__` does before tokenizing."""
        return replace_in_order(text, self.image_prompt, [pixtral_image_text(*mistral3_grid(w, h, processor)) for w, h in sizes])

    def image_size_kwargs(self, kwargs: Mapping[str, Any], size: int) -> dict[str, Any]:
        """`model.image_size` is the longest edge images are scaled down to."""
        return {**kwargs, "size": {"longest_edge": size}}

    def default_image_size(self, image_processor: Any) -> int | None:
        """The longest edge: a square image of that side is the largest one the processor keeps as it is."""
        return _longest_edge(image_processor.size)


MISTRAL3 = register(Mistral3Spec(
    name="mistral3",
    collate_prompts=True,
    model_types=("mistral3",),
    model_class="Mistral3ForConditionalGeneration",
    config_class="Mistral3Config",
    processor_class="PixtralProcessor",
    # Pixtral: one segment per image, `cu_seq_lens_q/k` for flash-named implementations (varlen)
    encoders={"image": image_encoder("model.vision_tower", layer_classes=("PixtralAttentionLayer",), varlen=True,
                                     cost=vision_cost(feature_layer=True))},
    projector=("model.multi_modal_projector",),
    language_model="model.language_model",
    decoder_layer_classes=(),  # Mistral (Mistral Small 3.x) or Ministral 3: discovered
    modalities={"image": IMAGE_TOKEN},
    visual_token_rule=mistral3_tokens,
    image_grid_args=("image_sizes",),
    special_tokens=("<|im_start|>", "<|im_end|>", IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN, "<pad>"),
    config_token_ids={"image_token_index": IMAGE_TOKEN},
    image_processor_class="PixtralImageProcessor",
    tiny_preset="tiny-mistral3",
    lmms_model="huggingface",  # lmms-eval's AutoModelForImageTextToText adapter
    notes="Mistral Small 3.x / Ministral 3 (Pixtral encoder, patch merger). Each image at its own size: rows of [IMG] "
    "with [IMG_BREAK] / [IMG_END]; packed rows run their images as one encoder sequence (varlen on GPUs).",
))
