"""The family registry: family name -> `FamilySpec`, filled by the family modules as they are imported.

    from vlmctl.families import get_family, detect_family, compose_family
    spec = get_family("qwen2_5_vl")            # by name (also "qwen2.5-vl" or a config model_type)
    spec = get_family(detect_family(config))   # by a checkpoint's config
    spec = compose_family()                    # the family `model.vision` + `model.llm` builds into

Importing `vlmctl.families` imports every built-in family module, listed in one place (the import line of
`vlmctl/families/__init__.py`, in the order of `FAMILIES`), each of which calls `register(spec)` once. The module
paths of each family are documented in its module; `family_table()` lists them (`vlmctl model build --list` prints
it).
"""

from __future__ import annotations

from typing import Any

from vlmctl.errors import ModelError
from vlmctl.families.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {}
"""Registered families by name, in registration order."""


def register(spec: FamilySpec) -> FamilySpec:
    """Add `spec` to the registry and return it. Raises ModelError when its name or a model type is taken."""
    if spec.name in FAMILIES:
        raise ModelError(f"model family {spec.name!r} is registered twice", hint="give the new family another name")
    for other in FAMILIES.values():
        taken = set(spec.model_types) & set(other.model_types)
        if taken:
            raise ModelError(f"model type {sorted(taken)[0]!r} belongs to families {other.name} and {spec.name}",
                             hint="a config model_type must select one family")
    FAMILIES[spec.name] = spec
    return spec


def get_family(name: str) -> FamilySpec:
    """The spec of family `name` (e.g. "qwen2_5_vl", "qwen2.5-vl", or a config model_type).

    Raises ModelError listing the known families.
    """
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


def compose_audio_family() -> FamilySpec:
    """The first registered family that composes an audio encoder and an LLM (`compose_audio`). Raises ModelError
    when none is registered."""
    for fam in FAMILIES.values():
        if fam.compose_audio:
            return fam
    raise ModelError("no registered model family composes an audio encoder and an LLM", hint="use model.preset or model.base")


def compose_family(projector: str | None = None, family: str | None = None) -> FamilySpec:
    """The family that joins any vision encoder and any causal LM (`model.vision` + `model.llm`): the first
    registered spec with `compose=True`, or, given `projector` (a `model.projector` value), the first whose
    `compose_projectors` holds it; `family` (`model.family`) picks one by name instead (e.g. llava_onevision for
    video). Raises ModelError when none is registered, or `family` does not compose (with `projector`)."""
    if family is not None:
        fam = get_family(family)
        composing = [f.name for f in FAMILIES.values() if f.compose]
        if not fam.compose:
            raise ModelError(f"model.family={family} does not compose a vision encoder and an LLM",
                             hint=f"for model.vision + model.llm use one of {', '.join(composing)}, or unset model.family")
        if projector is not None and projector not in fam.compose_projectors:
            raise ModelError(f"model.family={family} holds no model.projector={projector}",
                             hint=f"use model.projector {' or '.join(fam.compose_projectors)} with this family")
        return fam
    for fam in FAMILIES.values():
        if fam.compose and (projector is None or projector in fam.compose_projectors):
            return fam
    known = [p for fam in FAMILIES.values() if fam.compose for p in fam.compose_projectors]
    raise ModelError(f"no registered model family composes a vision encoder and an LLM{f' with projector {projector!r}' if projector else ''}",
                     hint=f"model.projector: one of {', '.join(known)}" if known and projector else "use model.preset or model.base")


def family_table() -> list[dict[str, Any]]:
    """One row per registered family, for listings (`vlmctl model build --list`): name, model class, model types,
    modalities (modality -> placeholder token), vision tower / projector / language model paths, layer classes,
    liger patch, lmms-eval model, tiny preset, whether it composes, mRoPE, whether every image has the same number of
    visual tokens, whether it packs, notes. JSON-serializable."""
    return [
        {
            "name": fam.name,
            "model_class": fam.model_class,
            "model_types": list(fam.model_types),
            "modalities": dict(fam.modalities),
            "vision_tower": fam.vision_tower,
            "encoders": {k: {"path": e.path, "part": e.part, "modalities": list(e.modalities)} for k, e in fam.encoders.items()},
            "projector": list(fam.projector),
            "language_model": fam.language_model,
            "decoder_layer_classes": list(fam.decoder_layer_classes),
            "vision_layer_classes": list(fam.vision_layer_classes),
            "liger_patch": fam.liger_patch,
            "lmms_model": fam.lmms_model,
            "tiny_preset": fam.tiny_preset,
            "compose": fam.compose,
            "mrope": fam.mrope,
            "fixed_image_tokens": fam.fixed_image_tokens,
            "supports_packing": fam.supports_packing,
            "notes": fam.notes,
        }
        for fam in FAMILIES.values()
    ]
