"""Loading built or existing VLMs: `load_model`, `load_processor`, `read_build_info`, and the error translation
shared with `model build` (`load_or_explain`: Hub / offline / missing-folder failures -> ModelError with a hint).

    model, processor, family = load_model("outputs/model")   # family: the registered FamilySpec
    vision = model.get_submodule(family.vision_tower)

`load_model` accepts a folder written by `model build` (including a base-mode folder, which only points at the
checkpoint it describes), any local Hugging Face VLM folder of a registered family, or a Hub id. `load_processor`
reads no weights. Both run inside `quiet_transformers()`: no third-party progress bars or load reports.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmctl.errors import ModelError
from vlmctl.families import FamilySpec, detect_family, get_family
from vlmctl.models.quiet import quiet_transformers  # noqa: F401 - its callers import it from here

# accelerate, torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's
# start-up) must not pay for them.
# So are the vlmctl modules that load numpy when imported.

INFO_FILE = "vlmctl_model.json"
"""What `model build` writes next to the checkpoint: {family, mode, built_from, parameters, ...}."""
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def transformers_class(name: str):
    """`transformers.<name>` (imported on first use)."""
    import transformers

    return getattr(transformers, name)


def silence_transformers() -> None:
    """Only errors from transformers' logger from now on (its load reports repeat what vlmctl prints).
    Prefer `quiet_transformers()`, which restores the previous state."""
    import transformers

    transformers.logging.set_verbosity_error()


def image_processor_class(name: str):
    """`transformers.<name>`, or its PIL variant `<name>Pil` when torchvision is not installed: the class
    transformers itself falls back to there, picked without its fallback warning."""

    import transformers

    if importlib.util.find_spec("torchvision") is None and name.endswith("ImageProcessor"):
        try:
            return getattr(transformers, f"{name}Pil")
        except (AttributeError, ImportError):
            pass
    return getattr(transformers, name)


def load_or_explain(what: str, ref: str, fn: Callable[[], Any]) -> Any:
    """Run a from_pretrained call `fn` loading `what` from `ref`; turn Hub/offline/missing-folder failures into a
    ModelError with a hint. A local folder's files are checked first, and again after a failure, so that the
    error names the damaged file (`vlmctl.models.integrity`: invalid JSON, a chat template that does not compile,
    a truncated or missing safetensors shard, a tokenizer that does not load, weights of another shape than
    config.json gives) rather than transformers' words for it."""
    from vlmctl.models.integrity import check_model_files, diagnose_load_failure

    local = Path(ref).expanduser().is_dir()
    if local:
        check_model_files(ref)
    try:
        return fn()
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError/ValueError/hub errors for the same causes
        found = diagnose_load_failure(ref, exc) if local else None
        raise (found or _load_error(what, ref, exc)) from exc


