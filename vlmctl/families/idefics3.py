"""Idefics3 / SmolVLM (v1): a SigLIP-style encoder, a pixel-shuffle connector and any LLM (Llama for SmolVLM).

Module paths (transformers 5.23, checked by tests/unit/test_families_idefics3.py):

| part           | path               |
|----------------|--------------------|
| vision tower   | model.vision_model |
| projector      | model.connector    |
| language model | model.text_model   |
| lm head        | lm_head            |

Images only: each image is split into tiles of the encoder's size plus one global view; every tile becomes
`image_seq_len` `<image>` tokens (patches / scale_factor**2 after pixel shuffle), framed by text markers
(`<fake_token_around_image>`, `<row_i_col_j>`, `<global-img>`). The decoder layer class is discovered.

Compose mode: `model.projector: pixel_shuffle` (`model.pixel_shuffle_scale`) builds a SigLIP encoder and any LLM
that `AutoModel` knows into this class (`Idefics3Spec.check_compose` refuses the rest).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from vlmctl.errors import ModelError
from vlmctl.families.encoders import image_encoder, vision_cost
from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, replace_in_order, setting, split_source

# transformers is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for
# it.

ROW_COL_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
"""The tile-position markers the processor writes (up to a 6 x 6 split)."""


def idefics3_resize(height: int, width: int, longest: int, max_size: int = 4096) -> tuple[int, int]:
    """Idefics3's resize before splitting: longest edge -> `longest` (the other edge rounded up to even), then
    capped at 4096 px. Returns (height, width) in px. Source: `_resize_output_size_rescale_to_max_len` and
    `..._scale_below_upper_bound` in transformers `models/idefics3/image_processing_idefics3.py` (5.23)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > max_size:
        width, height = max_size, int(max_size / aspect)
    elif height > width and height > max_size:
        height, width = max_size, int(max_size * aspect)
    return max(height, 1), max(width, 1)


