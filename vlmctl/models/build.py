"""`model build`: turn the `model` section into a standard Hugging Face VLM folder.

Three modes, picked from the section:

- **compose** (`vision` + `llm`): a vision encoder and a causal LM joined by a projector into the layout of the
  compose family that holds `model.projector` (`vlmctl.families.compose_family(projector)`: LLaVA's
  `LlavaForConditionalGeneration` for mlp2x_gelu / linear, LLaVA-1.5, Liu et al. 2023,
  https://arxiv.org/abs/2310.03744; Idefics3's for pixel_shuffle; Idefics2's for perceiver; see `vlmctl.models.connectors`) with its processor (the encoder's image processor, the LLM's tokenizer
  with the image token added, a chat template). Loads with plain `AutoModelForImageTextToText` / `AutoProcessor`.
- **audio compose** (`audio` + `llm`): the encoder half of a Whisper checkpoint, a linear projector and any causal
  LM in Qwen2-Audio's `Qwen2AudioForConditionalGeneration` (the family that takes audio and composes it,
  `_audio_family`; see `vlmctl.families.qwen2_audio`), with `Qwen2AudioProcessor` over the checkpoint's Whisper
  feature extractor and the LLM's tokenizer. Loads with plain `AutoModelForMultimodalLM` / `AutoProcessor`.
- **preset** (`preset` with `init: random`): a whole model built from a size preset under `presets/` (YAML data):
  weights initialized from configs, tokenizer trained on the prepared data (`vlmctl.models.tokenizer`). No download.
- **base** (`base`): an existing VLM of a registered family (`vlmctl.families.FAMILIES`). The build loads it once
  to verify it, records its family and parameter counts, and writes only `vlmctl_model.json` pointing at it
  (weights are neither copied nor linked); `load_model(output_dir)` follows the pointer.

What differs between families (config token ids, image / video processor or audio feature extractor, tokenizer
special tokens, image-size settings) is asked of the family spec (`vlmctl.families.FamilySpec`); this module branches on no family name.
Everything that can be checked without weights (ids, configs, tokenizer, chat template, vision/LLM compatibility) is
checked before any weights load. Output is written to a temporary sibling folder and renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from vlmctl.config.model import PRESET_DIR, ModelSection  # noqa: F401 - PRESET_DIR: re-exported
from vlmctl.errors import ConfigError, ModelError
from vlmctl.families import CLS_VISION_TYPES, FamilySpec, compose_family, count_parameters, get_family, has_cls_token
from vlmctl.models.connectors import PROJECTORS, ProjectorSpec, check_connector, projector_spec  # noqa: F401  (re-exported)
from vlmctl.models.load import DTYPES, INFO_FILE, image_processor_class, load_or_explain, quiet_transformers, transformers_class
from vlmctl.models.tokenizer import chatml_template, texts_from_prepared, train_tokenizer
from vlmctl.outputs import check_replaceable, install, local_paths

# accelerate, torch, transformers and yaml are imported inside the functions that use them: importing vlmctl (the
# CLI's start-up) must not pay for them.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules are imported next to their use as well.

INFO_VERSION = 1


# --------------------------------------------------------------------------------------------------------------------
# Presets (YAML data)
# --------------------------------------------------------------------------------------------------------------------


def list_presets() -> dict[str, str]:
    """{preset name: description} of the shipped presets."""
    return {p.stem: load_preset(p.stem).get("description", "") for p in sorted(PRESET_DIR.glob("*.yaml"))}


@lru_cache(maxsize=None)
def _read_preset(name: str) -> str:
    return (PRESET_DIR / f"{name}.yaml").read_text()


def load_preset(name: str) -> dict[str, Any]:
    """The preset `name` as a dict (a fresh copy). Keys: description, family, vision, llm, config, processor,
    projector, vision_feature_layer, tokenizer. Raises ConfigError for an unknown name."""
    import yaml

    if not (PRESET_DIR / f"{name}.yaml").is_file():
        from vlmctl.config.model import unknown_preset

        raise ConfigError(unknown_preset(name), hint="set model.preset (or model.vision / model.llm with model.init: "
                          "random) to one of the names `vlmctl model presets` lists")
    return yaml.safe_load(_read_preset(name))


def is_preset(ref: str | None) -> bool:
    return bool(ref) and "/" not in ref and (PRESET_DIR / f"{ref}.yaml").is_file()


# --------------------------------------------------------------------------------------------------------------------
# Projectors
# --------------------------------------------------------------------------------------------------------------------


# `ProjectorSpec`, `PROJECTORS` and the settings checks live in `vlmctl.models.connectors` (re-exported here).


# --------------------------------------------------------------------------------------------------------------------
# Plan: everything resolved without weights
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class BuildPlan:
    """What will be built, resolved from the section without loading weights."""

    mode: str  # "compose" | "preset" | "base"
    family: FamilySpec
    init: str
    section: ModelSection
    preset: str | None = None
    vision_ref: str | None = None
    audio_ref: str | None = None
    llm_ref: str | None = None
    base_ref: str | None = None
    vision_config: Any = None  # compose: the vision encoder's config
    audio_config: Any = None  # audio compose: the audio encoder's config (a WhisperConfig)
    feature_extractor: Any = None  # audio compose: the encoder's feature extractor
    text_config: Any = None  # compose: the LLM's config
    vlm_config: dict[str, Any] | None = None  # preset of a whole family: the family config as a dict
    projector: ProjectorSpec | None = None
    feature_layer: int = -2
    feature_strategy: str = "full"
    tokenizer: Any = None  # a loaded tokenizer, or None: train one
    tokenizer_vocab_size: int = 512
    chat_template: str | None = None
    image_processor: Any = None
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    image_size: int | None = None
    trust_remote_code: bool = False
    base_config: Any = None
    resampler_shares: list[float] = field(default_factory=list)  # perceiver_init=region: own-cell attention per block


def plan_build(model: ModelSection) -> BuildPlan:
    """Resolve the section into a `BuildPlan`: configs, tokenizer, chat template, compatibility checks.

    Downloads nothing but configs/tokenizers of Hub ids (none offline or for presets); loads no weights.
    Raises ConfigError for an incomplete or contradictory section, ModelError for ids that cannot be resolved or
    combinations that cannot work.
    """
    trc = model.trust_remote_code
    preset_name = model.preset
    if preset_name is None and model.init == "random" and is_preset(model.base):
        preset_name = model.base
    if preset_name is not None:
        if model.init != "random":
            raise ConfigError(
                f"model.preset={preset_name!r} builds a model from configs only and needs model.init: random",
                hint="set model.init=random, or use model.base / model.vision + model.llm for pretrained weights",
            )
        if model.vision or model.llm:
            raise ConfigError("set model.preset or model.vision + model.llm, not both", hint="remove one of them")
        return _plan_preset(model, preset_name)
    if model.base is not None:
        return _plan_base(model)
    if model.audio is not None:
        return _plan_audio(model)
    if model.vision is None or model.llm is None:
        missing = "model.llm" if model.vision else "model.vision" if model.llm else "model.vision and model.llm"
        raise ConfigError(
            f"{missing} not set: nothing to build",
            hint="compose a VLM with model.vision + model.llm, fine-tune one with model.base, or use "
            "model.preset=tiny with model.init=random",
        )
    plan = BuildPlan(mode="compose", family=compose_family(model.projector, model.family), init=model.init, section=model,
                     trust_remote_code=trc, vision_ref=model.vision, llm_ref=model.llm)
    plan.vision_config = _vision_config(model.vision, model.init, trc, plan.family)
    plan.text_config = _llm_config(model.llm, model.init, trc)
    plan.projector = projector_spec(model)
    check_connector(model, plan.projector, plan.vision_config, plan.text_config)
    plan.family.check_compose(plan.vision_config, plan.text_config, model.vision, model.llm)
    plan.feature_layer = model.vision_feature_layer
    if is_preset(model.vision) and "vision_feature_layer" not in model.model_fields_set:
        plan.feature_layer = load_preset(model.vision).get("vision_feature_layer", plan.feature_layer)
    _check_feature_layer(plan)
    plan.feature_strategy = _feature_strategy(model.vision_feature_select_strategy, plan.vision_config)
    plan.image_size = _image_size(model, plan.vision_config, pretrained=model.init == "pretrained")
    # Tokenizer and chat template: checked before any weights load.
    tok_ref = model.tokenizer or (None if is_preset(model.llm) else model.llm)
    if tok_ref is not None:
        plan.tokenizer = _load_tokenizer(tok_ref, plan.family, trc)
    plan.chat_template = _chat_template(model, plan.tokenizer, plan.family)
    plan.image_processor = _image_processor(model.vision, plan.vision_config, plan.image_size, trc)
    return plan


def _audio_family() -> FamilySpec:
    """The registered family that composes an audio encoder and an LLM (`FamilySpec.compose_audio`). Raises
    ModelError when none is registered."""
    from vlmctl.families.registry import compose_audio_family

    return compose_audio_family()


def _plan_audio(model: ModelSection) -> BuildPlan:
    """The plan of `model.audio` + `model.llm`: the Whisper encoder's config and feature extractor, the LLM's config,
    tokenizer (the audio tokens added) and chat template. Reads configs and tokenizers only."""
    if model.llm is None:
        raise ConfigError("model.llm not set: model.audio needs a language model to compose with",
                          hint="set model.llm to a causal LM (Hub id, local folder, or an LLM preset with model.init=random)")
    trc = model.trust_remote_code
    family = _audio_family()
    plan = BuildPlan(mode="compose", family=family, init=model.init, section=model, trust_remote_code=trc,
                     audio_ref=model.audio, llm_ref=model.llm)
    plan.audio_config = load_or_explain("audio encoder", model.audio,
                                        lambda: transformers_class("AutoConfig").from_pretrained(model.audio, trust_remote_code=trc))
    plan.feature_extractor = family.audio_feature_extractor(plan.audio_config, model.audio, trust_remote_code=trc)
    plan.text_config = _llm_config(model.llm, model.init, trc)
    tok_ref = model.tokenizer or (None if is_preset(model.llm) else model.llm)
    if tok_ref is not None:
        plan.tokenizer = _load_tokenizer(tok_ref, family, trc)
    plan.chat_template = _chat_template(model, plan.tokenizer, family)
    return plan


def _plan_preset(model: ModelSection, name: str) -> BuildPlan:
    data = load_preset(name)
    if "family" not in data:
        raise ConfigError(
            f"preset {name!r} is only a {'vision encoder' if 'vision' in data else 'language model'}",
            hint=f"use it as model.{'vision' if 'vision' in data else 'llm'}={name} (with model.init=random), "
            "or pick a whole-model preset such as tiny or qwen2.5-vl-3b",
        )
    family = get_family(data["family"])
    composed = "config" not in data  # the preset holds a vision encoder and an LLM config
    if composed and ("projector" in model.model_fields_set or model.family):
        family = compose_family(model.projector, model.family)  # the projector (or model.family) picks the layout
    plan = BuildPlan(mode="preset", family=family, init="random", section=model, preset=name)
    plan.tokenizer_vocab_size = int((data.get("tokenizer") or {}).get("vocab_size", 512))
    if model.tokenizer is not None:
        ref = model.tokenizer
        plan.tokenizer = _load_tokenizer(ref, family, model.trust_remote_code)
    if composed:
        plan.vision_config = _config_from_dict(data["vision"])
        plan.text_config = data["llm"]  # made a config once the tokenizer size is known (vocab_size: auto)
        plan.projector = projector_spec(model, model.projector if "projector" in model.model_fields_set else data.get("projector", "mlp2x_gelu"))
        check_connector(model, plan.projector, plan.vision_config, plan.text_config)
        family.check_compose(plan.vision_config, plan.text_config, name, name)
        plan.feature_layer = model.vision_feature_layer if "vision_feature_layer" in model.model_fields_set else data.get("vision_feature_layer", -2)
        _check_feature_layer(plan)
        plan.feature_strategy = _feature_strategy(model.vision_feature_select_strategy, plan.vision_config)
        plan.image_size = _image_size(model, plan.vision_config, pretrained=False)
        plan.image_processor = _image_processor(None, plan.vision_config, plan.image_size, False)
    else:
        plan.vlm_config = data["config"]
        plan.processor_kwargs = dict(data.get("processor") or {})
        if model.image_size is not None:
            plan.processor_kwargs = family.image_size_kwargs(plan.processor_kwargs, model.image_size)
        plan.image_size = model.image_size
    plan.chat_template = _chat_template(model, plan.tokenizer, family)
    return plan


def _plan_base(model: ModelSection) -> BuildPlan:
    ref = model.base
    cfg = load_or_explain("model", ref, lambda: transformers_class("AutoConfig").from_pretrained(ref, trust_remote_code=model.trust_remote_code))
    from vlmctl.families import detect_family

    family = get_family(model.family) if model.family else get_family(detect_family(cfg))
    if cfg.model_type not in family.model_types:
        raise ConfigError(
            f"model.family={model.family!r} but {ref} is a {cfg.model_type!r} model",
            hint=f"remove model.family (detected: {cfg.model_type}) or point model.base at a {model.family} checkpoint",
        )
    if model.vision_feature_select_strategy != "auto" or "vision_feature_layer" in model.model_fields_set:
        raise ConfigError(
            "model.vision_feature_layer / vision_feature_select_strategy apply to composed models, not to model.base",
            hint="remove them; an existing VLM keeps the settings it was trained with",
        )
    return BuildPlan(mode="base", family=family, init="pretrained", section=model, base_ref=ref, base_config=cfg,
                     trust_remote_code=model.trust_remote_code, image_size=model.image_size)


def _load_tokenizer(ref: str, family: FamilySpec, trc: bool):
    # `extra_special_tokens` adds the image token (a family without images: its own special tokens, e.g. Qwen2-Audio's
    # audio_token) when missing and exposes it as `tokenizer.image_token`, which is what the processors read; it is
    # saved with the tokenizer.
    extra = {"image_token": family.image_token} if _takes_images(family) else dict(family.extra_special_tokens)
    return load_or_explain("tokenizer", ref, lambda: transformers_class("AutoTokenizer").from_pretrained(
        ref, trust_remote_code=trc, extra_special_tokens=extra))


def _takes_images(family: FamilySpec) -> bool:
    return "image" in family.modalities


def _chatml(family: FamilySpec) -> str:
    """vlmctl's ChatML template (`models.tokenizer.chatml_template`) writing the family's prompt for each part of a
    modality the family takes (`{"type": "image"}`, `{"type": "video"}`, `{"type": "audio"}`)."""
    return chatml_template(prompts={m: family.prompt(m) for m in family.modalities})


def _config_from_dict(data: dict[str, Any]):
    from transformers import AutoConfig

    data = dict(data)
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _preset_part(ref: str, part: str, what: str, init: str) -> dict[str, Any]:
    """The `vision` or `llm` part of size preset `ref` (a config dict); ConfigError when the preset has no such
    part or `model.init` is not random."""
    data = load_preset(ref)
    if part not in data:
        others = ", ".join(n for n in list_presets() if part in load_preset(n))
        raise ConfigError(f"preset {ref!r} is not {what}", hint=f"{'vision' if part == 'vision' else 'LLM'} presets: {others}")
    if init != "random":
        raise ConfigError(f"model.{part}={ref!r} is a size preset: it needs model.init=random", hint=f"or set model.{part} to a Hub id / local folder")
    return data[part]


def _vision_config(ref: str, init: str, trc: bool, family: FamilySpec):
    if is_preset(ref):
        cfg = _config_from_dict(_preset_part(ref, "vision", "a vision encoder", init))
    else:
        cfg = load_or_explain("vision encoder", ref, lambda: transformers_class("AutoConfig").from_pretrained(ref, trust_remote_code=trc))
    if getattr(cfg, "vision_config", None) is not None and getattr(cfg, "text_config", None) is not None and cfg.model_type in ("clip", "siglip", "siglip2", "chinese_clip", "metaclip_2"):
        cfg = cfg.vision_config  # a dual encoder (CLIP/SigLIP): keep its vision half
    elif getattr(cfg, "vision_config", None) is not None:
        raise ModelError(
            f"model.vision={ref!r} is a {cfg.model_type!r} model, not a vision encoder",
            hint="set model.vision to a vision encoder (SigLIP, CLIP, ...); to fine-tune this VLM use model.base",
        )
    if cfg.model_type in family.unsupported_vision:
        raise ModelError(f"model.vision={ref!r}: {family.unsupported_vision[cfg.model_type]}", hint="choose another vision encoder")
    if not hasattr(cfg, "hidden_size") or not hasattr(cfg, "patch_size"):
        raise ModelError(f"model.vision={ref!r} ({cfg.model_type}) is not a ViT-style vision encoder (no hidden_size/patch_size)",
                         hint="LLaVA composition supports ViT encoders such as SigLIP and CLIP")
    if hasattr(cfg, "vision_use_head"):
        cfg.vision_use_head = False  # SigLIP's attention-pooling head is unused by LLaVA: do not carry its weights
    return cfg


def _llm_config(ref: str, init: str, trc: bool):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if is_preset(ref):
        return _preset_part(ref, "llm", "a language model", init)  # a config once the tokenizer is known (vocab_size may be `auto`)
    cfg = load_or_explain("language model", ref, lambda: transformers_class("AutoConfig").from_pretrained(ref, trust_remote_code=trc))
    if getattr(cfg, "vision_config", None) is not None:
        raise ModelError(f"model.llm={ref!r} is a vision-language model ({cfg.model_type})",
                         hint="to fine-tune an existing VLM set model.base instead of model.vision + model.llm")
    if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trc:
        raise ModelError(f"model.llm={ref!r} ({cfg.model_type}) is not a causal language model transformers knows",
                         hint="use a decoder-only LLM (Qwen2/2.5/3, Llama, Mistral, Gemma, SmolLM, ...)")
    return cfg


def _check_feature_layer(plan: BuildPlan) -> None:
    n = plan.vision_config.num_hidden_layers
    if not -n <= plan.feature_layer <= n:
        raise ConfigError(
            f"model.vision_feature_layer={plan.feature_layer} is outside the vision encoder's {n} layers",
            hint=f"use -1 (last layer), -2 (LLaVA-1.5's choice) or any index in [-{n}, {n}]",
        )


def _feature_strategy(value: str, vision_config) -> str:
    cls = has_cls_token(vision_config)
    if value == "auto":
        return "default" if cls else "full"
    if value == "default" and not cls:
        raise ConfigError(
            f"model.vision_feature_select_strategy=default drops a CLS token, but {vision_config.model_type} has none",
            hint="use auto or full (SigLIP-style encoders output patch tokens only)",
        )
    return value


def _image_size(model: ModelSection, vision_config, *, pretrained: bool) -> int:
    native = int(vision_config.image_size)
    if model.image_size is None or model.image_size == native:
        return native
    if model.image_size % vision_config.patch_size:
        raise ConfigError(f"model.image_size={model.image_size} is not a multiple of the patch size {vision_config.patch_size}",
                          hint=f"use a multiple of {vision_config.patch_size}")
    if pretrained:
        raise ConfigError(
            f"model.image_size={model.image_size} differs from the encoder's native {native} px",
            hint="LLaVA does not interpolate position embeddings; remove model.image_size or pick an encoder trained at that size",
        )
    vision_config.image_size = model.image_size
    return model.image_size


def _chat_template(model: ModelSection, tokenizer, family: FamilySpec) -> str | None:
    text = model.chat_template
    if text is not None:
        p = Path(text).expanduser()
        if "{" not in text and p.suffix in (".jinja", ".j2", ".txt") or ("{" not in text and p.is_file()):
            if not p.is_file():
                raise ConfigError(f"model.chat_template file {p} does not exist", hint="give a .jinja file path or the template text")
            text = p.read_text()
        return text
    if tokenizer is None:
        return _chatml(family)  # the tokenizer will be trained with ChatML tokens
    if getattr(tokenizer, "chat_template", None):
        return None  # keep the LLM's own
    raise ModelError(
        f"the tokenizer of {model.tokenizer or model.llm or model.base} has no chat template",
        hint="set model.chat_template (a .jinja file or inline text), or use the LLM's instruct/chat variant",
    )


def _image_processor(ref: str | None, vision_config, image_size: int, trc: bool):
    """The encoder's own image processor (when it has one) at `image_size`, else one built for its model type."""
    proc = None
    if ref is not None and not is_preset(ref):
        try:
            from transformers import AutoImageProcessor

            proc = AutoImageProcessor.from_pretrained(ref, trust_remote_code=trc)
        except Exception:  # noqa: BLE001 - a config-only folder: build one below
            proc = None
    if proc is None:
        if vision_config.model_type in CLS_VISION_TYPES:
            proc = image_processor_class("CLIPImageProcessor")(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
        else:
            proc = image_processor_class("SiglipImageProcessor")(size={"height": image_size, "width": image_size})
    return proc


# --------------------------------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class BuildResult:
    """What `build_model` wrote. `parameters`: counts per part ("vision", "projector", "llm", "total")."""

    output_dir: Path
    family: str
    mode: str
    parameters: dict[str, int]
    visual_tokens_per_image: int | None
    image_size: int | None
    seconds: float
    info: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"output_dir": str(self.output_dir), "family": self.family, "mode": self.mode, "parameters": self.parameters,
                "visual_tokens_per_image": self.visual_tokens_per_image, "image_size": self.image_size,
                "seconds": round(self.seconds, 2)}


