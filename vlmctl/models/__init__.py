"""Models: the family table, `model build`, and loading built or existing VLMs.

    from vlmctl.models import load_model, build_model, get_family
    model, processor, family = load_model("outputs/model")
    vision = model.get_submodule(family.vision_tower)

`load_model` accepts a folder written by `model build` (including a base-mode folder, which only points at the
checkpoint it describes), any local Hugging Face VLM folder of a supported family, or a Hub id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmctl.errors import ModelError
from vlmctl.models.build import INFO_FILE, BuildResult, build_model, list_presets, load_preset, plan_build
from vlmctl.families import (
    FAMILIES,
    PARTS,
    Family,
    count_parameters,
    decoder_layer_classes,
    decoder_layers,
    detect_family,
    get_family,
    part_of_parameter,
    parts,
    vision_layer_classes,
    vision_layers,
)

__all__ = [
    "FAMILIES", "PARTS", "Family", "get_family", "detect_family", "count_parameters", "part_of_parameter", "parts",
    "decoder_layer_classes", "vision_layer_classes", "decoder_layers", "vision_layers", "load_model",
    "load_processor", "build_model", "BuildResult", "plan_build", "list_presets", "load_preset", "read_build_info",
]


def read_build_info(path: str | Path) -> dict[str, Any] | None:
    """The `vlmctl_model.json` of a built folder, or None when `path` is not one."""
    f = Path(path).expanduser() / INFO_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{f} is not valid JSON: {exc}", hint="rebuild the model with `vlmctl model build --force`") from exc


def _resolve(path_or_id: str | Path) -> tuple[str, dict[str, Any] | None]:
    """(checkpoint path or id to load, build info). A base-mode build points at its source."""
    ref = str(path_or_id)
    info = read_build_info(ref) if Path(ref).expanduser().is_dir() else None
    if info is not None and info.get("mode") == "base" and not (Path(ref).expanduser() / "config.json").is_file():
        return str(info["source"]), info
    return str(Path(ref).expanduser()) if Path(ref).expanduser().exists() else ref, info


def load_processor(path: str | Path, *, trust_remote_code: bool = False):
    """`AutoProcessor` of a built folder, a local VLM folder or a Hub id. Raises ModelError with a hint.

    Without torchvision (CPU installs), processors that own a video processor (Qwen families) cannot be built by
    `AutoProcessor`; the image-only variant of the same class is returned instead (see `build.family_processor`).
    """
    from vlmctl.models.build import _load

    ref, _ = _resolve(path)
    return _load("processor", ref, lambda: _auto_processor(ref, trust_remote_code))


def _auto_processor(ref: str, trust_remote_code: bool):
    import importlib.util

    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(ref, trust_remote_code=trust_remote_code)
    except (OSError, ImportError, AttributeError, ValueError):
        if importlib.util.find_spec("torchvision") is not None:
            raise
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        from vlmctl.models.build import family_processor

        fam = get_family(detect_family(AutoConfig.from_pretrained(ref, trust_remote_code=trust_remote_code)))
        tok = AutoTokenizer.from_pretrained(ref, trust_remote_code=trust_remote_code)
        improc = AutoImageProcessor.from_pretrained(ref, trust_remote_code=trust_remote_code)
        return family_processor(fam, tok, improc, tok.chat_template)


def load_model(
    path_or_id: str | Path,
    *,
    dtype: Any = None,
    device: Any = None,
    trust_remote_code: bool = False,
    family: str | None = None,
) -> tuple[Any, Any, Family]:
    """Load a VLM and its processor; return `(model, processor, family)`.

    `dtype`: a torch dtype or "bf16"/"fp16"/"fp32" (default: as saved); `device`: where to put the model (default:
    CPU). The family comes from `family`, else `vlmctl_model.json`, else the config's `model_type`; the model class
    is the family's (`family.model_class`). Never runs remote code unless `trust_remote_code`.

    Raises ModelError for unknown ids (with an offline hint), folders that are not checkpoints, and model types
    outside the family table.
    """
    from vlmctl.models.build import DTYPES, _auto, _load, _silence_transformers

    ref, info = _resolve(path_or_id)
    cfg = _load("model", ref, lambda: _auto("AutoConfig").from_pretrained(ref, trust_remote_code=trust_remote_code))
    name = family or (info or {}).get("family") or detect_family(cfg)
    fam = get_family(name)
    if cfg.model_type not in fam.model_types:
        raise ModelError(f"{ref} is a {cfg.model_type!r} model, not of family {fam.name}",
                         hint="remove model.family, or point at a checkpoint of that family")
    if isinstance(dtype, str):
        import torch

        dtype = getattr(torch, DTYPES.get(dtype, dtype))
    _silence_transformers()
    import transformers

    cls = getattr(transformers, fam.model_class)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    kwargs["dtype"] = dtype if dtype is not None else "auto"
    model = _load("model weights", ref, lambda: cls.from_pretrained(ref, **kwargs))
    if device is not None:
        model = model.to(device)
    processor = load_processor(ref, trust_remote_code=trust_remote_code)
    return model, processor, fam
