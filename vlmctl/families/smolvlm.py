"""SmolVLM2 (`SmolVLMForConditionalGeneration`, model_type `smolvlm`; also SmolDocling): Idefics3's architecture
under its own transformers classes: a SigLIP-style encoder, a pixel-shuffle connector and a Llama-family LLM
(SmolLM2). SmolVLM v1 checkpoints are model_type `idefics3` (`vlmctl.families.idefics3`).

Module paths (transformers 5.23, checked by tests/unit/test_families_smolvlm.py):

| part           | path               |
|----------------|--------------------|
| vision tower   | model.vision_model |
| projector      | model.connector    |
| language model | model.text_model   |
| lm head        | lm_head            |

Images only. `SmolVLMProcessor` tiles an image as `Idefics3Processor` does (its image processor,
`image_processing_pil_smolvlm.py`, is Idefics3's under another name) and writes the same markers, so the visual-token
rule, the marker text and the build recipe are Idefics3's (`Idefics3Spec`, reused here). Videos are not taken:
SmolVLM's video processor (`SmolVLMVideoProcessor`) needs torchvision, so without it an image-only
`SmolVLMProcessor` is built and loaded (`image_only_processor_class`), and vlmctl has no video-token rule for it.
The processor needs the `num2words` package at construction, for its video prompts. The decoder layer class is
discovered.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from typing import Any

from vlmctl.families.idefics3 import ROW_COL_TOKENS, Idefics3Spec, idefics3_tokens
from vlmctl.families.encoders import image_encoder, vision_cost
from vlmctl.families.registry import register
from vlmctl.families.spec import _image_only

# transformers is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for
# it.


class NoVideoSettings:
    """What `SmolVLMProcessor.apply_chat_template` reads of its video processor on every call (`num_frames`, `fps`,
    transformers `models/smolvlm/processing_smolvlm.py`, 5.23), unset: the image-only processor has no video
    processor, and no video goes through it."""

    num_frames = None
    fps = None


@lru_cache(maxsize=1)
def image_only_processor_class() -> type:
    """`SmolVLMProcessor` without its video processor (`FamilySpec.make_processor`'s image-only variant), whose
    `video_processor` reads as `NoVideoSettings` so its chat template renders. Saved and loaded as
    `SmolVLMProcessor`; the video settings are not saved."""
    import transformers

    base = _image_only(transformers.SmolVLMProcessor)
    return type(base.__name__, (base,), {"video_processor": NoVideoSettings(), "__qualname__": base.__qualname__})


class SmolVLMSpec(Idefics3Spec):
    """Idefics3's recipe (tile settings, `image_seq_len`, the marker text of `expand_images`) for the SmolVLM
    classes; not a compose family (`model.projector: pixel_shuffle` builds Idefics3's class). Without torchvision
    the processor is `image_only_processor_class`."""

    def make_processor(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None, **kwargs: Any):
        """`SmolVLMProcessor` with its video processor, or without torchvision the image-only one."""
        if importlib.util.find_spec("torchvision") is not None:
            return super().make_processor(tokenizer, image_processor, chat_template, **kwargs)
        return image_only_processor_class()(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                            chat_template=chat_template, **kwargs)

    def image_only_processor(self, ref: str, *, trust_remote_code: bool = False):
        """The image-only `SmolVLMProcessor` loaded from the saved processor at `ref` (its `video_processor` argument
        has no default, so None is passed)."""
        return image_only_processor_class().from_pretrained(ref, trust_remote_code=trust_remote_code, video_processor=None)


SMOLVLM = register(SmolVLMSpec(
    name="smolvlm",
    model_types=("smolvlm",),
    model_class="SmolVLMForConditionalGeneration",
    config_class="SmolVLMConfig",
    processor_class="SmolVLMProcessor",
    encoders={"image": image_encoder("model.vision_model", layer_classes=("SmolVLMEncoderLayer",), video=True, cost=vision_cost(pixel_shuffle="scale_factor"))},
    projector=("model.connector",),
    language_model="model.text_model",
    decoder_layer_classes=(),  # the text model is any LLM (SmolLM2 / Llama in the releases): discovered
    modalities={"image": "<image>"},
    visual_token_rule=idefics3_tokens,  # transformers `SmolVLMProcessor.replace_image_token` = Idefics3's layout
    image_grid_args=("pixel_attention_mask",),
    special_tokens=("<|im_start|>", "<|im_end|>", "<image>", "<fake_token_around_image>", "<global-img>",
                    "<end_of_utterance>", "<pad>", *ROW_COL_TOKENS),
    config_token_ids={"image_token_id": "<image>"},
    image_processor_class="SmolVLMImageProcessor",
    video_processor_class="SmolVLMVideoProcessor",
    tiny_preset="tiny-smolvlm",
    liger_patch="apply_liger_kernel_to_smolvlm",
    lmms_model="huggingface",  # lmms-eval's AutoModelForImageTextToText adapter
    notes="SmolVLM2 (SmolVLM v1 is idefics3). Idefics3's tiles + global view and pixel shuffle; images only (its video "
    "processor needs torchvision).",
))