def idefics3_grid(width: int, height: int, source: Any) -> tuple[int, int, int]:
    """(rows, cols, image_seq_len) of one `width` x `height` image (px): the tiles of `max_image_size.longest_edge`
    after the resize to `size.longest_edge` (0, 0 when the image stays one view: no splitting, or it fits one tile),
    and the `<image>` tokens per view (= (tile / patch)**2 / scale_factor**2 after pixel shuffle).

    Source: transformers `Idefics3ImageProcessor.split_image` / `get_number_of_image_patches` (5.23).
    """
    proc, improc, cfg = split_source(source)
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        tile = int(setting(vcfg, "image_size"))
        seq_len = (tile // int(setting(vcfg, "patch_size"))) ** 2 // int(setting(cfg, "scale_factor", default=2)) ** 2
        longest, splitting = 4 * tile, True
    else:
        tile = int(setting(improc, "max_image_size")["longest_edge"])
        longest = int(setting(improc, "size")["longest_edge"])
        splitting = bool(setting(improc, "do_image_splitting", default=True))
        seq_len = int(setting(proc, "image_seq_len"))
    if not splitting:
        return 0, 0, seq_len
    h, w = idefics3_resize(height, width, longest)
    rows, cols = math.ceil(h / tile), math.ceil(w / tile)
    return (0, 0, seq_len) if rows == 1 and cols == 1 else (rows, cols, seq_len)


def idefics3_tokens(width: int, height: int, source: Any) -> int:
    """Idefics3 / SmolVLM: the image is resized so its longest edge is `size.longest_edge`, split into tiles of
    `max_image_size.longest_edge` plus one global image (`idefics3_grid`); each view becomes `image_seq_len` tokens.

    Source: transformers `Idefics3ImageProcessor.get_number_of_image_patches` and `Idefics3Processor` (5.23).
    Counts `<image>` tokens only; the processor also adds `<fake_token_around_image>` / `<row_i_col_j>` /
    `<global-img>` markers (`idefics3_image_text`).
    """
    rows, cols, seq_len = idefics3_grid(width, height, source)
    return seq_len * (rows * cols + 1)


def idefics3_image_text(rows: int, cols: int, seq_len: int) -> str:
    """The text `Idefics3Processor.replace_image_token` writes for one image of `rows` x `cols` tiles (0, 0: one
    view) and `seq_len` `<image>` tokens per view (transformers `models/idefics3/processing_idefics3.py`, 5.23)."""
    image = "<image>" * seq_len
    glob = f"<fake_token_around_image><global-img>{image}<fake_token_around_image>"
    if rows == 0 and cols == 0:
        return glob
    grid = "".join("".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{grid}\n{glob}"


COMPOSE_VISION_TYPES = frozenset({"siglip_vision_model", "idefics3_vision"})
"""Vision encoder `model_type`s whose weights load into Idefics3's vision model (SigLIP's layout: Conv2d patch
embedding, learned position table, pre-norm encoder, post-layernorm; Idefics3's own is a copy of it)."""

VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
               "image_size", "patch_size", "hidden_act", "layer_norm_eps", "attention_dropout")
"""The `Idefics3VisionConfig` settings read from a SigLIP vision config (same names, same meaning)."""


def check_siglip_compose(model_class: str, vision_config: Any, text_config: Any, vision_ref: str, llm_ref: str, *,
                         projector: str, vision_types: frozenset, vision_error: type) -> None:
    """The compose checks of the Idefics classes (Idefics2, Idefics3): the vision encoder's `model_type` must be one
    of `vision_types` (SigLIP's layout), else `vision_error`; the LLM needs a base-model class in transformers, which
    these classes build their `text_model` with (`AutoModel.from_config`), else ModelError. Both name the part
    and the fix."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    vtype = setting(vision_config, "model_type", default="?")
    if vtype not in vision_types:
        raise vision_error(
            f"model.vision={vision_ref!r} is a {vtype!r} encoder; model.projector={projector} builds {model_class}, "
            "whose vision model has SigLIP's layout (no CLS token, no pre-layernorm) and loads SigLIP weights only",
            hint="set model.vision to a SigLIP encoder (model_type siglip / siglip_vision_model, e.g. "
            "google/siglip-so400m-patch14-384), or use model.projector=mlp2x_gelu for this encoder",
        )
    ttype = setting(text_config, "model_type", default="?")
    if ttype not in MODEL_MAPPING_NAMES:
        raise ModelError(
            f"model.llm={llm_ref!r} ({ttype}) has no base-model class in transformers, which "
            f"{model_class} builds its text model with (AutoModel)",
            hint="use an LLM transformers ships (Llama, Qwen2/2.5/3, Mistral, Gemma, SmolLM, ...), or "
            "model.projector=mlp2x_gelu",
        )


class Idefics3Spec(FamilySpec):
    """Idefics3's build recipe: tile settings of the image processor, `image_seq_len` of the processor, and the
    compose recipe of `model.projector: pixel_shuffle` (any SigLIP encoder + any LLM `AutoModel` knows)."""

    def check_compose(self, vision_config: Any, text_config: Any, vision_ref: str, llm_ref: str) -> None:
        """Idefics3's vision model takes SigLIP-shaped encoders only, and its `text_model` is
        `AutoModel.from_config(text_config)` (transformers `modeling_idefics3.py`, 5.23): an LLM without a base-model
        class there cannot load without remote code. Raises ModelError naming the part and the fix."""
        check_siglip_compose(self.model_class, vision_config, text_config, vision_ref, llm_ref, projector="pixel_shuffle",
                             vision_types=COMPOSE_VISION_TYPES, vision_error=ModelError)

    def compose_config(self, vision_config: Any, text_config: Any, *, token_ids: Mapping[str, int], feature_layer: int,
                       feature_strategy: str, projector_config: Mapping[str, Any]):
        """`Idefics3Config` joining a SigLIP vision config (copied into `Idefics3VisionConfig`) and any LLM config.
        `projector_config` holds `scale_factor`. The vision features are the encoder's last layer after its
        post-layernorm (Idefics3 has no feature-layer setting)."""
        import transformers

        vision = transformers.Idefics3VisionConfig(**{k: getattr(vision_config, k) for k in VISION_KEYS if hasattr(vision_config, k)})
        return getattr(transformers, self.config_class)(
            vision_config=vision, text_config=text_config, scale_factor=int(projector_config["scale_factor"]),
            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)), **token_ids,
        )

    def compose_processor(self, tokenizer: Any, image_processor: Any, vision_config: Any, feature_strategy: str,
                          chat_template: str | None, projector_config: Mapping[str, Any] | None = None):
        """`Idefics3Processor`: tiles of the encoder's size (`max_image_size`), images resized to at most 4 tiles a
        side first (SmolVLM's ratio), the encoder's normalization; the tile markers are added to the tokenizer as
        single tokens. `image_seq_len` = (image_size / patch_size)**2 / scale_factor**2."""
        import transformers

        tile = int(vision_config.image_size)
        scale = int((projector_config or {}).get("scale_factor", 2))
        improc = getattr(transformers, self.image_processor_class)(
            do_image_splitting=True, size={"longest_edge": 4 * tile}, max_image_size={"longest_edge": tile},
            image_mean=getattr(image_processor, "image_mean", None) or [0.5, 0.5, 0.5],
            image_std=getattr(image_processor, "image_std", None) or [0.5, 0.5, 0.5],
        )
        missing = [t for t in ("<global-img>", *ROW_COL_TOKENS) if t not in tokenizer.get_vocab()]
        if missing:
            tokenizer.add_tokens(missing, special_tokens=True)
        return self.make_processor(tokenizer, improc, chat_template,
                                   image_seq_len=(tile // int(vision_config.patch_size)) ** 2 // scale**2)

    def expand_images(self, text: str, sizes: Sequence[tuple[int, int]], processor: Any) -> str | None:
        """Each `<image>` of `text` replaced by its tiles and global view with their markers (`idefics3_image_text`),
        as `Idefics3Processor.__call__` does before tokenizing."""
        return replace_in_order(text, self.image_prompt, [idefics3_image_text(*idefics3_grid(w, h, processor)) for w, h in sizes])

    def processor_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`image_seq_len` = (image_size / patch_size)**2 / scale_factor**2 (Idefics3Processor docstring)."""
        vision = config["vision_config"]
        return {"image_seq_len": (vision["image_size"] // vision["patch_size"]) ** 2 // config.get("scale_factor", 2) ** 2}

    def image_size_kwargs(self, kwargs: Mapping[str, Any], size: int) -> dict[str, Any]:
        """`model.image_size` is the longest edge images are resized to before splitting into tiles."""
        return {**kwargs, "size": {"longest_edge": size}}

    def default_image_size(self, image_processor: Any) -> int | None:
        """The tile size (`max_image_size.longest_edge`): an image of that side is one tile."""
        return int(image_processor.max_image_size["longest_edge"])


IDEFICS3 = register(Idefics3Spec(
    name="idefics3",
    collate_prompts=True,
    model_types=("idefics3",),
    model_class="Idefics3ForConditionalGeneration",
    config_class="Idefics3Config",
    processor_class="Idefics3Processor",
    encoders={"image": image_encoder("model.vision_model", layer_classes=("Idefics3EncoderLayer",), cost=vision_cost(pixel_shuffle="scale_factor"))},
    projector=("model.connector",),
    language_model="model.text_model",
    decoder_layer_classes=(),  # the text model is any LLM (Llama for SmolVLM): discovered
    modalities={"image": "<image>"},
    visual_token_rule=idefics3_tokens,
    image_grid_args=("pixel_attention_mask",),
    special_tokens=("<|im_start|>", "<|im_end|>", "<image>", "<fake_token_around_image>", "<global-img>",
                    "<end_of_utterance>", "<pad>", *ROW_COL_TOKENS),
    config_token_ids={"image_token_id": "<image>"},
    image_processor_class="Idefics3ImageProcessor",
    tiny_preset="tiny-idefics3",
    compose=True,
    compose_projectors=("pixel_shuffle",),
    lmms_model="idefics2",
    notes="SmolVLM (v1). Images are split into tiles + a global view; pixel shuffle (scale_factor) in the connector. "
    "model.projector=pixel_shuffle composes any SigLIP encoder + any LLM into it.",
))
