"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: one spec class (`QwenVLSpec`) and one factory (`qwen_vl`), three entries.

Module paths (transformers 5.23, checked by tests/unit/test_families_qwen_vl.py):

| family     | vision tower | projector                                               | language model       |
|------------|--------------|---------------------------------------------------------|----------------------|
| qwen2_vl   | model.visual | model.visual.merger                                     | model.language_model |
| qwen2_5_vl | model.visual | model.visual.merger                                     | model.language_model |
| qwen3_vl   | model.visual | model.visual.merger, model.visual.deepstack_merger_list | model.language_model |

The projector (the patch merger) sits *inside* the vision tower module (see `spec.part_of_parameter`). Images
and videos: dynamic resolution (`smart_resize` to multiples of patch * merge, one token per merge x merge block),
`image_grid_thw` passed to `forward`, and 3-D mRoPE position ids (temporal, height, width) that a packed row gets
from `position_hook` (`mrope_prepare`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Callable

from vlmctl.errors import ModelError
from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, VisualTokenRule, setting, split_source

QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Special tokens of the Qwen-VL tokenizers that the processors and chat templates use."""


# --------------------------------------------------------------------------------------------------------------------
# Visual tokens
# --------------------------------------------------------------------------------------------------------------------


def qwen_tokens(width: int, height: int, *, patch: int, merge: int, min_pixels: int, max_pixels: int) -> int:
    """Qwen2-VL / 2.5-VL / 3-VL: resize to multiples of patch*merge inside [min_pixels, max_pixels], then one token
    per merge x merge block of patches.

    Source: transformers `qwen2_vl.image_processing_qwen2_vl.smart_resize` and `Qwen2VLProcessor`:
    tokens = (H' / patch) * (W' / patch) / merge**2 with (H', W') = smart_resize(H, W, patch * merge, ...).
    """
    # The PIL module imports without torchvision (the default one does not).
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // patch) * (w // patch) // (merge * merge)


def qwen_visual_tokens(width: int, height: int, source: Any, *, default_patch: int, default_min: int, default_max: int) -> int:
    """`qwen_tokens` with the settings read from `source` (a processor, an image processor, a model config or a
    dict). From a config, the published processor's `default_min` / `default_max` pixels are assumed."""
    _, improc, cfg = split_source(source)
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        patch = int(setting(vcfg, "patch_size", default=default_patch))
        merge = int(setting(vcfg, "spatial_merge_size", default=2))
        return qwen_tokens(width, height, patch=patch, merge=merge, min_pixels=default_min, max_pixels=default_max)
    size = setting(improc, "size", default={}) or {}
    return qwen_tokens(
        width, height,
        patch=int(setting(improc, "patch_size", default=default_patch)),
        merge=int(setting(improc, "merge_size", default=2)),
        min_pixels=int(setting(improc, "min_pixels", default=None) or size.get("shortest_edge", default_min)),
        max_pixels=int(setting(improc, "max_pixels", default=None) or size.get("longest_edge", default_max)),
    )


def qwen_rule(default_patch: int, default_min: int, default_max: int) -> VisualTokenRule:
    """The visual-token rule of a Qwen-VL version whose published processor uses `default_patch` px patches and
    [`default_min`, `default_max`] pixels (a partial of `qwen_visual_tokens`, so specs pickle)."""
    return partial(qwen_visual_tokens, default_patch=default_patch, default_min=default_min, default_max=default_max)


# --------------------------------------------------------------------------------------------------------------------
# Position ids (3-D mRoPE)
# --------------------------------------------------------------------------------------------------------------------


def rope_index_fn(model):
    """The Qwen-VL model's own `get_rope_index` (mRoPE positions; a pure function of the config), found on the
    unwrapped model (LoRA wrappers included). Raises ModelError when there is none."""
    for module in model.modules():
        fn = getattr(module, "get_rope_index", None)
        if callable(fn):
            return fn
    raise ModelError("this Qwen-VL model has no get_rope_index method", hint="use a transformers version that supports the family")


def mrope_prepare(model, image_token_id: int | None) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A batch hook (run by `loop.prefetch` ahead of the step) replacing the packed row's (1, T) position ids by the
    (4, 1, T) text + mRoPE position ids computed per sample (`vlmctl.data.packing.mrope_position_ids`), on CPU
    before the device copy. Padded batches pass through unchanged (the model computes their positions)."""
    from vlmctl.data.collate import is_packed
    from vlmctl.data.packing import mrope_position_ids

    rope_index = rope_index_fn(model)

    def prepare(batch: dict[str, Any]) -> dict[str, Any]:
        if not is_packed(batch):
            return batch
        types = batch.get("mm_token_type_ids")
        if types is None:  # processors without token types: image placeholders are the image tokens
            types = (batch["input_ids"] == image_token_id).long()
        positions = mrope_position_ids(rope_index, batch["input_ids"], types, batch.get("image_grid_thw"), batch["seq_lens"])
        return {**batch, "position_ids": positions}

    return prepare


# --------------------------------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------------------------------


class QwenVLSpec(FamilySpec):
    """A Qwen-VL version: dynamic-resolution image processor, a video processor, mRoPE positions."""

    def position_hook(self, model, image_token_id: int | None):
        """`mrope_prepare(model, image_token_id)`: packed rows need per-sample 3-D positions."""
        return mrope_prepare(model, image_token_id)  # the module global, so tests can wrap it

    def image_size_kwargs(self, kwargs: Mapping[str, Any], size: int) -> dict[str, Any]:
        """`model.image_size` caps the pixels per image at size**2 (`max_pixels`; `min_pixels` no larger)."""
        return {**kwargs, "max_pixels": size * size, "min_pixels": min(kwargs.get("min_pixels", 3136), size * size)}

    def default_image_size(self, image_processor: Any) -> int | None:
        """448 px: a square image at the size Qwen-VL examples use (dynamic resolution has no native size)."""
        return 448

    def video_processor(self, image_processor: Any):
        """The version's video processor with the image processor's patch / merge / temporal patch sizes.

        Raises ImportError without torchvision."""
        import transformers

        cls = getattr(transformers, self.video_processor_class)  # raises ImportError without torchvision
        return cls(patch_size=image_processor.patch_size, merge_size=image_processor.merge_size,
                   temporal_patch_size=image_processor.temporal_patch_size)


def qwen_vl(name: str, prefix: str, *, patch: int, min_pixels: int, max_pixels: int, decoder_layer: str,
            video_processor: str, projector: tuple[str, ...] = ("model.visual.merger",), tiny_preset: str,
            notes: str = "") -> QwenVLSpec:
    """The spec of one Qwen-VL version. `prefix` is its transformers class prefix ("Qwen2_5_VL"); `patch`,
    `min_pixels`, `max_pixels` are its published processor's settings (for counts from a config)."""
    return QwenVLSpec(
        name=name,
        model_types=(name,),
        model_class=f"{prefix}ForConditionalGeneration",
        config_class=f"{prefix}Config",
        processor_class=f"{prefix}Processor",
        vision_tower="model.visual",
        projector=projector,
        language_model="model.language_model",
        decoder_layer_classes=(decoder_layer,),
        vision_layer_classes=(f"{prefix}VisionBlock",),
        modalities={"image": "<|image_pad|>", "video": "<|video_pad|>"},
        prompts={"image": "<|vision_start|><|image_pad|><|vision_end|>", "video": "<|vision_start|><|video_pad|><|vision_end|>"},
        visual_token_rule=qwen_rule(patch, min_pixels, max_pixels),
        image_grid_args=("image_grid_thw",),
        mrope=True,
        special_tokens=QWEN_TOKENS,
        extra_special_tokens={"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>", "video_token": "<|video_pad|>"},
        config_token_ids={"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                          "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"},
        image_processor_class="Qwen2VLImageProcessor",
        video_processor_class=video_processor,
        tiny_preset=tiny_preset,
        liger_patch=f"apply_liger_kernel_to_{name}",
        lmms_model=name,
        notes=notes,
    )


QWEN2_VL = register(qwen_vl(
    "qwen2_vl", "Qwen2VL", patch=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
    decoder_layer="Qwen2VLDecoderLayer", video_processor="Qwen2VLVideoProcessor", tiny_preset="tiny-qwen2-vl",
))
QWEN2_5_VL = register(qwen_vl(
    "qwen2_5_vl", "Qwen2_5_VL", patch=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
    decoder_layer="Qwen2_5_VLDecoderLayer", video_processor="Qwen2VLVideoProcessor", tiny_preset="tiny-qwen2.5-vl",
    notes="Window attention in the vision tower except fullatt_block_indexes.",
))
# Qwen3-VL's published processor: patch 16, shortest_edge 65536, longest_edge 16777216 pixels.
QWEN3_VL = register(qwen_vl(
    "qwen3_vl", "Qwen3VL", patch=16, min_pixels=65536, max_pixels=16777216,
    decoder_layer="Qwen3VLTextDecoderLayer", video_processor="Qwen3VLVideoProcessor", tiny_preset="tiny-qwen3-vl",
    projector=("model.visual.merger", "model.visual.deepstack_merger_list"),
    notes="DeepStack: features of some vision layers are added to early decoder layers (deepstack_merger_list).",
))
