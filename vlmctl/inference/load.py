"""Load a model folder for generation: folder checks, compute dtype, device, processor; and the backend check.

    model, processor = load_for_generation("outputs/runs/run1/final", device="cuda:0", dtype="auto")

A folder is usable for generation when it is a Hugging Face model folder (config.json) with a processor and a
tokenizer (the prompt is rendered by the processor's chat template, images are read by its image processor, audio
clips by its feature extractor). A
base-mode `vlmctl model build` folder only points at a checkpoint; that checkpoint is checked and loaded.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from vlmctl.errors import MissingModelError, ModelError, UsageError

# huggingface_hub, torch and yaml are imported inside the functions that use them: importing vlmctl (the CLI's
# start-up) must not pay for them.
# So are the vlmctl modules that load numpy when imported.
# vllm (an optional dependency) is imported only where used, so the rest works without it.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

BACKENDS = ("hf", "vllm")
"""Generation backends: `hf` (transformers' `model.generate`, any device) and `vllm` (vLLM's offline engine)."""

DTYPES = ("auto", "bf16", "fp16", "fp32")
"""Compute dtypes accepted by `resolve_dtype` and `load_for_generation`."""

# Files a folder needs besides the weights to be usable for generation.
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

_VLLM_MISSING = ("--backend vllm needs the vllm package, which is not installed", "pip install vllm (GPU machines), or use --backend hf")


def check_backend(backend: str) -> None:
    """Raise UsageError unless `backend` is one of `BACKENDS` and can run here (vllm installed for `vllm`)."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}", hint=f"choose {' or '.join(BACKENDS)}")
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError(_VLLM_MISSING[0], hint=_VLLM_MISSING[1])


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _hub_id_of(path: Path) -> str | None:
    """`ORG/NAME` when the missing `path`, written relative to the current folder, reads as a Hugging Face Hub id
    (two plain parts); else None."""
    try:
        text = str(path.relative_to(Path.cwd())) if path.is_absolute() else str(path)
    except ValueError:
        return None
    return text if _HUB_ID.fullmatch(text) else None


