"""The family spec: what a VLM family says about itself, and helpers over a loaded model that read it.

A `FamilySpec` holds everything that differs between VLM families, so no other module branches on a family name:

- identity and loading: `name`, the config `model_types` it covers, the transformers model / config / processor
  classes;
- its encoders (`encoders`: name -> `vlmctl.families.encoders.EncoderSpec`, in forward order: module path, part,
  layer classes, cost rule, kernels, data keys), or the single-encoder form `vision_tower` + `vision_layer_classes`
  from which one image encoder is derived;
- module paths of the other parts on the loaded `*ForConditionalGeneration` model (dotted attribute paths, as in
  `model.get_submodule(path)`): `projector` (a tuple), `language_model`, `lm_head`;
- the language model's FSDP / activation-checkpointing units: `decoder_layer_classes` (class names; empty:
  discovered from the loaded model);
- modalities: the placeholder token per accepted modality (`modalities`), what a chat template writes for one
  media part (`prompts`), the visual-token rule (`fixed_image_tokens` when the size does not matter) and the
  video-token rule (`num_video_tokens`, where the family has one), extra
  `forward()` tensors (`image_grid_args`), the layout of one sample's processor outputs for batching
  (`processor_outputs`), position ids (`mrope`, `position_hook`), whether packed rows work (`supports_packing`);
- the build recipe of `model build`: tokenizer special tokens, config token ids, image / video processor classes
  and the hooks below (`init_random` adjusts a random-init model);
- integrations: liger-kernel patch, lmms-eval model name, sequence / tensor-parallel plans, the linear layers that
  never compute in float8 (`float8_exclude`; see `float8_linears`), the Megatron checkpoint layout.

Each family lives in its own module (the list is in `vlmctl/families/__init__.py`), which documents its module
paths, builds one spec (a subclass where a hook differs) and registers it (`vlmctl.families.registry`).
docs/adding-a-family.md shows how to add one.

Parts: a parameter belongs to the projector when its name starts with a projector path, else to its encoder's part
(`vision`) when it starts with an encoder's path, else to the language model (embeddings and `lm_head` included). In
the Qwen families the projector (the patch merger) sits *inside* the vision tower module, hence this order. Use
`part_of_parameter` / `parts` rather than walking the paths by hand.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from vlmctl.errors import ConfigError, ModelError
from vlmctl.families.encoders import CLS_VISION_TYPES, EncoderSpec, image_encoder  # noqa: F401  (CLS_VISION_TYPES re-exported)

if TYPE_CHECKING:
    import torch

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.

PARTS = ("vision", "projector", "llm")
"""The three parts of a VLM, in the order used by summaries and freezing (`train.freeze` uses the same names)."""


VisualTokenRule = Callable[[int, int, Any], int]
"""(width, height, source) -> image placeholder tokens; `source` is a processor, an image processor, a model config
or a plain dict of the relevant settings (see `split_source`)."""


@dataclass(frozen=True, eq=False, kw_only=True, repr=False)
class FamilySpec:
    """One VLM family. Paths are dotted attribute paths on the loaded `*ForConditionalGeneration` model.

    Specs are compared by identity (one instance per family, held by the registry) and pickle by value (plain data
    and module-level functions). Subclasses override the hook methods; the defaults suit a family whose whole
    model is built from one config (`model.preset`).
    """

    # -- identity and loading
    name: str
    model_types: tuple[str, ...]  # config.model_type values of this family
    model_class: str  # transformers class name, e.g. "LlavaForConditionalGeneration"
    config_class: str
    processor_class: str
    # -- module paths
    projector: tuple[str, ...]
    language_model: str
    lm_head: str = "lm_head"
    # -- the encoders in front of the language model, in forward order: name -> EncoderSpec (`vlmctl.families.encoders`:
    # module path, part, layer classes, cost rule, kernels, token rule, data keys). Empty: one image encoder at
    # `vision_tower` with `vision_layer_classes` and `vision_varlen`, costed by the plain ViT rule.
    encoders: Mapping[str, EncoderSpec] = field(default_factory=dict)
    # the first encoder's path (derived from `encoders` when they are given)
    vision_tower: str = ""
    # -- FSDP / activation-checkpointing units (empty: discovered from the loaded model, e.g. any LLM)
    decoder_layer_classes: tuple[str, ...] = ()
    vision_layer_classes: tuple[str, ...] = ()
    # -- modalities
    modalities: Mapping[str, str] = field(default_factory=lambda: {"image": "<image>"})  # modality -> placeholder token
    prompts: Mapping[str, str] = field(default_factory=dict)  # modality -> chat-template text of one part (default: the token)
    visual_token_rule: VisualTokenRule = field(repr=False)
    image_grid_args: tuple[str, ...] = ()  # extra forward() tensors that come with pixel_values
    mrope: bool = False  # position ids are (3, batch, seq): temporal/height/width (model.get_rope_index)
    fixed_image_tokens: bool = False  # every image becomes the same number of visual tokens, whatever its size
    supports_packing: bool = True  # False: the model cannot take packed rows (`train.packing` falls back to padding)
    # generation: the processor batches prompts by padding its [1, T] outputs on the right and concatenating the rest
    # along dim 0 (`inference.inputs.collate_inputs`), so prompts processed one at a time (serve's processor workers)
    # batch as if processed together; False: they are processed together at admission
    collate_prompts: bool = False
    # generation: the decoding engine merges the visual features into the prompt's embeddings itself, with this
    # `inference.features.MERGES` function (the model's forward reads values back from the device to do it); None: the
    # forward merges them
    prompt_merge: str | None = None
    # the vision tower hands per-image (or per-window) boundaries `cu_seq_lens_q/k` to attention implementations whose
    # name says flash (transformers' `is_flash_attention_requested`): the varlen kernel then encodes a step's images in
    # one call, without the dense block mask (`train.kernels.set_attention`)
    vision_varlen: bool = False
    # -- build recipe (`model build`)
    special_tokens: tuple[str, ...] = ()  # tokens a locally trained tokenizer must have for this family's processor
    extra_special_tokens: Mapping[str, str] = field(default_factory=dict)  # tokenizer attribute -> token (e.g. video_token)
    config_token_ids: Mapping[str, str] = field(default_factory=dict)  # config key -> token whose id it holds
    image_processor_class: str | None = None  # None: the vision encoder's own (compose families)
    video_processor_class: str | None = None
    tiny_preset: str | None = None  # a whole-model preset under vlmctl/models/presets/ that tests build
    compose: bool = False  # builds from any vision encoder + any causal LM (`model.vision` + `model.llm`)
    compose_audio: bool = False  # builds from a Whisper-style audio encoder + any causal LM (`model.audio` + `model.llm`)
    compose_projectors: tuple[str, ...] = ()  # compose: the `model.projector` values this family's layout holds
    unsupported_vision: Mapping[str, str] = field(default_factory=dict)  # compose: vision model_type -> why not
    # -- integrations
    liger_patch: str | None = None  # liger_kernel.transformers function that patches the model class in place
    lmms_model: str | None = None  # the lmms-eval model name that loads this family
    # (model, distributed.sequence.SequenceShard) -> None: what the family splits beyond the language model's sequence
    # under `train.sequence_parallel` (Qwen2-VL / Qwen2.5-VL: the vision tower's images); None: nothing more
    sequence_parallel_plan: Callable[..., Any] | None = None
    # decoder-layer module (relative name) -> tensor-parallel style (`vlmctl.distributed.tensor_parallel`: colwise,
    # rowwise, head_norm) under `train.tensor_parallel`; modules a model lacks are skipped. Empty: no tensor parallelism
    tensor_parallel_plan: Mapping[str, str] = field(default_factory=dict)
    # names (the last part of a module's path) of decoder-layer linears that never compute in float8 (`train.fp8`):
    # MoE routers, whose few logits choose the experts and would flip their choice on float8's rounding
    float8_exclude: tuple[str, ...] = ("gate", "router", "shared_expert_gate")
    # the Megatron checkpoint layout of this family (`vlmctl.convert_megatron.layouts`: megatron_llava,
    # bridge_qwen25_vl, bridge_qwen3_vl); None: `vlmctl convert --to/--from megatron` refuses the family
    megatron_layout: str | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        for name in ("modalities", "prompts", "extra_special_tokens", "config_token_ids", "unsupported_vision", "encoders",
                     "tensor_parallel_plan"):
            object.__setattr__(self, name, dict(getattr(self, name)))  # a copy: the caller's dict stays theirs
        if not self.encoders:
            if not self.vision_tower:
                raise ModelError(f"family {self.name!r} declares no encoder", hint="set encoders={...} or vision_tower=...")
            self.encoders["image"] = image_encoder(self.vision_tower, layer_classes=tuple(self.vision_layer_classes),
                                                   video=self.video_processor_class is not None, varlen=self.vision_varlen)
        # the single-encoder view of older callers: the first encoder's path, every encoder's layer classes
        encoders = list(self.encoders.values())
        for name, value in (("vision_tower", encoders[0].path),
                            ("vision_layer_classes", tuple(dict.fromkeys(c for e in encoders for c in e.layer_classes))),
                            ("vision_varlen", any(e.varlen for e in encoders))):
            if not getattr(self, name):
                object.__setattr__(self, name, value)
        self.check_modalities()

    def check_modalities(self) -> None:
        """Refuse a spec without the placeholder token of its main modality (default: images). Raises ModelError."""
        if "image" not in self.modalities:
            raise ModelError(f"family {self.name!r} declares no image placeholder token", hint="set modalities={'image': ...}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ---- modalities

    @property
    def image_token(self) -> str:
        """The placeholder token the processor expands per image."""
        return self.modalities["image"]

    @property
    def image_prompt(self) -> str:
        """What a chat template writes for one image part (the processor expands `image_token` in it)."""
        return self.prompt("image")

    def prompt(self, modality: str) -> str:
        """Chat-template text of one `modality` part. Raises ModelError for a modality the family does not accept."""
        if modality not in self.modalities:
            raise ModelError(f"family {self.name} does not accept {modality} inputs",
                             hint=f"it accepts: {', '.join(self.modalities)}")
        return self.prompts.get(modality, self.modalities[modality])

    def num_visual_tokens(self, width: int, height: int, processor_or_config: Any) -> int:
        """Image placeholder tokens (positions filled with visual features) for one `width` x `height` image (px).

        `processor_or_config`: the family's processor, its image processor, or the model config (then the
        family's default processor settings are assumed). Returns a token count.
        """
        return int(self.visual_token_rule(int(width), int(height), processor_or_config))

    def expand_images(self, text: str, sizes: Sequence[tuple[int, int]], processor: Any) -> str | None:
        """`text` (a rendered chat with one `image_prompt` per image) as the family's processor rewrites it before
        tokenizing: each image's placeholder replaced by its visual tokens together with the marker tokens and text
        the processor writes around them, for images of `sizes` ((width, height) px) in order.

        None (the default) when the processor writes exactly `num_visual_tokens` image tokens in place of the
        placeholder and nothing else: then the tokens are counted without rebuilding the text. `processor` as for
        `num_visual_tokens` (a processor, or the settings read from its files).
        """
        return None

    def num_video_tokens(self, frames: int, width: int, height: int, processor_or_config: Any, *, fps: float | None = None) -> int:
        """Tokens the family's processor writes in place of one clip's video placeholder, for `frames` sampled frames
        of `width` x `height` pixels at `fps` frames per second (the clip's rate, for processors that write
        timestamps: Qwen3-VL; None: the processor's default), under the family's video processor
        (`processor_or_config` as for `num_visual_tokens`). Returns a token count.

        Raises ModelError where the family has no video-token rule (the default).
        """
        raise ModelError(f"family {self.name} has no video-token rule in vlmctl",
                         hint="train videos with a family that has one (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision)")

    def position_hook(self, model: "torch.nn.Module", image_token_id: int | None) -> Callable[[dict], dict] | None:
        """A batch hook (run by `loop.prefetch` ahead of the step) that sets the position ids a packed row of this
        family needs, or None when the collator's (1, T) per-sample positions are right as they are."""
        return None

    def prompt_positions(self, model: "torch.nn.Module") -> Callable[[Mapping[str, Any]], Any] | None:
        """For generation: a function of a prompt batch's processor tensors on the host (`input_ids`
        [B, T], `attention_mask`, the media grids) returning the position ids the model's forward would derive for
        them (on the host, as a tensor the forward takes as `position_ids`), or None where the forward derives them
        itself; None (the default) where the family has no such function. The decoding engine calls it before the
        tensors reach the device, so the model's per-row Python over device tensors (many small kernels and host
        synchronizations per prompt) does not run at each prefill."""
        return None

    def processor_outputs(self, outputs: Mapping[str, Any], processor: Any) -> Mapping[str, Any]:
        """One sample's processor `outputs` in the layout the collator batches: media tensors with images (or their
        tiles) along dim 0, or Idefics3-style per-sample stacks [1, n, ...]. Default: unchanged."""
        return outputs

    # ---- build recipe: whole-model presets

    def image_processor(self, **kwargs: Any):
        """The family's image processor with preset settings `kwargs`. Raises ModelError when it has no class."""
        import transformers

        if self.image_processor_class is None:
            raise ModelError(f"no image processor recipe for family {self.name}",
                             hint="its image processor comes from the vision encoder (model.vision)")
        return getattr(transformers, self.image_processor_class)(**kwargs)

    def processor_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Extra keyword arguments of the processor class derived from the model config dict (default: none)."""
        return {}

    def config_kwargs(self, data: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of the family's config class from a preset's `config:` `data`, once `model build`
        has filled in `text_config.vocab_size`, the tokenizer's pad / eos ids and `config_token_ids` (top-level keys).
        Default: unchanged; a family whose config is laid out otherwise (flat text settings, token ids inside the
        encoders' configs) moves them."""
        return data

    def image_size_kwargs(self, kwargs: Mapping[str, Any], size: int) -> dict[str, Any]:
        """The image-processor settings `kwargs` changed so images are processed at `size` px (`model.image_size`).

        Raises ConfigError when the family has no such setting.
        """
        raise ConfigError(f"model.image_size is not supported for {self.name} presets", hint="remove model.image_size")

    def default_image_size(self, image_processor: Any) -> int | None:
        """The image side (px) reported in the build summary when the processor has no fixed height (default: None)."""
        return None

    def init_random(self, model: "torch.nn.Module") -> None:
        """Adjust a freshly initialized model of a random-init build in place, where transformers' own
        initialization would keep images from reaching the loss (default: nothing)."""

    def preset_processor(self, tokenizer: Any, chat_template: str | None, kwargs: Mapping[str, Any], config: Mapping[str, Any]):
        """The processor of a whole-model preset: image processor from `kwargs` + `tokenizer` + `chat_template`."""
        return self.make_processor(tokenizer, self.image_processor(**dict(kwargs)), chat_template, **self.processor_kwargs(config))

    def video_processor(self, image_processor: Any):
        """The video processor matching `image_processor`, or None when the family takes no video.

        Raises ImportError where the class needs torchvision and it is not installed.
        """
        if self.video_processor_class is None:
            return None
        import transformers

        return getattr(transformers, self.video_processor_class)()

    def make_processor(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None, **kwargs: Any):
        """The family's processor class from its parts.

        Families whose processor also owns a video processor (Qwen) need torchvision for it; where torchvision is not
        installed (CPU machines) an image-only variant of the same class is returned: identical image/text behaviour,
        saved under the family's class name, `videos=` unsupported.
        """
        import transformers

        cls = getattr(transformers, self.processor_class)
        common = dict(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs)
        if "video_processor" not in inspect.signature(cls.__init__).parameters:
            return cls(**common)
        try:
            video = self.video_processor(image_processor)
        except ImportError:
            video = None
        if video is not None:
            return cls(video_processor=video, **common)
        return _image_only(cls)(video_processor=None, **common)

    def image_only_processor(self, ref: str, *, trust_remote_code: bool = False):
        """The image-only variant of the family's processor class (see `make_processor`) loaded from the saved
        processor at `ref` (a folder or Hub id), its settings (`image_seq_length`, ...) included: for processors that
        own a video processor where torchvision is not installed."""
        import transformers

        cls = getattr(transformers, self.processor_class)
        return _image_only(cls).from_pretrained(ref, trust_remote_code=trust_remote_code)

    # ---- build recipe: compose families (any vision encoder + any causal LM)

    def compose_config(self, vision_config: Any, text_config: Any, *, token_ids: Mapping[str, int], feature_layer: int,
                       feature_strategy: str, projector_config: Mapping[str, Any]):
        """The family config joining `vision_config` and `text_config`. Raises ModelError unless `compose`."""
        raise ModelError(f"family {self.name} does not compose a vision encoder and an LLM", hint="use model.preset or model.base")

    def compose_processor(self, tokenizer: Any, image_processor: Any, vision_config: Any, feature_strategy: str,
                          chat_template: str | None, projector_config: Mapping[str, Any] | None = None):
        """The processor of a composed model. Raises ModelError unless `compose`."""
        raise ModelError(f"family {self.name} does not compose a vision encoder and an LLM", hint="use model.preset or model.base")

    def check_compose(self, vision_config: Any, text_config: Any, vision_ref: str, llm_ref: str) -> None:
        """Refuse, before any weights load, a vision encoder or LLM this compose family's layout cannot hold
        (`text_config` may be a preset's dict). Raises ModelError naming the part and the fix (default: accept)."""


Family = FamilySpec
"""Former name of `FamilySpec`."""

DECODER_TP_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}
"""The tensor-parallel plan of the transformers decoder layers of Llama, Mistral, Qwen2 and Qwen3 (and the language
models of the VLMs built on them): Megatron-LM's split, q/k/v and gate/up by columns (heads, MLP slices), o and
down by rows, Qwen3's per-head q/k norms on each rank's heads."""