def build_model(
    model: ModelSection,
    *,
    prepared_dir: Path | None = None,
    tokenizer_texts: Iterable[str] | None = None,
    force: bool = False,
    seed: int = 0,
) -> BuildResult:
    """Build the model described by `model` into `model.output_dir` and return what was written.

    `prepared_dir`: the prepared data (Parquet shards under `train/`), used to train a tokenizer when the model has
    none (random-init presets); `tokenizer_texts` can be given instead (tests). `force` replaces an existing build.
    `seed` seeds random initialization (deterministic builds).

    The folder holds config.json, generation_config.json, model.safetensors (or shards), the processor/tokenizer
    files and `vlmctl_model.json` ({family, mode, built_from, parameters, visual_tokens_per_image, ...}); in base
    mode only `vlmctl_model.json`.

    Raises ModelError when the folder exists and `force` is False, ConfigError/ModelError for bad input (see
    `plan_build`), DataError when a tokenizer must be trained and there is no text.
    """
    start = time.perf_counter()
    out = Path(model.output_dir)
    if out.exists() and not force:
        raise ModelError(f"{out} already exists", hint="pass --force to rebuild it (the old folder is replaced), or set model.output_dir")
    inputs = local_paths(prepared_dir, model.base, model.vision, model.llm, model.audio, model.tokenizer, model.chat_template)
    check_replaceable(out, "model", inputs=inputs, what="model.output_dir", fix="set model.output_dir to another folder")
    with quiet_transformers():
        plan = plan_build(model)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            if plan.mode == "base":
                info = _build_base(plan, tmp)
            else:
                processor = make_processor(plan, prepared_dir=prepared_dir, tokenizer_texts=tokenizer_texts)
                vlm = make_model(plan, processor, seed=seed)
                info = _info(plan, vlm, processor)
                save_model(vlm, tmp)
                processor.save_pretrained(tmp)
            info["settings"] = build_settings(model)  # `vlmctl train` refuses a model.* changed since
            (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
            check_replaceable(out, "model", inputs=inputs, what="model.output_dir", fix="set model.output_dir to another folder")
            install(tmp, out, "model")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return BuildResult(output_dir=out, family=info["family"], mode=info["mode"], parameters=info["parameters"],
                       visual_tokens_per_image=info.get("visual_tokens_per_image"), image_size=info.get("image_size"),
                       seconds=time.perf_counter() - start, info=info)


def save_model(model, folder: Path) -> None:
    """`model.save_pretrained(folder)` without importing DeepSpeed.

    transformers unwraps the model through accelerate before saving, and accelerate imports DeepSpeed (when it is
    installed) only to test `isinstance(model, DeepSpeedEngine)`: seconds of start-up and a "Setting accelerator to
    CPU" warning on CPU machines. A model that is not already inside a DeepSpeed engine cannot be one, so the probe
    is skipped unless DeepSpeed is already imported.
    """

    with quiet_transformers():
        if "deepspeed" in sys.modules:
            model.save_pretrained(folder)
            return
        try:
            import accelerate.utils.other as unwrap
        except ImportError:
            model.save_pretrained(folder)
            return
        probe = getattr(unwrap, "is_deepspeed_available", None)
        unwrap.is_deepspeed_available = lambda: False
        try:
            model.save_pretrained(folder)
        finally:
            unwrap.is_deepspeed_available = probe


def _torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def _round_up(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


# ---- processor ----


def make_processor(plan: BuildPlan, *, prepared_dir: Path | None = None, tokenizer_texts: Iterable[str] | None = None):
    """The processor of the planned model: tokenizer (loaded, or trained on the data) + image processor.

    Adds the family's image token (and `<pad>` when the tokenizer has no padding token) to a loaded tokenizer.
    Raises DataError when a tokenizer must be trained and neither `tokenizer_texts` nor shards are available.
    """
    fam = plan.family
    tok = plan.tokenizer
    if tok is None:
        texts = list(tokenizer_texts) if tokenizer_texts is not None else None
        if texts is None:
            if prepared_dir is None:
                from vlmctl.errors import DataError

                raise DataError("a tokenizer must be trained for this random-init model, but there is no data",
                                hint="run `vlmctl data prepare` first (its shards are used), or set model.tokenizer")
            texts = list(texts_from_prepared(Path(prepared_dir)))
        images = _takes_images(fam)
        tok = train_tokenizer(texts, vocab_size=plan.tokenizer_vocab_size, special_tokens=fam.special_tokens,
                              image_token=fam.image_token if images else None, image_prompt=fam.image_prompt if images else "",
                              extra_special_tokens=dict(fam.extra_special_tokens))
    else:
        if tok.pad_token is None:
            tok.add_special_tokens({"pad_token": "<pad>"})
    if plan.chat_template is not None:
        tok.chat_template = plan.chat_template
    template = tok.chat_template
    if plan.audio_config is not None:  # composed from an audio encoder and an LLM
        return fam.compose_audio_processor(tok, plan.feature_extractor, template)
    if plan.vlm_config is None:  # composed from a vision encoder and an LLM
        return fam.compose_processor(tok, plan.image_processor, plan.vision_config, plan.feature_strategy, template,
                                     projector_config=plan.projector.config)
    return fam.preset_processor(tok, template, plan.processor_kwargs, plan.vlm_config)


def configured_processor(model: ModelSection):
    """The processor of the configured model for token counts before a build (`vlmctl.data.counting`), or the
    build plan when its tokenizer must be trained (`ConfiguredProcessor.trained_on` then trains it as the build
    will); None when the section names no model. Loads configs, tokenizers and image-processor settings only (never
    weights). Pass it to `vlmctl.data.prepare.prepare_data(processors=...)`.

    Raises ConfigError / ModelError as `plan_build` does (an incomplete section, an id that cannot be resolved).
    """

    from vlmctl.data.counting import ConfiguredProcessor, model_configured
    from vlmctl.models.load import load_processor

    if not model_configured(model):
        return None
    plan = plan_build(model)
    family = plan.family.name
    if plan.mode == "base":
        processor = load_processor(plan.base_ref, trust_remote_code=plan.trust_remote_code)
        return ConfiguredProcessor(family, f"the processor of model.base {plan.base_ref}", processor=processor)
    encoder = f"model.audio {plan.audio_ref}" if plan.audio_ref else f"model.vision {plan.vision_ref}"
    what = f"model.preset {plan.preset}" if plan.preset else f"{encoder} + model.llm {plan.llm_ref}"
    if plan.tokenizer is None:
        return ConfiguredProcessor(family, f"{what}, tokenizer trained on the prepared train split as `model build` does",
                                   plan=plan, trained_on=partial(_processor_trained_on, plan))
    return ConfiguredProcessor(family, f"{what} (not built yet)", processor=make_processor(plan))


def _processor_trained_on(plan: BuildPlan, conversations) -> Any:
    """`make_processor(plan)` with its tokenizer trained on the text parts of `conversations` (`Sample.messages`),
    as the build trains it on the prepared shards (`conversation_texts`); None when they hold no text."""
    from vlmctl.models.tokenizer import conversation_texts

    texts = list(conversation_texts(conversations))
    return make_processor(plan, tokenizer_texts=texts) if texts else None


# ---- model ----


def make_config(plan: BuildPlan, tokenizer=None):
    """The family config of the planned model. `tokenizer` (or the preset's tokenizer size) sets token ids and
    `vocab_size: auto`."""
    import transformers

    fam = plan.family
    vocab = len(tokenizer) if tokenizer is not None else plan.tokenizer_vocab_size

    def ids(*tokens):
        return [tokenizer.convert_tokens_to_ids(t) if tokenizer is not None else i for i, t in enumerate(tokens)]

    names = list(fam.config_token_ids)
    *values, pad_id, eos_id = ids(*fam.config_token_ids.values(), "<pad>", "<|im_end|>")
    token_ids = dict(zip(names, values))
    if plan.vlm_config is None:  # composed from a vision encoder and an LLM
        text = plan.text_config
        if isinstance(text, dict):
            text = dict(text)
            if text.get("vocab_size") == "auto":
                text["vocab_size"] = _round_up(vocab)
            text = _config_from_dict(text)
        else:
            text = text.__class__.from_dict(text.to_dict())
        if tokenizer is not None and len(tokenizer) > text.vocab_size:
            text.vocab_size = _round_up(len(tokenizer))  # embeddings are resized on load; record the final size
        if tokenizer is not None:
            pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        text.pad_token_id = pad_id
        if isinstance(plan.text_config, dict):  # a preset: its token ids are the trained tokenizer's
            text.eos_token_id, text.bos_token_id = eos_id, None
        if plan.audio_config is not None:
            return fam.compose_audio_config(plan.audio_config, text, token_ids=token_ids)
        return fam.compose_config(plan.vision_config, text, token_ids=token_ids, feature_layer=plan.feature_layer,
                                  feature_strategy=plan.feature_strategy, projector_config=plan.projector.config)
    data = json.loads(json.dumps(plan.vlm_config))
    text = data.setdefault("text_config", {})
    if text.get("vocab_size") == "auto":
        text["vocab_size"] = _round_up(vocab)
    data.update(token_ids)
    if tokenizer is not None:
        text.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return getattr(transformers, fam.config_class)(**fam.config_kwargs(data))


def instantiate(plan: BuildPlan, tokenizer=None, *, device: str | None = None, dtype: str | None = None):
    """A randomly initialized model of the plan's architecture. `device="meta"` allocates nothing (for counting)."""

    import torch
    import transformers

    cfg = make_config(plan, tokenizer)
    cls = getattr(transformers, plan.family.model_class)
    ctx = torch.device(device) if device else contextlib.nullcontext()
    prev = torch.get_default_dtype()
    if dtype:
        torch.set_default_dtype(_torch_dtype(dtype))
    try:
        with ctx:
            return cls(cfg)
    finally:
        torch.set_default_dtype(prev)


def make_model(plan: BuildPlan, processor, *, seed: int = 0):
    """The planned model with weights: loaded (compose, pretrained) or randomly initialized (seeded)."""
    import torch

    tok = processor.tokenizer
    dtype = plan.section.dtype
    if plan.init == "random":
        torch.manual_seed(seed)
        vlm = instantiate(plan, tok)
        plan.family.init_random(vlm)
        if plan.projector is not None and plan.projector.init is not None:
            plan.projector.init(vlm.get_submodule(plan.family.projector[0]))
        vlm = vlm.to(_torch_dtype(dtype))
    elif plan.audio_config is not None:
        vlm = _compose_audio_pretrained(plan, tok, seed)
    else:
        vlm = _compose_pretrained(plan, tok, seed)
    _seed_resampler(plan, vlm, seed)
    _set_generation_config(vlm, tok)
    vlm.eval()
    return vlm


def _seed_resampler(plan: BuildPlan, vlm, seed: int) -> None:
    """`model.perceiver_init: region`: start the perceiver resampler as a region pooler
    (`connectors.seed_perceiver_regions`) once the vision tower it reads is in place. Raises ModelError when the
    encoder's output does not depend on where a patch is (nothing to seed from)."""
    if plan.projector is None or plan.projector.name != "perceiver" or plan.section.perceiver_init != "region":
        return
    from vlmctl.models.connectors import seed_perceiver_regions

    plan.resampler_shares = seed_perceiver_regions(vlm, plan.family.vision_tower, plan.family.projector[0], seed=seed)
    if not plan.resampler_shares:
        raise ModelError("model.perceiver_init=region: the vision encoder's output does not depend on where a patch is, "
                         "so there is no position to seed the resampler's queries from",
                         hint="set model.perceiver_init=random")


def _compose_pretrained(plan: BuildPlan, tok, seed: int):
    """Load the vision encoder and LLM weights and join them with a fresh projector (the compose family's layout).

    The family's skeleton is built on the meta device and its vision tower / language model / lm_head (at the
    spec's module paths) are replaced by the loaded modules, so peak memory is one copy of the weights.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch_dtype = _torch_dtype(plan.section.dtype)
    trc = plan.trust_remote_code
    cfg = make_config(plan, tok)
    with quiet_transformers():
        vision = load_or_explain("vision encoder weights", plan.vision_ref, lambda: _load_vision(plan.vision_ref, plan.vision_config, torch_dtype, trc))
        llm = load_or_explain("language model weights", plan.llm_ref, lambda: AutoModelForCausalLM.from_pretrained(plan.llm_ref, dtype=torch_dtype, trust_remote_code=trc))
    cfg.text_config = llm.config
    fam = plan.family
    with torch.device("meta"):
        vlm = getattr(transformers, fam.model_class)(cfg)
    vlm.set_submodule(fam.vision_tower, _fit_vision(vlm.get_submodule(fam.vision_tower), vision, plan.vision_ref))
    vlm.set_submodule(fam.language_model, llm.get_decoder())
    vlm.set_submodule(fam.lm_head, llm.get_output_embeddings())
    torch.manual_seed(seed)
    for i, path in enumerate(fam.projector):
        projector = vlm.get_submodule(path).to_empty(device="cpu")
        for layer in projector.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.reset_parameters()  # nn.Linear's default init (as LLaVA's projector)
        if i == 0 and plan.projector.init is not None:
            plan.projector.init(projector)
        vlm.set_submodule(path, projector.to(torch_dtype))
    # Buffers of the skeleton that were not replaced (none in LLaVA today) must not stay on meta.
    meta = [n for n, t in [*vlm.named_parameters(), *vlm.named_buffers()] if t.is_meta]
    if meta:
        raise ModelError(f"internal: parameters left uninitialized after composition: {meta[:3]}")
    if len(tok) > vlm.get_input_embeddings().weight.shape[0]:
        vlm.resize_token_embeddings(len(tok), pad_to_multiple_of=64, mean_resizing=True)
    vlm.config.text_config.vocab_size = vlm.get_input_embeddings().weight.shape[0]
    vlm.config.text_config.pad_token_id = tok.pad_token_id
    if getattr(vlm.config.text_config, "tie_word_embeddings", False):
        vlm.config.tie_word_embeddings = True
        vlm.tie_weights()
    return vlm


def _compose_audio_pretrained(plan: BuildPlan, tok, seed: int):
    """Load the Whisper encoder's and the LLM's weights into the audio family's layout with a fresh linear projector
    (nn.Linear's default init, seeded). The skeleton is built on the meta device; the audio tower takes the
    encoder's state dict as it is (`Qwen2AudioEncoder` has `WhisperEncoder`'s parameter names), the language model is
    the LLM's decoder, and the LM head a copy of the LLM's (untied: the Qwen2-Audio class ties no weights). Peak
    memory: the Whisper checkpoint (decoder included) plus the LLM, once. Raises ModelError when a part does not
    fit."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch_dtype = _torch_dtype(plan.section.dtype)
    trc = plan.trust_remote_code
    cfg = make_config(plan, tok)
    fam = plan.family
    with quiet_transformers():
        whisper = load_or_explain("audio encoder weights", plan.audio_ref,
                                  lambda: transformers.AutoModel.from_pretrained(plan.audio_ref, dtype=torch_dtype, trust_remote_code=trc))
        llm = load_or_explain("language model weights", plan.llm_ref,
                              lambda: AutoModelForCausalLM.from_pretrained(plan.llm_ref, dtype=torch_dtype, trust_remote_code=trc))
    encoder = whisper.get_encoder() if hasattr(whisper, "get_encoder") else whisper
    cfg.text_config = llm.config
    with torch.device("meta"):
        vlm = getattr(transformers, fam.model_class)(cfg)
    tower = vlm.get_submodule(fam.vision_tower).to_empty(device="cpu")
    missing, unexpected = tower.load_state_dict(encoder.state_dict(), strict=False)
    if missing or unexpected:
        raise ModelError(f"the encoder of model.audio={plan.audio_ref!r} does not fit {type(tower).__name__}: missing "
                         f"{missing[:2]}, unexpected {unexpected[:2]}", hint="use a Whisper checkpoint")
    vlm.set_submodule(fam.vision_tower, tower.to(torch_dtype))
    del whisper, encoder
    vlm.set_submodule(fam.language_model, llm.get_decoder())
    head = llm.get_output_embeddings()
    untied = torch.nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, dtype=head.weight.dtype)
    untied.load_state_dict(head.state_dict())
    vlm.set_submodule(fam.lm_head, untied)
    torch.manual_seed(seed)
    for path in fam.projector:
        projector = vlm.get_submodule(path).to_empty(device="cpu")
        for layer in projector.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.reset_parameters()
        vlm.set_submodule(path, projector.to(torch_dtype))
    meta = [n for n, t in [*vlm.named_parameters(), *vlm.named_buffers()] if t.is_meta]
    if meta:
        raise ModelError(f"internal: parameters left uninitialized after composition: {meta[:3]}")
    if len(tok) > vlm.get_input_embeddings().weight.shape[0]:
        vlm.resize_token_embeddings(len(tok), pad_to_multiple_of=64, mean_resizing=True)
    vlm.config.text_config.vocab_size = vlm.get_input_embeddings().weight.shape[0]
    vlm.config.text_config.pad_token_id = tok.pad_token_id
    vlm.config.text_config.tie_word_embeddings = False
    return vlm


def _fit_vision(skeleton, vision, ref: str):
    """`vision` (the loaded encoder) as the module the family's layout holds: itself when the classes match (LLaVA
    holds the encoder's own class), else the skeleton's class (on the meta device) filled with its weights, the
    parameter names equal up to a wrapper prefix (Idefics3's vision model has SigLIP's names without `vision_model.`).
    Raises ModelError when the names do not match."""
    if type(skeleton) is type(vision):
        return vision
    src = vision.state_dict()
    want = set(skeleton.state_dict())
    for prefix in ("", *sorted({k.split(".", 1)[0] + "." for k in src if "." in k})):
        sub = {k[len(prefix):]: v for k, v in src.items() if k.startswith(prefix)}
        if set(sub) == want:
            target = skeleton.to_empty(device="cpu")
            target.load_state_dict(sub, strict=True)
            return target.to(next(iter(sub.values())).dtype)
    raise ModelError(f"the weights of model.vision={ref!r} ({type(vision).__name__}) do not fit {type(skeleton).__name__}",
                     hint=f"missing e.g. {sorted(want - set(src))[:2]}; use model.projector=mlp2x_gelu for this encoder")


def _load_vision(ref: str, vision_config, dtype, trc: bool):
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    # The vision half of a CLIP/SigLIP checkpoint loads into its vision-only class (unused text weights are skipped).

    vision_cls = MODEL_MAPPING[type(vision_config)]
    return vision_cls.from_pretrained(ref, config=vision_config, dtype=dtype, trust_remote_code=trc)


def _set_generation_config(vlm, tok) -> None:
    gc = vlm.generation_config
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    ids = {i for i in (eos, tok.eos_token_id) if i is not None}
    gc.eos_token_id = sorted(ids) if len(ids) > 1 else next(iter(ids), None)
    gc.pad_token_id = tok.pad_token_id
    if gc.bos_token_id is not None and gc.bos_token_id >= len(tok):
        gc.bos_token_id = None


# ---- info ----


def build_settings(model: ModelSection) -> dict[str, Any]:
    """The `model` keys a build follows (all but model.output_dir), as JSON values: recorded in vlmctl_model.json
    (`settings`) so a later `vlmctl train` sees a model.* changed since the build (`changed_settings`)."""
    return model.model_dump(mode="json", exclude={"output_dir"})


def changed_settings(model: ModelSection, info: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (built with, configured now)} of the model.* keys that differ from a build's recorded `settings`
    (nothing for a build that recorded none), but for the storage dtype (`STORAGE_ONLY`)."""
    built = info.get("settings")
    if not isinstance(built, dict):
        return {}
    now = build_settings(model)
    return {key: (built.get(key), value) for key, value in now.items()
            if key in built and key not in STORAGE_ONLY and built[key] != value}


# model.* keys that change how a build's files are stored, not the model trained from them: training loads the
# weights in its own dtype (train.precision / train.master_weights), whatever model.dtype wrote them in
STORAGE_ONLY = frozenset({"dtype"})


def rebuild_if_changed(model: ModelSection, *, prepared_dir: Path | None = None, seed: int = 0) -> BuildResult | None:
    """Build `model` again into model.output_dir (replacing it) when a model.* key changed since it was built
    (`changed_settings`); returns the build, or None when nothing changed or nothing was built there."""
    from vlmctl.models.load import read_build_info

    info = read_build_info(model.output_dir)
    if not info or not changed_settings(model, info):
        return None
    return build_model(model, prepared_dir=prepared_dir, force=True, seed=seed)


def _info(plan: BuildPlan, vlm, processor) -> dict[str, Any]:
    s = plan.section
    size = (plan.image_size or _default_image_size(plan.family, processor)) if _takes_images(plan.family) else None
    return {
        "version": INFO_VERSION,
        "family": plan.family.name,
        "mode": plan.mode,
        "init": plan.init,
        "built_from": {
            "preset": plan.preset, "vision": plan.vision_ref, "audio": plan.audio_ref, "llm": plan.llm_ref, "base": plan.base_ref,
            "projector": plan.projector.name if plan.projector else None,
            "tokenizer": s.tokenizer or ("trained" if plan.section.tokenizer is None and (plan.mode == "preset" or is_preset(plan.llm_ref)) else plan.llm_ref),
            "vision_feature_layer": plan.feature_layer if plan.projector and plan.projector.feature_select else None,
            "vision_feature_select_strategy": plan.feature_strategy if plan.projector and plan.projector.feature_select else None,
            "pixel_shuffle_scale": plan.projector.config.get("scale_factor") if plan.projector else None,
            "perceiver_queries": (plan.projector.queries or None) if plan.projector else None,
            "perceiver_init": s.perceiver_init if plan.projector and plan.projector.name == "perceiver" else None,
        },
        **({"resampler_own_cell_attention": [round(x, 4) for x in plan.resampler_shares]} if plan.resampler_shares else {}),
        "model_class": type(vlm).__name__,
        "dtype": s.dtype,
        "parameters": count_parameters(vlm, plan.family),
        "image_size": size,
        "visual_tokens_per_image": plan.family.num_visual_tokens(size, size, processor) if size else None,
        **_audio_info(plan.family, processor),
        "vocab_size": len(processor.tokenizer),
        "vlmctl_version": _version(),
    }


def _audio_info(family: FamilySpec, processor) -> dict[str, Any]:
    """For a family that takes audio: `audio_window_seconds` (the feature extractor's window; longer clips are cut)
    and `audio_tokens_per_window` (the audio tokens of a clip filling it, the family's audio-token rule)."""
    extractor = getattr(processor, "feature_extractor", None)
    if "audio" not in family.modalities or extractor is None:
        return {}
    rate, samples = int(extractor.sampling_rate), int(extractor.n_samples)
    return {"audio_window_seconds": samples / rate, "audio_tokens_per_window": family.num_audio_tokens(samples, rate, processor)}


def _default_image_size(family: FamilySpec, processor) -> int | None:
    improc = processor.image_processor
    size = getattr(improc, "crop_size", None) if getattr(improc, "do_center_crop", False) else getattr(improc, "size", None)
    if isinstance(size, dict) and size.get("height"):
        return int(size["height"])
    return family.default_image_size(improc)


def _version() -> str:
    from vlmctl import __version__

    return __version__


def _build_base(plan: BuildPlan, tmp: Path) -> dict[str, Any]:
    """Verify an existing VLM loads (config, processor, weights) and describe it; copy nothing."""
    from vlmctl.models.load import load_model

    vlm, processor, fam = load_model(plan.base_ref, trust_remote_code=plan.trust_remote_code, family=plan.family.name)
    size = (plan.image_size or _default_image_size(fam, processor)) if _takes_images(fam) else None
    local = Path(plan.base_ref).expanduser()
    return {
        "version": INFO_VERSION,
        "family": fam.name,
        "mode": "base",
        "init": "pretrained",
        "built_from": {"base": str(local.resolve()) if local.exists() else plan.base_ref},
        "source": str(local.resolve()) if local.exists() else plan.base_ref,
        "model_class": type(vlm).__name__,
        "dtype": str(next(vlm.parameters()).dtype).removeprefix("torch."),
        "parameters": count_parameters(vlm, fam),
        "image_size": size,
        "visual_tokens_per_image": fam.num_visual_tokens(size, size, processor) if size else None,
        **_audio_info(fam, processor),
        "trust_remote_code": plan.trust_remote_code,
        "vlmctl_version": _version(),
    }