def _hub_id_error(hub_id: str) -> MissingModelError:
    """The error for a Hub id given where a model folder is expected: it says so, whether the id is in the local
    Hugging Face cache (`huggingface_hub.try_to_load_from_cache`, no network), and how to get a folder of it."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, "config.json")
    name = hub_id.split("/")[-1]
    if isinstance(cached, str):
        folder = Path(cached).parent
        return MissingModelError(f"{hub_id} is a Hugging Face Hub id, not a folder here; it is in the local Hugging Face "
                                 f"cache at {folder}", hint=f"pass that folder: {folder}")
    return MissingModelError(f"{hub_id} is a Hugging Face Hub id, not a folder here, and it is not in the local Hugging "
                             "Face cache", hint=f"download it first: `hf download {hub_id} --local-dir models/{name}`, "
                             f"then pass models/{name}")


def check_model_dir(path: Path) -> None:
    """Raise ModelError unless `path` is a Hugging Face model folder (config.json) with a processor and tokenizer;
    a base-mode `model build` folder is checked through the local checkpoint it points at (a Hub id it points at
    is not checked). The error names the folder and says how to fix it."""
    path = Path(path)
    if not path.is_dir():
        hub_id = _hub_id_of(path)
        if hub_id is not None:
            raise _hub_id_error(hub_id)
        raise MissingModelError(f"no model folder at {path}", hint="train or build one first (`vlmctl train`, `vlmctl model build`), or pass MODEL")
    info = _build_info(path)
    if info.get("mode") == "base" and not (path / "config.json").is_file():
        # `model build` in base mode only records which checkpoint it describes; check that one when it is local.
        source = Path(str(info.get("source", ""))).expanduser()
        if source.is_dir():
            check_model_dir(source)
        return
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: it is not a Hugging Face model folder",
                         hint="pass a final export (RUN/final), or convert a checkpoint with `vlmctl convert`")
    if not any((path / f).is_file() for f in _PROCESSOR_FILES) or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelError(
            f"{path} has no processor (needs {' or '.join(_PROCESSOR_FILES)} and a tokenizer): cannot build prompts or read images",
            hint=f"save the base model's processor into it: AutoProcessor.from_pretrained(BASE).save_pretrained('{path}'), "
                 "or re-export it with `vlmctl convert`",
        )


def folder_family(path: Path):
    """The `FamilySpec` of the model in a folder, without loading it: the `family` a `vlmctl model build` folder
    records, else the one of config.json's model_type. None when neither says (a base-mode folder pointing at a Hub
    id, a model type of no registered family: loading it tells what is wrong). Used to refuse a modality the model
    does not take before it is loaded."""
    import json

    from vlmctl.errors import ModelError
    from vlmctl.families import detect_family, get_family

    path = Path(path)
    info = _build_info(path)
    try:
        if info.get("family"):
            return get_family(str(info["family"]))
        config = path / "config.json"
        if not config.is_file() and info.get("mode") == "base":
            config = Path(str(info.get("source", ""))).expanduser() / "config.json"
        return get_family(detect_family(json.loads(config.read_text()))) if config.is_file() else None
    except (ModelError, OSError, ValueError):
        return None


def video_settings(path: Path, data: Any = None):
    """The `data.video` settings (`DataVideo`) that videos given to the model in folder `path` are sampled by: those
    of `data` (the project's `data` section) when given, else those of the training run the folder belongs to
    (the run's `config.yaml` next to `RUN/final` or above `RUN/checkpoints/NAME`), else the defaults. A run config
    whose `data.video` does not validate is not used (the defaults are)."""
    from vlmctl.config.data import DataVideo

    if data is not None:
        return data.video
    path = Path(path).resolve()
    for run in (path.parent, path.parent.parent):
        config = run / "config.yaml"
        if config.is_file() and ((run / "final").is_dir() or (run / "checkpoints").is_dir()):
            import yaml

            try:
                section = ((yaml.safe_load(config.read_text()) or {}).get("data") or {}).get("video") or {}
                return DataVideo(**section)
            except (OSError, ValueError, AttributeError, TypeError, yaml.YAMLError):
                break  # a damaged run config: the defaults, as without one
    return DataVideo()


def _build_info(path: Path) -> dict[str, Any]:
    from vlmctl.models import read_build_info

    return read_build_info(path) or {}


def resolve_dtype(dtype: str, device: str):
    """The torch dtype for `dtype` (one of `DTYPES`) on `device`: `auto` is bf16 on GPUs that support it, else fp32
    (CPU kernels are fastest and exact in fp32). Raises UsageError for another name."""
    import torch

    from vlmctl.config.plan import DeviceFacts, resolve_precision  # the run plan's one precision rule

    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", hint=f"choose one of: {', '.join(DTYPES)}")
    cuda = device.startswith("cuda")
    name = resolve_precision(dtype, DeviceFacts(kind="cuda" if cuda else "cpu", bf16=cuda and torch.cuda.is_bf16_supported()))
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def resolve_device(device: str) -> str:
    """The torch device name for `device`: `auto` is `cuda` when a GPU is visible, else `cpu`; other names
    (`cpu`, `cuda`, `cuda:1`, `mps`) are checked and returned. Raises UsageError for a name torch does not know
    or a CUDA device that is not there."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"unknown device {device!r}", hint="e.g. --device cpu, --device cuda, --device cuda:1, or auto") from exc
    if parsed.type == "cuda" and (not torch.cuda.is_available() or (parsed.index or 0) >= torch.cuda.device_count()):
        raise UsageError(f"device {device!r} is not available here ({torch.cuda.device_count()} CUDA device(s) visible)",
                         hint="use --device cpu, or --device auto to pick a GPU when there is one")
    return device


def load_for_generation(path: Path, *, device: str = "cpu", dtype: str = "auto") -> tuple[Any, Any]:
    """(model, processor) from a model folder, in eval mode on `device` (see `resolve_device`; `auto` picks a GPU
    when there is one) in the compute dtype of `resolve_dtype`.

    The model is loaded through `vlmctl.models.load_model` (the family's model class; no remote code). Raises
    ModelError for a folder that fails `check_model_dir` or holds a model of an unsupported family, UsageError for
    an unknown `dtype` or an unknown or absent `device`.
    """
    check_model_dir(path)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    from vlmctl.models import load_model

    model, processor, _family = load_model(str(path), dtype=torch_dtype, device=device)
    model.eval()
    return model, processor


def load_vllm(path: Path, *, dtype: str = "auto") -> tuple[Any, Any]:
    """(vllm.LLM engine, processor) for a model folder; vLLM loads the weights and picks the devices itself, the
    processor only renders prompts (its chat template). `dtype` as in `DTYPES` (`auto` leaves vLLM's choice).

    Raises UsageError when vllm is not installed, ModelError for a folder that fails `check_model_dir`.
    """
    try:
        from vllm import LLM
    except ImportError as exc:
        raise UsageError(_VLLM_MISSING[0], hint=_VLLM_MISSING[1]) from exc
    check_model_dir(path)
    from vlmctl.models import load_processor

    names = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    if dtype not in names:
        raise UsageError(f"unknown dtype {dtype!r}", hint=f"choose one of: {', '.join(DTYPES)}")
    return LLM(model=str(path), dtype=names[dtype]), load_processor(path)


__all__ = [
    "BACKENDS", "DTYPES", "check_backend", "check_model_dir", "folder_family", "resolve_device", "resolve_dtype",
    "load_for_generation", "load_vllm", "video_settings",
]
