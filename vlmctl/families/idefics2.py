"""Idefics2: a SigLIP-style encoder, a perceiver-resampler connector and any LLM (Mistral-7B in the release).

Module paths (transformers 5.23, checked by tests/unit/test_connectors.py):

| part           | path               |
|----------------|--------------------|
| vision tower   | model.vision_model |
| projector      | model.connector    |
| language model | model.text_model   |
| lm head        | lm_head            |

Images only: the connector (`Idefics2Connector`) maps the encoder's [patches, vision_hidden] features to the LLM's
width with a SwiGLU MLP (`modality_projection`), then a perceiver resampler (`perceiver_resampler`) turns them into
`resampler_n_latents` visual tokens per view, whatever the image size (Laurençon et al. 2024, arXiv:2405.02246,
section 2.2; transformers `models/idefics2/modeling_idefics2.py`). The processor writes each view as
`<fake_token_around_image>` + `image_seq_len` x `<image>` + `<fake_token_around_image>`; with `do_image_splitting` an
image is 4 crops + the whole image (5 views). The decoder layer class is discovered.

Compose mode: `model.projector: perceiver` (`model.perceiver_queries`, `perceiver_depth`, `perceiver_heads`) builds
a SigLIP encoder and any LLM that `AutoModel` knows into this class (`Idefics2Spec.check_compose` refuses the rest).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from vlmctl.errors import ConfigError
from vlmctl.families.idefics3 import VISION_KEYS, check_siglip_compose
from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, setting, split_source

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.

BOUNDARY = "<fake_token_around_image>"
"""The marker `Idefics2Processor` writes before and after each view's `<image>` tokens."""

SPLIT_VIEWS = 5
"""Views per image with `do_image_splitting`: 4 crops + the whole image (`Idefics2Processor.__call__`)."""

DEFAULT_QUERIES = 64
"""`Idefics2PerceiverConfig.resampler_n_latents` / `Idefics2Processor(image_seq_len=...)` default."""


def idefics2_tokens(width: int, height: int, source: Any) -> int:
    """Idefics2: `image_seq_len` `<image>` tokens per view (the perceiver's latents, independent of the image's
    `width` x `height` in px), times 5 views with `do_image_splitting`. From a model config: `perceiver_config.
    resampler_n_latents`, no splitting (the image processor's default). From an image processor alone: 64 per view.

    Source: transformers `Idefics2Processor.__call__` (5.23). Counts `<image>` tokens only; the processor also adds
    `<fake_token_around_image>` markers (one around each view).
    """
    seq_len, views = idefics2_views(source)
    return seq_len * views


def idefics2_views(source: Any) -> tuple[int, int]:
    """(`<image>` tokens per view, views per image) of `idefics2_tokens`' `source`: a model config gives
    `perceiver_config.resampler_n_latents` and one view; a processor its `image_seq_len` (64 without one) and 5
    views with the image processor's `do_image_splitting`."""
    proc, improc, cfg = split_source(source)
    if cfg is not None:
        return int(setting(setting(cfg, "perceiver_config", default={}), "resampler_n_latents", default=DEFAULT_QUERIES)), 1
    seq_len = int(setting(proc, "image_seq_len", default=DEFAULT_QUERIES)) if proc is not None else DEFAULT_QUERIES
    return seq_len, SPLIT_VIEWS if bool(setting(improc, "do_image_splitting", default=False)) else 1


COMPOSE_VISION_TYPES = frozenset({"siglip_vision_model", "idefics2_vision", "idefics3_vision"})
"""Vision encoder `model_type`s whose weights load into Idefics2's vision model (SigLIP's layout: Conv2d patch
embedding, learned position table, no CLS token, pre-norm encoder, post-layernorm; Idefics2's / Idefics3's own are
copies of it). CLIP (CLS token, pre-layernorm), DINOv2 or SigLIP2 NaFlex (linear patch embedding) do not fit."""

# VISION_KEYS (from idefics3): the vision config settings copied into `Idefics2VisionConfig` too (same names).


