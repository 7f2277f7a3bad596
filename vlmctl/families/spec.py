"""The model-family table: one data entry per VLM family, not a class hierarchy.

Each `Family` says how to load a checkpoint of that family, where its three parts live on the loaded
`*ForConditionalGeneration` model (dotted attribute paths, as in `model.get_submodule(path)`), which module classes
are its transformer blocks (for FSDP wrapping and activation checkpointing), how many visual tokens an image becomes,
and its quirks (Qwen's 3-D mRoPE position ids, extra image-grid arguments to `forward`).

Module paths were checked against transformers 5.23 with tiny random configs (tests/test_models_families.py):

| family      | vision tower   | projector                                   | language model          |
|-------------|----------------|---------------------------------------------|-------------------------|
| llava       | model.vision_tower | model.multi_modal_projector             | model.language_model    |
| qwen2_vl    | model.visual   | model.visual.merger                         | model.language_model    |
| qwen2_5_vl  | model.visual   | model.visual.merger                         | model.language_model    |
| qwen3_vl    | model.visual   | model.visual.merger, model.visual.deepstack_merger_list | model.language_model |
| idefics3    | model.vision_model | model.connector                         | model.text_model        |

In the Qwen families the projector (the patch merger) sits *inside* the vision tower module: a parameter belongs to
the projector when its name starts with a projector path, else to the vision tower when it starts with the vision
path, else to the language model (embeddings and `lm_head` included). Use `part_of_parameter` / `parts` rather than
walking the paths by hand.

Adding a family = adding one entry to `FAMILIES` plus a tiny preset under `presets/` (the tests build every preset).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from vlmctl.errors import ModelError

if TYPE_CHECKING:
    import torch

PARTS = ("vision", "projector", "llm")
"""The three parts of a VLM, in the order used by summaries and freezing (`train.freeze` uses the same names)."""


# --------------------------------------------------------------------------------------------------------------------
# Visual-token rules. Each takes (width, height, source) where `source` is a processor, an image processor, a model
# config or a plain dict of the relevant settings, and returns the number of image placeholder tokens (the positions
# whose embeddings are replaced by visual features) one image of `width` x `height` pixels becomes.
# --------------------------------------------------------------------------------------------------------------------


def _get(source: Any, *names: str, default: Any = None) -> Any:
    """First attribute (or dict key) of `source` among `names` that is set."""
    for name in names:
        value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
        if value is not None:
            return value
    return default


def _split(source: Any) -> tuple[Any, Any, Any]:
    """(processor, image_processor, model_config) views of `source`; missing ones are None."""
    if source is None:
        return None, None, None
    if hasattr(source, "image_processor"):
        return source, source.image_processor, None
    if hasattr(source, "vision_config") or (isinstance(source, dict) and "vision_config" in source):
        return None, None, source
    return None, source, None  # an image processor or a dict of its settings


def _llava_tokens(width: int, height: int, source: Any) -> int:
    """LLaVA: the image is resized to a fixed square, every patch is one token, `default` drops the CLS token.

    Source: transformers `LlavaProcessor.replace_image_token` (5.23):
    `(h // patch) * (w // patch) + num_additional_image_tokens - (strategy == "default")`.
    The input size does not matter (fixed resize).
    """
    proc, improc, cfg = _split(source)
    if cfg is not None:
        vcfg = _get(cfg, "vision_config")
        size = int(_get(vcfg, "image_size"))
        patch = int(_get(vcfg, "patch_size"))
        strategy = _get(cfg, "vision_feature_select_strategy", default="default")
        cls = 1 if _get(vcfg, "model_type", default="") in CLS_VISION_TYPES else 0
        return (size // patch) ** 2 + cls - (1 if strategy == "default" else 0)
    crop = _get(improc, "crop_size") if _get(improc, "do_center_crop", default=False) else None
    size = crop or _get(improc, "size")
    h = size.get("height") or size.get("shortest_edge")
    w = size.get("width") or size.get("shortest_edge")
    patch = int(_get(proc, "patch_size"))
    extra = int(_get(proc, "num_additional_image_tokens", default=0))
    strategy = _get(proc, "vision_feature_select_strategy", default="default")
    return (h // patch) * (w // patch) + extra - (1 if strategy == "default" else 0)


def _qwen_tokens(width: int, height: int, source: Any, *, patch: int, merge: int, min_pixels: int, max_pixels: int) -> int:
    """Qwen2-VL / 2.5-VL / 3-VL: resize to multiples of patch*merge inside [min_pixels, max_pixels], then one token
    per merge x merge block of patches.

    Source: transformers `qwen2_vl.image_processing_qwen2_vl.smart_resize` and `Qwen2VLProcessor`:
    tokens = (H' / patch) * (W' / patch) / merge**2 with (H', W') = smart_resize(H, W, patch * merge, ...).
    """
    # The PIL module imports without torchvision (the default one does not).
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // patch) * (w // patch) // (merge * merge)


def _qwen_rule(default_patch: int, default_min: int, default_max: int) -> Callable[[int, int, Any], int]:
    def rule(width: int, height: int, source: Any) -> int:
        _, improc, cfg = _split(source)
        if cfg is not None:
            vcfg = _get(cfg, "vision_config")
            patch = int(_get(vcfg, "patch_size", default=default_patch))
            merge = int(_get(vcfg, "spatial_merge_size", default=2))
            return _qwen_tokens(width, height, None, patch=patch, merge=merge, min_pixels=default_min, max_pixels=default_max)
        size = _get(improc, "size", default={}) or {}
        return _qwen_tokens(
            width, height, None,
            patch=int(_get(improc, "patch_size", default=default_patch)),
            merge=int(_get(improc, "merge_size", default=2)),
            min_pixels=int(_get(improc, "min_pixels", default=None) or size.get("shortest_edge", default_min)),
            max_pixels=int(_get(improc, "max_pixels", default=None) or size.get("longest_edge", default_max)),
        )

    rule.__doc__ = _qwen_tokens.__doc__
    return rule


def _idefics3_resize(height: int, width: int, longest: int, max_size: int = 4096) -> tuple[int, int]:
    """Idefics3's resize before splitting: longest edge -> `longest` (the other edge rounded up to even), then
    capped at 4096 px. Source: `_resize_output_size_rescale_to_max_len` and `..._scale_below_upper_bound` in
    transformers `models/idefics3/image_processing_idefics3.py` (5.23)."""
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


def _idefics3_tokens(width: int, height: int, source: Any) -> int:
    """Idefics3 / SmolVLM: the image is resized so its longest edge is `size.longest_edge`, split into tiles of
    `max_image_size.longest_edge` plus one global image; each tile becomes `image_seq_len` tokens
    (= (tile / patch)**2 / scale_factor**2 after pixel shuffle).

    Source: transformers `Idefics3ImageProcessor.get_number_of_image_patches` and `Idefics3Processor` (5.23).
    Counts `<image>` tokens only; the processor also adds `<fake_token_around_image>` / `<row_i_col_j>` text markers.
    """
    proc, improc, cfg = _split(source)
    if cfg is not None:
        vcfg = _get(cfg, "vision_config")
        tile = int(_get(vcfg, "image_size"))
        seq_len = (tile // int(_get(vcfg, "patch_size"))) ** 2 // int(_get(cfg, "scale_factor", default=2)) ** 2
        longest, splitting = 4 * tile, True
    else:
        tile = int(_get(improc, "max_image_size")["longest_edge"])
        longest = int(_get(improc, "size")["longest_edge"])
        splitting = bool(_get(improc, "do_image_splitting", default=True))
        seq_len = int(_get(proc, "image_seq_len"))
    if not splitting:
        return seq_len
    h, w = _idefics3_resize(height, width, longest)
    rows, cols = math.ceil(h / tile), math.ceil(w / tile)
    if rows == 1 and cols == 1:
        return seq_len
    return seq_len * (rows * cols + 1)


CLS_VISION_TYPES = frozenset({"clip_vision_model", "clip", "vit", "dinov2", "chinese_clip_vision_model", "metaclip_2_vision_model"})
"""Vision encoder `model_type`s whose output starts with a CLS token (LLaVA's `default` strategy drops it)."""


# --------------------------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One VLM family. Paths are dotted attribute paths on the loaded `*ForConditionalGeneration` model."""

    name: str
    model_types: tuple[str, ...]  # config.model_type values of this family
    model_class: str  # transformers class name, e.g. "LlavaForConditionalGeneration"
    config_class: str
    processor_class: str
    vision_tower: str
    projector: tuple[str, ...]
    language_model: str
    lm_head: str
    decoder_layer_classes: tuple[str, ...]  # empty: discovered from the loaded model (llava wraps any LLM)
    vision_layer_classes: tuple[str, ...]
    image_token: str  # the placeholder token the processor expands per image
    image_prompt: str  # what a chat template writes for one image part (the processor expands image_token in it)
    visual_token_rule: Callable[[int, int, Any], int] = field(repr=False)
    mrope: bool = False  # position ids are (3, batch, seq): temporal/height/width (model.get_rope_index)
    image_grid_args: tuple[str, ...] = ()  # extra forward() tensors that come with pixel_values
    special_tokens: tuple[str, ...] = ()  # tokens a locally trained tokenizer must have for this family's processor
    liger_patch: str | None = None  # liger_kernel.transformers function that patches the model class in place
    lmms_model: str | None = None  # the lmms-eval model name that loads this family
    notes: str = ""

    def position_hook(self, model: "torch.nn.Module", image_token_id: int | None) -> Callable[[dict], dict] | None:
        """A batch hook (run by `loop.prefetch` ahead of the step) that sets the position ids a packed row of this
        family needs, or None when the collator's (1, T) per-sample positions are right as they are."""
        if not self.mrope:
            return None
        return mrope_prepare(model, image_token_id)

    def num_visual_tokens(self, width: int, height: int, processor_or_config: Any) -> int:
        """Image placeholder tokens (positions filled with visual features) for one `width` x `height` image.

        `processor_or_config`: the family's processor, its image processor, or the model config (then the
        family's default processor settings are assumed). Returns a token count.
        """
        return int(self.visual_token_rule(int(width), int(height), processor_or_config))


_QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

FAMILIES: dict[str, Family] = {
    "llava": Family(
        name="llava",
        liger_patch="apply_liger_kernel_to_llava",
        lmms_model="llava_hf",
        model_types=("llava",),
        model_class="LlavaForConditionalGeneration",
        config_class="LlavaConfig",
        processor_class="LlavaProcessor",
        vision_tower="model.vision_tower",
        projector=("model.multi_modal_projector",),
        language_model="model.language_model",
        lm_head="lm_head",
        decoder_layer_classes=(),
        vision_layer_classes=(),
        image_token="<image>",
        image_prompt="<image>",
        visual_token_rule=_llava_tokens,
        image_grid_args=(),
        special_tokens=("<|im_start|>", "<|im_end|>", "<image>", "<pad>"),
        notes="Any vision encoder + any causal LM; layer classes are discovered from the loaded model.",
    ),
    "qwen2_vl": Family(
        name="qwen2_vl",
        liger_patch="apply_liger_kernel_to_qwen2_vl",
        lmms_model="qwen2_vl",
        model_types=("qwen2_vl",),
        model_class="Qwen2VLForConditionalGeneration",
        config_class="Qwen2VLConfig",
        processor_class="Qwen2VLProcessor",
        vision_tower="model.visual",
        projector=("model.visual.merger",),
        language_model="model.language_model",
        lm_head="lm_head",
        decoder_layer_classes=("Qwen2VLDecoderLayer",),
        vision_layer_classes=("Qwen2VLVisionBlock",),
        image_token="<|image_pad|>",
        image_prompt="<|vision_start|><|image_pad|><|vision_end|>",
        visual_token_rule=_qwen_rule(14, 56 * 56, 28 * 28 * 1280),
        mrope=True,
        image_grid_args=("image_grid_thw",),
        special_tokens=_QWEN_TOKENS,
    ),
    "qwen2_5_vl": Family(
        name="qwen2_5_vl",
        liger_patch="apply_liger_kernel_to_qwen2_5_vl",
        lmms_model="qwen2_5_vl",
        model_types=("qwen2_5_vl",),
        model_class="Qwen2_5_VLForConditionalGeneration",
        config_class="Qwen2_5_VLConfig",
        processor_class="Qwen2_5_VLProcessor",
        vision_tower="model.visual",
        projector=("model.visual.merger",),
        language_model="model.language_model",
        lm_head="lm_head",
        decoder_layer_classes=("Qwen2_5_VLDecoderLayer",),
        vision_layer_classes=("Qwen2_5_VLVisionBlock",),
        image_token="<|image_pad|>",
        image_prompt="<|vision_start|><|image_pad|><|vision_end|>",
        visual_token_rule=_qwen_rule(14, 56 * 56, 28 * 28 * 1280),
        mrope=True,
        image_grid_args=("image_grid_thw",),
        special_tokens=_QWEN_TOKENS,
        notes="Window attention in the vision tower except fullatt_block_indexes.",
    ),
    "qwen3_vl": Family(
        name="qwen3_vl",
        liger_patch="apply_liger_kernel_to_qwen3_vl",
        lmms_model="qwen3_vl",
        model_types=("qwen3_vl",),
        model_class="Qwen3VLForConditionalGeneration",
        config_class="Qwen3VLConfig",
        processor_class="Qwen3VLProcessor",
        vision_tower="model.visual",
        projector=("model.visual.merger", "model.visual.deepstack_merger_list"),
        language_model="model.language_model",
        lm_head="lm_head",
        decoder_layer_classes=("Qwen3VLTextDecoderLayer",),
        vision_layer_classes=("Qwen3VLVisionBlock",),
        image_token="<|image_pad|>",
        image_prompt="<|vision_start|><|image_pad|><|vision_end|>",
        # Qwen3-VL's published processor: patch 16, shortest_edge 65536, longest_edge 16777216 pixels.
        visual_token_rule=_qwen_rule(16, 65536, 16777216),
        mrope=True,
        image_grid_args=("image_grid_thw",),
        special_tokens=_QWEN_TOKENS,
        notes="DeepStack: features of some vision layers are added to early decoder layers (deepstack_merger_list).",
    ),
    "idefics3": Family(
        name="idefics3",
        lmms_model="idefics2",
        model_types=("idefics3",),
        model_class="Idefics3ForConditionalGeneration",
        config_class="Idefics3Config",
        processor_class="Idefics3Processor",
        vision_tower="model.vision_model",
        projector=("model.connector",),
        language_model="model.text_model",
        lm_head="lm_head",
        decoder_layer_classes=(),  # the text model is any LLM (Llama for SmolVLM): discovered
        vision_layer_classes=("Idefics3EncoderLayer",),
        image_token="<image>",
        image_prompt="<image>",
        visual_token_rule=_idefics3_tokens,
        image_grid_args=("pixel_attention_mask",),
        special_tokens=("<|im_start|>", "<|im_end|>", "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", "<pad>"),
        notes="SmolVLM (v1). Images are split into tiles + a global view; pixel shuffle (scale_factor) in the connector.",
    ),
}


def get_family(name: str) -> Family:
    """The table entry for `name` (e.g. "qwen2_5_vl"). Raises ModelError listing the known families."""
    key = name.strip().lower().replace("-", "_").replace(".", "_")
    if key in FAMILIES:
        return FAMILIES[key]
    for fam in FAMILIES.values():
        if key in fam.model_types:
            return fam
    raise ModelError(
        f"unknown model family {name!r}",
        hint=f"model.family must be one of: {', '.join(FAMILIES)} (or leave it unset to detect it from the checkpoint)",
    )


def detect_family(config: Any) -> str:
    """Family name from a transformers config (or a config dict) by its `model_type`.

    Raises ModelError when the model type is not a supported VLM family.
    """
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam.name
    raise ModelError(
        f"model type {model_type!r} is not a supported VLM family",
        hint=f"supported families: {', '.join(FAMILIES)}; to build a VLM from a vision encoder and an LLM, set "
        "model.vision and model.llm instead of model.base",
    )


# --------------------------------------------------------------------------------------------------------------------
# Helpers over a loaded model
# --------------------------------------------------------------------------------------------------------------------


def part_of_parameter(name: str, family: Family) -> str:
    """"vision", "projector" or "llm" for a parameter name of a model of `family` (see the module docstring)."""
    name = _strip_wrappers(name)
    if any(name == p or name.startswith(p + ".") for p in family.projector):
        return "projector"
    if name.startswith(family.vision_tower + "."):
        return "vision"
    return "llm"


def _strip_wrappers(name: str) -> str:
    # peft (base_model.model.), torch.compile (_orig_mod.) and DDP (module.) add prefixes.
    for prefix in ("base_model.model.", "_orig_mod.", "module."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def count_parameters(model: "torch.nn.Module", family: Family, *, trainable_only: bool = False) -> dict[str, int]:
    """Parameter counts per part: {"vision": n, "projector": n, "llm": n, "total": n}. Tied weights count once.

    Works on meta-device models (counts only shapes).
    """
    counts = dict.fromkeys(PARTS, 0)
    for name, p in model.named_parameters():  # named_parameters() de-duplicates tied parameters
        if trainable_only and not p.requires_grad:
            continue
        counts[part_of_parameter(name, family)] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


def parts(model: "torch.nn.Module", family: Family) -> dict[str, list["torch.nn.Module"]]:
    """The modules of each part: {"vision": [vision tower], "projector": [...], "llm": [language model, lm_head]}.

    Note that for the Qwen families the projector modules are children of the vision tower module.
    """
    return {
        "vision": [model.get_submodule(family.vision_tower)],
        "projector": [model.get_submodule(p) for p in family.projector],
        "llm": [model.get_submodule(family.language_model), model.get_submodule(family.lm_head)],
    }


def _layer_list(module: "torch.nn.Module") -> list["torch.nn.Module"]:
    """The longest `nn.ModuleList` of identical blocks under `module` (the transformer layers)."""
    import torch

    best: list = []
    for _, sub in module.named_modules():
        if isinstance(sub, torch.nn.ModuleList) and len(sub) > len(best):
            kinds = {type(m) for m in sub}
            if len(kinds) == 1:
                best = list(sub)
    return best


def decoder_layer_classes(model: "torch.nn.Module", family: Family) -> tuple[type, ...]:
    """Classes of the language model's decoder layers (for FSDP wrapping / activation checkpointing)."""
    return _classes(model, family.language_model, family.decoder_layer_classes)


def vision_layer_classes(model: "torch.nn.Module", family: Family) -> tuple[type, ...]:
    """Classes of the vision tower's encoder layers."""
    return _classes(model, family.vision_tower, family.vision_layer_classes)


def _classes(model: "torch.nn.Module", path: str, names: tuple[str, ...]) -> tuple[type, ...]:
    sub = model.get_submodule(_find_prefix(model, path))
    if names:
        found = {type(m) for m in sub.modules() if type(m).__name__ in names}
        if found:
            return tuple(sorted(found, key=lambda t: t.__name__))
    layers = _layer_list(sub)
    if not layers:
        raise ModelError(f"no transformer layers found under {path}", hint="check model.family matches the checkpoint")
    return (type(layers[0]),)


def _find_prefix(model: "torch.nn.Module", path: str) -> str:
    """`path`, or `path` under a wrapper prefix (peft's base_model.model.) when the model is wrapped."""
    for prefix in ("", "base_model.model.", "_orig_mod.", "module."):
        try:
            model.get_submodule(prefix + path)
            return prefix + path
        except AttributeError:
            continue
    raise ModelError(f"module {path} not found on {type(model).__name__}", hint="check model.family matches the checkpoint")


def decoder_layers(model: "torch.nn.Module", family: Family) -> list["torch.nn.Module"]:
    """The language model's decoder layers, in order."""
    return _layer_list(model.get_submodule(_find_prefix(model, family.language_model)))


def vision_layers(model: "torch.nn.Module", family: Family) -> list["torch.nn.Module"]:
    """The vision tower's encoder layers, in order."""
    return _layer_list(model.get_submodule(_find_prefix(model, family.vision_tower)))


# --------------------------------------------------------------------------------------------------------------------
# Position ids (Qwen's 3-D mRoPE)
# --------------------------------------------------------------------------------------------------------------------


def rope_index_fn(model):
    """The Qwen-VL model's own `get_rope_index` (mRoPE positions; a pure function of the config), found on the
    unwrapped model (LoRA wrappers included)."""
    for module in model.modules():
        fn = getattr(module, "get_rope_index", None)
        if callable(fn):
            return fn
    raise ModelError("this Qwen-VL model has no get_rope_index method", hint="use a transformers version that supports the family")


def mrope_prepare(model, image_token_id: int | None):
    """A batch hook (run by `loop.prefetch` ahead of the step) replacing the packed row's (1, T) position ids by the
    (4, 1, T) text + mRoPE
    position ids computed per sample (`vlmctl.data.packing.mrope_position_ids`), on CPU before the device copy."""
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