PACKED_KEY = "packed_cu_seqlens"
"""The key that marks a packed row of several samples (`vlmctl.data.collate.PackedCollator` writes it)."""


def is_packed(batch: Mapping[str, Any]) -> bool:
    """True for a packed row (one [1, T] row of several samples, `PACKED_KEY` present): what a family's batch hook
    asks before computing per-sample positions."""
    return PACKED_KEY in batch


@lru_cache(maxsize=None)
def _image_only(cls):
    class ImageOnly(cls):
        @classmethod
        def get_attributes(klass):
            return [a for a in super().get_attributes() if a != "video_processor"]

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__  # saved configs name the real class
    return ImageOnly


# --------------------------------------------------------------------------------------------------------------------
# Shared pieces of the visual-token rules
# --------------------------------------------------------------------------------------------------------------------


def setting(source: Any, *names: str, default: Any = None) -> Any:
    """First attribute (or dict key) of `source` among `names` that is set, else `default`."""
    for name in names:
        value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
        if value is not None:
            return value
    return default


def replace_in_order(text: str, placeholder: str, replacements: Sequence[str]) -> str:
    """`text` with its first len(`replacements`) occurrences of `placeholder` replaced by `replacements`, in order
    (what a processor's per-image `replace_image_token` does); later occurrences stay."""
    pieces = text.split(placeholder)
    out = [pieces[0]]
    for i, piece in enumerate(pieces[1:]):
        out.append(replacements[i] if i < len(replacements) else placeholder)
        out.append(piece)
    return "".join(out)