class Idefics2Spec(FamilySpec):
    """Idefics2's build recipe: the compose recipe of `model.projector: perceiver` (any SigLIP encoder + any LLM
    `AutoModel` knows), its `Idefics2Processor` with `image_seq_len` = the perceiver's latents."""

    def check_compose(self, vision_config: Any, text_config: Any, vision_ref: str, llm_ref: str) -> None:
        """Idefics2's vision model takes SigLIP-shaped encoders only, and its `text_model` is
        `AutoModel.from_config(text_config)` (transformers `modeling_idefics2.py`, 5.23). Raises ConfigError naming
        model.vision and the fix for another encoder, ModelError for an LLM without a base-model class."""
        check_siglip_compose(self.model_class, vision_config, text_config, vision_ref, llm_ref, projector="perceiver",
                             vision_types=COMPOSE_VISION_TYPES, vision_error=ConfigError)

    def compose_config(self, vision_config: Any, text_config: Any, *, token_ids: Mapping[str, int], feature_layer: int,
                       feature_strategy: str, projector_config: Mapping[str, Any]):
        """`Idefics2Config` joining a SigLIP vision config (copied into `Idefics2VisionConfig`), any LLM config and an
        `Idefics2PerceiverConfig` at the LLM's width: `projector_config` holds `resampler_n_latents`,
        `resampler_depth`, `resampler_n_heads`; each head is hidden / heads wide, with one key/value head per query
        head (plain multi-head attention). The vision features are the encoder's last layer after its post-layernorm
        (Idefics2 has no feature-layer setting)."""
        import transformers

        vision = transformers.Idefics2VisionConfig(**{k: getattr(vision_config, k) for k in VISION_KEYS if hasattr(vision_config, k)})
        hidden, heads = int(text_config.hidden_size), int(projector_config["resampler_n_heads"])
        perceiver = transformers.Idefics2PerceiverConfig(
            hidden_size=hidden, rms_norm_eps=float(getattr(text_config, "rms_norm_eps", 1e-6)),
            resampler_n_latents=int(projector_config["resampler_n_latents"]),
            resampler_depth=int(projector_config["resampler_depth"]), resampler_n_heads=heads,
            resampler_head_dim=hidden // heads, num_key_value_heads=heads,
        )
        return getattr(transformers, self.config_class)(
            vision_config=vision, perceiver_config=perceiver, text_config=text_config,
            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)), **token_ids,
        )

    def compose_processor(self, tokenizer: Any, image_processor: Any, vision_config: Any, feature_strategy: str,
                          chat_template: str | None, projector_config: Mapping[str, Any] | None = None):
        """`Idefics2Processor`: every image resized to the encoder's square `image_size` (shortest = longest edge,
        as the SigLIP encoder was trained; no splitting), the encoder's normalization, `image_seq_len` = the
        perceiver's latents."""
        import transformers

        tile = int(vision_config.image_size)
        improc = getattr(transformers, self.image_processor_class)(
            do_image_splitting=False, size={"shortest_edge": tile, "longest_edge": tile},
            image_mean=getattr(image_processor, "image_mean", None) or [0.5, 0.5, 0.5],
            image_std=getattr(image_processor, "image_std", None) or [0.5, 0.5, 0.5],
        )
        if getattr(tokenizer, "image_boundary_token", None) is None:
            # Idefics2Processor reads the view marker from the tokenizer once it has an `image_token` (vlmctl's
            # tokenizers do); saved in the tokenizer config like `image_token`.
            tokenizer.add_tokens([BOUNDARY], special_tokens=True)
            tokenizer._set_model_specific_special_tokens({"image_boundary_token": BOUNDARY})
        queries = int((projector_config or {}).get("resampler_n_latents", DEFAULT_QUERIES))
        return self.make_processor(tokenizer, improc, chat_template, image_seq_len=queries)

    def expand_images(self, text: str, sizes: Sequence[tuple[int, int]], processor: Any) -> str | None:
        """`text` as `Idefics2Processor.__call__` rewrites it (transformers `models/idefics2/processing_idefics2.py`,
        5.23): every `<image>` becomes `<fake_token_around_image>` + the view's `<image>` tokens +
        `<fake_token_around_image>` (5 views with `do_image_splitting`), doubled markers of adjacent images merge,
        and a word written right after a closing marker is moved one space away."""
        if not sizes:
            return None
        boundary = setting(processor, "image_boundary_token", default=None) or BOUNDARY
        seq_len, views = idefics2_views(processor)
        image = f"{boundary}{'<image>' * seq_len}{boundary}" * views
        out = text.replace(self.image_prompt, image).replace(boundary * 2, boundary)
        return re.sub(rf"{re.escape(boundary)}(?=[^\s<])", f"{boundary} ", out)

    def processor_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`image_seq_len` = `perceiver_config.resampler_n_latents` (Idefics2Processor docstring)."""
        return {"image_seq_len": int((config.get("perceiver_config") or {}).get("resampler_n_latents", DEFAULT_QUERIES))}

    def default_image_size(self, image_processor: Any) -> int | None:
        """The longest edge images are resized to."""
        return int(image_processor.size["longest_edge"])

    def init_random(self, model) -> None:
        """The vision tower's position table [patches, vision hidden] drawn from N(0, 1 / vision hidden), SigLIP's own
        initialization (`SiglipPreTrainedModel._init_weights`, transformers 5.23): Idefics2's generic one draws it
        with std 0.02, about a tenth of what the patch embedding gives a picture, so the random encoder's output
        barely depends on where a patch is, and the perceiver, which sees no patch order, gets no position to read
        (measured on `vlmctl demo`, docs/benchmarks.md)."""
        import torch

        table = model.get_submodule(self.vision_tower).embeddings.position_embedding.weight
        with torch.no_grad():
            table.normal_(0.0, table.shape[1] ** -0.5)


IDEFICS2 = register(Idefics2Spec(
    name="idefics2",
    collate_prompts=True,
    model_types=("idefics2",),
    model_class="Idefics2ForConditionalGeneration",
    config_class="Idefics2Config",
    processor_class="Idefics2Processor",
    vision_tower="model.vision_model",
    projector=("model.connector",),
    language_model="model.text_model",
    decoder_layer_classes=(),  # the text model is any LLM (Mistral in the release): discovered
    vision_layer_classes=("Idefics2EncoderLayer",),
    modalities={"image": "<image>"},
    visual_token_rule=idefics2_tokens,
    image_grid_args=("pixel_attention_mask",),
    fixed_image_tokens=True,
    special_tokens=("<|im_start|>", "<|im_end|>", "<image>", BOUNDARY, "<end_of_utterance>", "<pad>"),
    extra_special_tokens={"image_boundary_token": BOUNDARY},
    config_token_ids={"image_token_id": "<image>"},
    image_processor_class="Idefics2ImageProcessor",
    tiny_preset="tiny-idefics2",
    compose=True,
    compose_projectors=("perceiver",),
    lmms_model="idefics2",
    notes="Perceiver resampler connector: a fixed number of visual tokens per image. model.projector=perceiver "
    "composes any SigLIP encoder + any LLM into it.",
))