def _load_error(what: str, ref: str, exc: Exception) -> ModelError:
    looks_local = ref.startswith((".", "/", "~")) or os.sep in ref and Path(ref).exists()
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false") or "offline" in str(exc).lower() or \
        "connect" in str(exc).lower() or "resolve" in str(exc).lower()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if looks_local and not Path(ref).expanduser().exists():
        return ModelError(f"cannot load {what} {ref!r}: the folder does not exist", hint="check the path in vlmctl.yaml (relative paths are relative to the project file)")
    if looks_local:
        return ModelError(f"cannot load {what} from {ref}: {first}", hint="the folder must hold a Hugging Face checkpoint (config.json, weights, tokenizer files)")
    if offline:
        return ModelError(
            f"cannot load {what} {ref!r}: the Hugging Face Hub is unreachable (offline) and it is not in the local cache",
            hint=f"set the key to a local folder, or pre-download it where there is internet (`hf download {ref}`) and "
            "copy the cache (HF_HOME) here; with init: random, use a preset name instead",
        )
    return ModelError(f"cannot load {what} {ref!r}: {first}", hint="check the id on huggingface.co (gated repos need `hf auth login`)")


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
    `AutoProcessor`; the image-only variant of the same class is returned instead (`FamilySpec.make_processor`).
    """
    ref, _ = _resolve(path)
    with quiet_transformers():
        return load_or_explain("processor", ref, lambda: _auto_processor(ref, trust_remote_code))


def _auto_processor(ref: str, trust_remote_code: bool):

    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(ref, trust_remote_code=trust_remote_code)
    except (OSError, ImportError, AttributeError, ValueError):
        if importlib.util.find_spec("torchvision") is not None:
            raise
        from transformers import AutoConfig

        fam = get_family(detect_family(AutoConfig.from_pretrained(ref, trust_remote_code=trust_remote_code)))
        return fam.image_only_processor(ref, trust_remote_code=trust_remote_code)  # keeps the saved processor settings


def load_model(
    path_or_id: str | Path,
    *,
    dtype: Any = None,
    device: Any = None,
    trust_remote_code: bool = False,
    family: str | None = None,
) -> tuple[Any, Any, FamilySpec]:
    """Load a VLM and its processor; return `(model, processor, family)`.

    `dtype`: a torch dtype or "bf16"/"fp16"/"fp32" (default: as saved); `device`: where to put the model (default:
    CPU). The family comes from `family`, else `vlmctl_model.json`, else the config's `model_type`; the model class
    is the family's (`family.model_class`). Never runs remote code unless `trust_remote_code`.

    Raises ModelError for unknown ids (with an offline hint), folders that are not checkpoints, and model types of
    no registered family.
    """
    ref, cfg, fam, dtype = _model_plan(path_or_id, dtype, trust_remote_code, family)
    cls = transformers_class(fam.model_class)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    kwargs["dtype"] = dtype if dtype is not None else "auto"
    with quiet_transformers():
        model = load_or_explain("model weights", ref, lambda: cls.from_pretrained(ref, **kwargs))
    if device is not None:
        model = model.to(device)
    processor = load_processor(ref, trust_remote_code=trust_remote_code)
    return model, processor, fam


def _model_plan(path_or_id: str | Path, dtype: Any, trust_remote_code: bool, family: str | None):
    """(reference to load, its config, FamilySpec, torch dtype or None) of a built folder, a local VLM folder or a
    Hub id; raises ModelError for unknown ids and model types of another family."""
    ref, info = _resolve(path_or_id)
    cfg = load_or_explain("model", ref, lambda: transformers_class("AutoConfig").from_pretrained(ref, trust_remote_code=trust_remote_code))
    fam = get_family(family or (info or {}).get("family") or detect_family(cfg))
    if cfg.model_type not in fam.model_types:
        raise ModelError(f"{ref} is a {cfg.model_type!r} model, not of family {fam.name}",
                         hint="remove model.family, or point at a checkpoint of that family")
    if isinstance(dtype, str):
        import torch

        dtype = getattr(torch, DTYPES.get(dtype, dtype))
    return ref, cfg, fam, dtype


def build_empty_model(
    path_or_id: str | Path,
    *,
    dtype: Any = None,
    trust_remote_code: bool = False,
    family: str | None = None,
) -> tuple[Any, Any, FamilySpec]:
    """The model `load_model` would load, built without its weights; return `(model, processor, family)`.

    Parameters are on the meta device (no storage: shapes and dtypes only) while buffers are computed on CPU as
    the model's constructor computes them (rotary `inv_freq`, position ids: non-persistent buffers that no
    checkpoint holds), through accelerate's `init_empty_weights(include_buffers=False)`. Tied weights are tied
    again afterwards (re-registering a parameter under that context makes a new meta parameter). The generation
    config is read from the checkpoint when it has one, and the model is in eval mode, as `from_pretrained` leaves
    it. No weight file is read. Same arguments and errors as `load_model`.
    """
    from accelerate import init_empty_weights

    ref, cfg, fam, dtype = _model_plan(path_or_id, dtype, trust_remote_code, family)
    cls = transformers_class(fam.model_class)
    with quiet_transformers():
        with init_empty_weights(include_buffers=False):
            model = cls._from_config(cfg, **({"dtype": dtype} if dtype is not None else {}))
        model.tie_weights()
        model.eval()
        try:
            generation = transformers_class("GenerationConfig").from_pretrained(ref)
        except (OSError, TypeError, ValueError):  # none in the checkpoint: the one derived from the config stays
            generation = None
    if generation is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config = generation
    return model, load_processor(ref, trust_remote_code=trust_remote_code), fam
