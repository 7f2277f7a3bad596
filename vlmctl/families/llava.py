"""LLaVA: the compose family. Any vision encoder + a projector + any causal LM in `LlavaForConditionalGeneration`
(LLaVA-1.5, Liu et al. 2023, https://arxiv.org/abs/2310.03744); `model.vision` + `model.llm` builds into it.

Module paths (transformers 5.23, checked by tests/unit/test_families_llava.py):

| part           | path                        |
|----------------|-----------------------------|
| vision tower   | model.vision_tower          |
| projector      | model.multi_modal_projector |
| language model | model.language_model        |
| lm head        | lm_head                     |

Layer classes are discovered from the loaded model (the encoder and the LLM can be anything). Images only: each
image is resized to the encoder's fixed square and every patch becomes one `<image>` token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlmctl.families.encoders import image_encoder, vision_cost
from vlmctl.families.registry import register
from vlmctl.families.spec import CLS_VISION_TYPES, DECODER_TP_PLAN, FamilySpec, has_cls_token, setting, split_source

# transformers is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for
# it.


def llava_tokens(width: int, height: int, source: Any) -> int:
    """LLaVA: the image is resized to a fixed square, every patch is one token, `default` drops the CLS token.

    Source: transformers `LlavaProcessor.replace_image_token` (5.23):
    `(h // patch) * (w // patch) + num_additional_image_tokens - (strategy == "default")`.
    The input size does not matter (fixed resize).
    """
    proc, improc, cfg = split_source(source)
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        size = int(setting(vcfg, "image_size"))
        patch = int(setting(vcfg, "patch_size"))
        strategy = setting(cfg, "vision_feature_select_strategy", default="default")
        cls = 1 if setting(vcfg, "model_type", default="") in CLS_VISION_TYPES else 0
        return (size // patch) ** 2 + cls - (1 if strategy == "default" else 0)
    crop = setting(improc, "crop_size") if setting(improc, "do_center_crop", default=False) else None
    size = crop or setting(improc, "size")
    h = size.get("height") or size.get("shortest_edge")
    w = size.get("width") or size.get("shortest_edge")
    patch = int(setting(proc, "patch_size"))
    extra = int(setting(proc, "num_additional_image_tokens", default=0))
    strategy = setting(proc, "vision_feature_select_strategy", default="default")
    return (h // patch) * (w // patch) + extra - (1 if strategy == "default" else 0)


class LlavaSpec(FamilySpec):
    """LLaVA's build recipe: the config and processor of a composed model."""

    def compose_config(self, vision_config: Any, text_config: Any, *, token_ids: Mapping[str, int], feature_layer: int,
                       feature_strategy: str, projector_config: Mapping[str, Any]):
        """`LlavaConfig` joining the two configs. `image_seq_length` = patches (+ CLS) (- 1 for `default`), the
        count `LlavaProcessor` expands `<image>` to."""
        import transformers

        n_patches = (vision_config.image_size // vision_config.patch_size) ** 2
        seq = n_patches + (1 if has_cls_token(vision_config) else 0) - (1 if feature_strategy == "default" else 0)
        return getattr(transformers, self.config_class)(
            vision_config=vision_config, text_config=text_config, image_seq_length=seq, **token_ids,
            vision_feature_layer=feature_layer, vision_feature_select_strategy=feature_strategy,
            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)), **projector_config,
        )

    def compose_processor(self, tokenizer: Any, image_processor: Any, vision_config: Any, feature_strategy: str,
                          chat_template: str | None, projector_config: Mapping[str, Any] | None = None):
        """`LlavaProcessor` over the encoder's image processor and the LLM's tokenizer."""
        import transformers

        return getattr(transformers, self.processor_class)(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=vision_config.patch_size,
            vision_feature_select_strategy=feature_strategy, chat_template=chat_template,
            num_additional_image_tokens=1 if has_cls_token(vision_config) else 0,
        )


LLAVA = register(LlavaSpec(
    name="llava",
    collate_prompts=True,
    model_types=("llava",),
    model_class="LlavaForConditionalGeneration",
    config_class="LlavaConfig",
    processor_class="LlavaProcessor",
    encoders={"image": image_encoder("model.vision_tower", cost=vision_cost(feature_layer=True))},
    projector=("model.multi_modal_projector",),
    language_model="model.language_model",
    modalities={"image": "<image>"},
    visual_token_rule=llava_tokens,
    special_tokens=("<|im_start|>", "<|im_end|>", "<image>", "<pad>"),
    config_token_ids={"image_token_id": "<image>"},
    tiny_preset="tiny",
    compose=True,
    compose_projectors=("mlp2x_gelu", "linear"),
    fixed_image_tokens=True,  # one fixed-size view per image
    # Vision encoders LlavaModel cannot drive: they need inputs it does not pass.
    unsupported_vision={
        "siglip2_vision_model": "SigLIP2 NaFlex encoders need pixel_attention_mask/spatial_shapes, which LLaVA does not "
        "pass; use a fixed-resolution SigLIP2 checkpoint (model_type siglip) or a SigLIP/CLIP encoder",
    },
    liger_patch="apply_liger_kernel_to_llava",
    lmms_model="llava_hf",
    megatron_layout="megatron_llava",
    tensor_parallel_plan=DECODER_TP_PLAN,  # any Llama / Qwen-style causal LM
    notes="Any vision encoder + any causal LM; layer classes are discovered from the loaded model.",
))