def split_source(source: Any) -> tuple[Any, Any, Any]:
    """(processor, image_processor, model_config) views of a visual-token rule's `source`; missing ones are None."""
    if source is None:
        return None, None, None
    if hasattr(source, "image_processor"):
        return source, source.image_processor, None
    if hasattr(source, "vision_config") or (isinstance(source, dict) and "vision_config" in source):
        return None, None, source
    return None, source, None  # an image processor or a dict of its settings


def has_cls_token(vision_config: Any) -> bool:
    """True when the encoder's output starts with a CLS token (CLIP, ViT), False for SigLIP-style encoders.

    Decided by instantiating the embeddings on the meta device (no memory): `num_positions > num_patches` means an
    extra CLS position; falls back to `CLS_VISION_TYPES` by model type.
    """
    import torch
    from transformers import AutoModel

    try:
        with torch.device("meta"):
            emb = AutoModel.from_config(vision_config).embeddings
        return int(emb.num_positions) > int(emb.num_patches)
    except Exception:  # noqa: BLE001 - encoders without these attributes
        return vision_config.model_type in CLS_VISION_TYPES


# --------------------------------------------------------------------------------------------------------------------
# Helpers over a loaded model
# --------------------------------------------------------------------------------------------------------------------


def part_of_parameter(name: str, family: FamilySpec) -> str:
    """"vision", "projector" or "llm" (an encoder's `part`) for a parameter name of a model of `family` (see the
    module docstring)."""
    name = _strip_wrappers(name)
    if any(name == p or name.startswith(p + ".") for p in family.projector):
        return "projector"
    encoder = encoder_of_parameter(name, family)
    return family.encoders[encoder].part if encoder is not None else "llm"


