"""Gemma 3 (`Gemma3ForConditionalGeneration`): a SigLIP encoder, an average-pooling projector and the Gemma 3
decoder (interleaved sliding-window and global attention layers).

Module paths (transformers 5.23, checked by tests/unit/test_families_gemma3.py):

| part           | path                        |
|----------------|-----------------------------|
| vision tower   | model.vision_tower          |
| projector      | model.multi_modal_projector |
| language model | model.language_model        |
| lm head        | lm_head                     |

Images only, one fixed-size view each: every image is resized to the encoder's square and pooled to
`mm_tokens_per_image` `<image_soft_token>` tokens, framed by `<start_of_image>` / `<end_of_image>` (the processor
writes them, and blank lines, in place of the `<start_of_image>` the chat template writes). Pan-and-scan crops are
not used: `Gemma3Processor` applies them only when called with `do_pan_and_scan=True` (its call default overrides
the image processor's setting), which the data pipeline does not do. The processor's `token_type_ids` make the
image tokens attend to each other bidirectionally; they are passed through like any per-token tensor. No packing
(`supports_packing=False`): see the spec below.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, setting, split_source

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.


def gemma3_tokens(width: int, height: int, source: Any) -> int:
    """Every image is resized to a fixed square and pooled to `mm_tokens_per_image` tokens, whatever its size.

    Source: transformers `Gemma3Processor` (`image_seq_length` per image, `full_image_sequence`) and
    `Gemma3Config.mm_tokens_per_image` (5.23). Counts `<image_soft_token>` only; the processor also writes
    `<start_of_image>` / `<end_of_image>` and blank lines around them.
    """
    proc, _, cfg = split_source(source)
    if cfg is not None:
        return int(setting(cfg, "mm_tokens_per_image", default=256))
    return int(setting(proc, "image_seq_length", default=256))


class Gemma3Spec(FamilySpec):
    """Gemma 3's build recipe: `image_seq_length` of the processor from the config."""

    def processor_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`image_seq_length` = `mm_tokens_per_image` (the pooled tokens of one view)."""
        return {"image_seq_length": int(config.get("mm_tokens_per_image", 256))}

    def expand_images(self, text: str, sizes: Sequence[tuple[int, int]], processor: Any) -> str | None:
        """Every `<start_of_image>` of `text` replaced by the processor's `full_image_sequence`: a blank line,
        `<start_of_image>`, the image's `<image_soft_token>` tokens, `<end_of_image>`, a blank line (transformers
        `Gemma3Processor.__init__` / `replace_image_token`, 5.23; no pan-and-scan)."""
        if not sizes:
            return None
        soft = "<image_soft_token>" * gemma3_tokens(*sizes[0], processor)  # the same for every image
        return text.replace(self.image_prompt, f"\n\n<start_of_image>{soft}<end_of_image>\n\n")

    def init_random(self, model) -> None:
        """The projector's `mm_input_projection_weight` [vision hidden, text hidden] drawn from N(0, 0.02**2)
        (the text config's `initializer_range`): transformers initializes it to zeros, which would keep the vision
        tower from receiving any gradient until the projector has moved (forever with the projector frozen)."""
        import torch

        weight = model.get_submodule(self.projector[0]).mm_input_projection_weight
        with torch.no_grad():
            weight.normal_(0.0, float(getattr(model.config.get_text_config(), "initializer_range", 0.02)))


GEMMA3 = register(Gemma3Spec(
    name="gemma3",
    model_types=("gemma3",),
    model_class="Gemma3ForConditionalGeneration",
    config_class="Gemma3Config",
    processor_class="Gemma3Processor",
    vision_tower="model.vision_tower",
    projector=("model.multi_modal_projector",),
    language_model="model.language_model",
    decoder_layer_classes=("Gemma3DecoderLayer",),
    vision_layer_classes=("SiglipEncoderLayer",),
    modalities={"image": "<image_soft_token>"},  # the token repeated once per visual feature
    prompts={"image": "<start_of_image>"},  # what the chat template writes; the processor expands it
    visual_token_rule=gemma3_tokens,
    special_tokens=("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<pad>"),
    extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
    config_token_ids={"image_token_id": "<image_soft_token>", "boi_token_index": "<start_of_image>",
                      "eoi_token_index": "<end_of_image>"},
    image_processor_class="Gemma3ImageProcessor",
    tiny_preset="tiny-gemma3",
    liger_patch="apply_liger_kernel_to_gemma3",
    lmms_model="gemma3",
    fixed_image_tokens=True,
    # transformers 5.23 builds the sliding-window layers' mask of a packed row with the image blocks looked up by
    # in-sample position (`create_masks_for_vision_model`), so image tokens of one sample would open bidirectional
    # attention in another: trained on padded batches
    supports_packing=False,
    notes="One fixed-size view per image pooled to mm_tokens_per_image tokens (no pan-and-scan); padded batches.",
))