def encoder_of_parameter(name: str, family: FamilySpec) -> str | None:
    """The name of the encoder (a key of `family.encoders`) whose module holds parameter `name`, projector
    modules included (Qwen's merger sits inside its tower); None for the language model's."""
    name = _strip_wrappers(name)
    for key, enc in family.encoders.items():
        if name.startswith(enc.path + "."):
            return key
    return None


def _strip_wrappers(name: str) -> str:
    # peft (base_model.model.), torch.compile (_orig_mod.) and DDP (module.) add prefixes.
    for prefix in ("base_model.model.", "_orig_mod.", "module."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def count_parameters(model: "torch.nn.Module", family: FamilySpec, *, trainable_only: bool = False) -> dict[str, int]:
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


def parts(model: "torch.nn.Module", family: FamilySpec) -> dict[str, list["torch.nn.Module"]]:
    """The modules of each part: {"vision": [vision tower], "projector": [...], "llm": [language model, lm_head]}.

    Note that for the Qwen families the projector modules are children of the vision tower module.
    """
    out: dict[str, list] = {part: [] for part in PARTS}
    for enc in family.encoders.values():
        out.setdefault(enc.part, []).append(model.get_submodule(enc.path))
    out["projector"] = [model.get_submodule(p) for p in family.projector]
    out["llm"] = [model.get_submodule(family.language_model), model.get_submodule(family.lm_head)]
    return out


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


def decoder_layer_classes(model: "torch.nn.Module", family: FamilySpec) -> tuple[type, ...]:
    """Classes of the language model's decoder layers (for FSDP wrapping / activation checkpointing).

    Raises ModelError when the language model has no repeated layers.
    """
    return _classes(model, family.language_model, family.decoder_layer_classes)


def vision_layer_classes(model: "torch.nn.Module", family: FamilySpec) -> tuple[type, ...]:
    """Classes of the encoders' layers (every encoder of `family.encoders`, in order). Raises ModelError when an
    encoder has none."""
    found: dict[type, None] = {}
    for enc in family.encoders.values():
        found.update(dict.fromkeys(_classes(model, enc.path, enc.layer_classes)))
    return tuple(found)


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


def decoder_layers(model: "torch.nn.Module", family: FamilySpec) -> list["torch.nn.Module"]:
    """The language model's decoder layers, in order."""
    return _layer_list(model.get_submodule(_find_prefix(model, family.language_model)))


def float8_linears(model: "torch.nn.Module", family: FamilySpec) -> list[tuple[str, "torch.nn.Module"]]:
    """(module path, module) of the linear layers of `model` that may compute in float8 (`train.fp8`): the
    `nn.Linear` modules inside the language model's decoder layers, except those `family.float8_exclude` names (MoE
    routers). Everything outside the decoder layers stays in high precision: the embeddings, the LM head (its
    logits feed the loss), the encoders (vision, audio) and the projector. A peft-wrapped model's LoRA layers are not
    `nn.Linear` (their base layers are, and would be listed). Which of these convert also depends on their shapes
    (`vlmctl.distributed.float8.convertible`)."""
    import torch

    inside = {id(m) for layer in decoder_layers(model, family) for m in layer.modules()}
    return [(name, m) for name, m in model.named_modules() if id(m) in inside and isinstance(m, torch.nn.Linear)
            and name.rpartition(".")[2] not in family.float8_exclude]


def vision_layers(model: "torch.nn.Module", family: FamilySpec) -> list["torch.nn.Module"]:
    """The encoders' layers (the FSDP2 / activation-checkpointing units in front of the language model): each
    encoder's in order, the encoders in `family.encoders` (forward) order."""
    return [layer for layers in encoder_layers(model, family).values() for layer in layers]


def encoder_layers(model: "torch.nn.Module", family: FamilySpec) -> dict[str, list["torch.nn.Module"]]:
    """Encoder name -> its layers in order: the longest list of identical blocks under its path."""
    return {key: _layer_list(model.get_submodule(_find_prefix(model, enc.path))) for key, enc in family.encoders.items()}
