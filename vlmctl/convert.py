"""Any training checkpoint -> a complete Hugging Face model folder whose logits match the training model.

Sources (`detect_source` tells them apart):
- `hf`: a transformers model folder (`config.json` + safetensors); re-sharded and/or cast to another dtype.
- `lora`: a peft adapter folder (`adapter_config.json`); merged into its base, or exported as an adapter.
- `dcp`: a torch Distributed Checkpoint (FSDP2 runs), saved as `dcp.save({"model": model_state_dict, ...})`, so
  model keys are `model.<key of the unwrapped HF (or peft) model's state_dict>`. Read in one process without a
  process group; only the `model.` entries are loaded.
- `deepspeed`: a DeepSpeed ZeRO-2/3 `save_checkpoint` folder (`latest` + `global_step*/`), consolidated with
  DeepSpeed's own `deepspeed.utils.zero_to_fp32`.
- a vlmctl run folder (`config.yaml` + `checkpoints/` / `final/`): its `final/` export, else its latest complete
  checkpoint.
- `megatron`: a Megatron-LM / Megatron-Bridge checkpoint (`torch_dist` or legacy `mp_rank_*`, any tensor / pipeline
  split; `vlmctl.convert_megatron`), its config and processor from `--base` (or the `hf/` folder of a vlmctl export).

Targets (`to`): `hf` (below), or `megatron`: a torch_dist save directory for Megatron-LM / Megatron-Bridge
(`vlmctl.convert_megatron.write_megatron`), verified by reading it back and comparing the probe's logits.

Training checkpoints live in `<run>/checkpoints/checkpoint-<step>/` next to `trainer_state.json`
(`{step, epoch, lora, model_path, family, world_size, strategy}`); the model the run trained (its config,
processor and, for LoRA, the frozen base) is taken from `trainer_state.json` or the run's `config.yaml`.

Output: `save_pretrained` safetensors shards + index, config, generation config, the processor (image processor,
tokenizer, chat template) and `vlmctl_export.json` (provenance), written into a temporary folder that is renamed
into place only after `verify` passed. Checkpoint files are read through `vlmctl.checkpoints`: nothing is unpickled
except through restricted loaders (safetensors, `torch.load(weights_only=True)`, an allow-listed unpickler for DCP's
`.metadata`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from vlmctl.checkpoints import read_json
from vlmctl.errors import MissingModelError, ModelError, UsageError
from vlmctl.outputs import check_inputs_outside, check_replaceable, install, local_paths

if TYPE_CHECKING:
    import torch

# numpy, peft, PIL, torch, transformers and yaml are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for them.
# So are the vlmctl modules that load numpy when imported.
# deepspeed (an optional dependency) is imported only where used, so the rest works without it.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

SourceKind = Literal["hf", "lora", "dcp", "deepspeed", "megatron"]
TARGETS = ("hf", "megatron")
DTYPE_NAMES = ("bf16", "fp16", "fp32")
# Max |logit difference| allowed by `verify`, relative to max(1, max |reference logit|), by the coarser of the two
# compute dtypes compared (the source model's and the output's): fp32 only reorders float operations (a LoRA merge
# included); half precisions round every weight (8 / 11 mantissa bits) and every activation.
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 6e-2}
EXPORT_INFO = "vlmctl_export.json"
MODEL_INFO = "vlmctl_model.json"
PROBE_TEXT = "What is in the image? Describe the colors and shapes."
_STATE_MODEL_KEYS = ("model_path", "model_source", "source_model", "model", "base_model", "model_dir")
Progress = Callable[[str], None]


@dataclass
class Source:
    """A detected conversion source."""

    kind: SourceKind
    path: Path  # the folder that holds the weights (for a run: the chosen checkpoint or final/)
    run_dir: Path | None = None
    model_path: str | None = None  # the HF model the run trained: config, processor, LoRA base
    lora: dict[str, Any] | None = None  # peft config dict of a LoRA checkpoint
    step: int | None = None
    state: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.kind == "megatron":
            return self.state["megatron"].describe()
        what = {"hf": "Hugging Face model folder", "lora": "peft LoRA adapter", "dcp": "torch DCP checkpoint (FSDP2)", "deepspeed": "DeepSpeed ZeRO checkpoint"}[self.kind]
        extra = f", step {self.step}" if self.step is not None else ""
        extra += ", LoRA" if self.lora and self.kind in ("dcp", "deepspeed") else ""
        return f"{what} at {self.path}{extra}"


@dataclass
class VerifyResult:
    max_abs_diff: float
    tolerance: float
    ref_max_abs: float
    num_logits: int
    passed: bool


@dataclass
class ConvertResult:
    source: str
    kind: str
    out: str
    dtype: str
    files: list[tuple[str, int]]  # (relative path, bytes)
    adapter_only: bool
    merged_lora: bool
    verify: VerifyResult | None
    notes: list[str] = field(default_factory=list)  # what the conversion changed or could not carry over

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------------------------
# Detection


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    except ValueError as exc:
        raise ModelError(f"{path} is not valid JSON ({exc}); the checkpoint may be truncated", hint="convert an earlier, complete checkpoint") from exc
    return data if isinstance(data, dict) else {}


def _has_hf_weights(folder: Path) -> bool:
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    return (folder / "config.json").is_file() and any((folder / n).is_file() for n in names)


def _dcp_dir(folder: Path) -> Path | None:
    for cand in (folder, *sorted(p for p in folder.iterdir() if p.is_dir())):
        if (cand / ".metadata").is_file():
            return cand
    return None


def _is_deepspeed(folder: Path) -> bool:
    return (folder / "latest").is_file() or any(folder.glob("global_step*/*model_states.pt")) or any(folder.glob("*model_states.pt"))


def _step_of(path: Path) -> int | None:
    m = re.fullmatch(r"(?:checkpoint-|global_step)(\d+)", path.name)
    return int(m.group(1)) if m else None


def _complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run, oldest first, that have their trainer state and weights (temp names never match)."""
    found = []
    for p in (run_dir / "checkpoints").glob("checkpoint-*"):
        step = _step_of(p)
        if step is None or not p.is_dir() or not (p / "trainer_state.json").is_file():
            continue
        if _dcp_dir(p) is not None or _is_deepspeed(p):
            found.append((step, p))
    return [p for _, p in sorted(found)]


def _run_config(run_dir: Path | None) -> dict[str, Any]:
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())
    except yaml.YAMLError as exc:
        raise ModelError(f"{run_dir / 'config.yaml'} is not valid YAML: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _trained_model_path(state: dict[str, Any], run_dir: Path | None) -> str | None:
    """The HF model folder (or Hub id) the run trained, from trainer_state.json, else the run's config.yaml."""
    for key in _STATE_MODEL_KEYS:
        value = state.get(key)
        if isinstance(value, str) and value:
            return value
    model = _run_config(run_dir).get("model") or {}
    out_dir = model.get("output_dir")
    if out_dir and _has_hf_weights(Path(out_dir)):
        return str(out_dir)
    return model.get("base") or out_dir


def _find_run_dir(path: Path) -> Path | None:
    for cand in (path, *list(path.parents)[:3]):
        if (cand / "config.yaml").is_file() and ((cand / "checkpoints").is_dir() or (cand / "final").is_dir()):
            return cand
    return None


def detect_source(src: Path | str, *, base: str | None = None) -> Source:
    """Tell what `src` is. Raises UsageError when it is none of the supported kinds (saying what was found)."""
    src = Path(src).expanduser()
    if not src.exists():
        raise MissingModelError(f"no model folder at {src}", hint="pass a run folder, a checkpoint folder, a LoRA adapter folder or an HF model folder")
    if src.is_file():
        raise UsageError(f"{src} is a file; convert takes a folder", hint="pass the folder that holds the checkpoint")
    run_dir = _find_run_dir(src)

    if run_dir is not None and src.resolve() == run_dir.resolve():
        final = src / "final"
        if final.is_dir() and (_has_hf_weights(final) or (final / "adapter_config.json").is_file()):
            return detect_source(final, base=base)
        ckpts = _complete_checkpoints(src)
        if not ckpts:
            raise UsageError(
                f"run folder {src} has no final/ export and no complete checkpoint under checkpoints/",
                hint="train for at least train.save_steps steps, or pass a checkpoint folder",
            )
        return detect_source(ckpts[-1], base=base)

    if (src / "adapter_config.json").is_file():
        adapter = _read_json(src / "adapter_config.json")
        model_path = base or adapter.get("base_model_name_or_path")
        if run_dir is not None and not base:
            state = read_json(src / "trainer_state.json") if (src / "trainer_state.json").is_file() else {}
            model_path = _trained_model_path(state, run_dir) or model_path
        if not model_path:
            raise UsageError(f"LoRA adapter {src} does not name its base model", hint="pass --base PATH_OR_HUB_ID")
        return Source("lora", src, run_dir=run_dir, model_path=str(model_path))
    if _has_hf_weights(src):
        return Source("hf", src, run_dir=run_dir, model_path=str(src))

    from vlmctl.convert_megatron.checkpoint import is_megatron

    if is_megatron(src):
        from vlmctl.convert_megatron import find_source

        found = find_source(src, base)
        return Source("megatron", found.iteration, model_path=found.hf_ref, state={"megatron": found})
    state = read_json(src / "trainer_state.json") if (src / "trainer_state.json").is_file() else {}
    dcp = _dcp_dir(src)
    kind: SourceKind | None = "dcp" if dcp is not None else ("deepspeed" if _is_deepspeed(src) else None)
    if kind is None:
        listing = ", ".join(sorted(p.name for p in src.iterdir())[:8]) or "nothing"
        raise UsageError(
            f"{src} is not a checkpoint vlmctl can convert (found: {listing})",
            hint="expected a run folder, a torch DCP checkpoint (.metadata), a DeepSpeed checkpoint (latest, global_step*/), "
            "a peft adapter (adapter_config.json) or an HF model folder (config.json + *.safetensors)",
        )
    model_path = base or _trained_model_path(state, run_dir)
    if not model_path:
        raise UsageError(
            f"cannot tell which model the checkpoint {src} belongs to (no trainer_state.json model path, no run config.yaml)",
            hint="pass --base with the HF model folder the run trained",
        )
    lora = state.get("lora") if isinstance(state.get("lora"), dict) else None
    step = state.get("step") if isinstance(state.get("step"), int) else _step_of(src)
    return Source(kind, dcp if kind == "dcp" else src, run_dir=run_dir, model_path=str(model_path), lora=lora, step=step, state=state)


# --------------------------------------------------------------------------------------------------------------------
# Reading weights


def read_dcp_model_state(path: Path, prefix: str = "model.") -> dict[str, "torch.Tensor"]:
    """Full (unsharded) tensors of the `prefix` entries of a torch DCP checkpoint, keys without the prefix.

    Runs in one process without a process group (`dcp.load(..., no_dist=True)`): FSDP2's DTensor shards are saved
    with their global shapes in the metadata, so plain tensors of those shapes are allocated and filled. Read through
    `vlmctl.checkpoints` (nothing unpickled but DCP's metadata classes and weights-only values). Raises
    CheckpointError (a ModelError) for unreadable or refused metadata and missing/truncated/refused data files.
    """
    from vlmctl.checkpoints import read_dcp_tensors

    return read_dcp_tensors(path, prefix)


def read_deepspeed_model_state(path: Path) -> dict[str, "torch.Tensor"]:
    """fp32 model state of a DeepSpeed ZeRO-2/3 checkpoint via `deepspeed.utils.zero_to_fp32`
    (`get_fp32_state_dict_from_zero_checkpoint`), loading every file with `weights_only=True`.

    `path` is the `save_checkpoint` folder (with `latest`) or one `global_step*` folder. Raises ModelError when
    DeepSpeed is not installed or partitions are missing/truncated.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # consolidation is CPU work; don't probe for GPUs
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise ModelError("converting a DeepSpeed checkpoint needs deepspeed", hint="pip install 'vlmctl[deepspeed]'") from exc
    tag = None
    if not (path / "latest").is_file():
        step_dirs = sorted(path.glob("global_step*"), key=lambda p: _step_of(p) or -1)
        if step_dirs:
            tag = step_dirs[-1].name
        elif any(path.glob("*model_states.pt")):
            path, tag = path.parent, path.name
    from vlmctl.checkpoints import CheckpointError, deepspeed_weights_only

    try:
        with deepspeed_weights_only(), open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - DeepSpeed raises ValueError/FileNotFoundError/RuntimeError/EOFError
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(f"cannot consolidate the DeepSpeed checkpoint {path}: {type(exc).__name__}: {msg}", hint="a ZeRO partition is missing or truncated; convert an earlier checkpoint") from exc
    return {k: v.contiguous() for k, v in state.items()}


# --------------------------------------------------------------------------------------------------------------------
# Building the source model


def _dtype(name: str) -> "torch.dtype":
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _dtype_name(dtype: "torch.dtype") -> str:
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "fp32")


def auto_model_class(path: str | Path):
    """transformers' auto class that loads the model folder `path`: `AutoModelForImageTextToText` for vision-language
    models, `AutoModelForMultimodalLM` for the others it maps (audio-language models such as Qwen2-Audio)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    try:
        model_type = transformers.AutoConfig.from_pretrained(str(path)).model_type
    except Exception:  # noqa: BLE001 - a folder that does not load: from_pretrained below says why
        model_type = None
    if model_type is None or model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForMultimodalLM


def _load_hf(path: str, dtype: "torch.dtype | str" = "auto"):
    from vlmctl.models.integrity import check_model_files, diagnose_load_failure

    check_model_files(path)  # a damaged file is named (vlmctl.models.integrity)
    try:
        model = auto_model_class(path).from_pretrained(path, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, SafetensorError (truncated shard), ...
        found = diagnose_load_failure(path, exc)
        if found is not None:
            raise found from exc
        raise ModelError(f"cannot load the model {path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", hint="the folder must be a complete image-text-to-text model (config.json + weights); a truncated shard needs re-export") from exc
    return model.eval()


def _load_processor(*paths: str | Path | None):
    from vlmctl.models.integrity import DamagedFileError
    from vlmctl.models.load import load_processor  # AutoProcessor, or its image-only variant without torchvision

    errors = []
    for p in paths:
        if p is None:
            continue
        try:
            return load_processor(p)
        except DamagedFileError:  # a damaged file: the message names it, another folder would hide it
            raise
        except (OSError, ValueError, TypeError, KeyError, ModelError) as exc:
            errors.append(f"{p}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    raise ModelError(
        "no processor (image processor + tokenizer) found for the output: " + "; ".join(errors),
        hint="pass --base with the model folder the run trained (it holds the processor files)",
    )


def _lora_config(lora: dict[str, Any]):
    from peft import LoraConfig

    fields = set(LoraConfig.__dataclass_fields__)
    kwargs = {k: v for k, v in lora.items() if k in fields and k not in ("peft_type", "base_model_name_or_path", "revision")}
    targets = kwargs.get("target_modules")
    if isinstance(targets, str) and targets.startswith("{"):  # a set written by json.dumps(default=str)
        import ast

        kwargs["target_modules"] = sorted(ast.literal_eval(targets))
    return LoraConfig(**kwargs)


def _load_state_into(model, state: dict[str, "torch.Tensor"], where: Path) -> None:
    """`load_state_dict` with checks: every checkpoint key is used, and every model key is loaded unless it shares
    storage with a loaded one (tied embeddings)."""
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ModelError(
            f"{len(result.unexpected_keys)} tensors of {where} do not belong to the model (e.g. {result.unexpected_keys[0]})",
            hint="pass --base with the model the run trained; LoRA checkpoints need their peft config in trainer_state.json",
        )
    sd = model.state_dict()
    loaded_ptrs = {t.data_ptr() for k, t in sd.items() if k in state}
    missing = [k for k in result.missing_keys if sd[k].data_ptr() not in loaded_ptrs]
    if missing:
        raise ModelError(f"{where} lacks {len(missing)} of the model's tensors (e.g. {missing[0]})", hint="the checkpoint is incomplete; convert an earlier one")


def load_source(source: Source, progress: Progress | None = None):
    """Instantiate the source model with its weights: (model or PeftModel in eval mode, processor).

    DCP/ZeRO checkpoints are loaded into the model the run trained (wrapped with peft when the checkpoint is LoRA).
    """
    import torch

    say = progress or (lambda _m: None)
    if source.kind == "megatron":
        from vlmctl.convert_megatron import load_megatron

        return load_megatron(source.state["megatron"], progress=say)
    if source.kind == "hf":
        model = _load_hf(str(source.path))
        # An export without processor files falls back to the model the run trained.
        fallback = _trained_model_path(source.state, source.run_dir) if source.run_dir else None
        processor = _load_processor(source.path, fallback)
        return model, processor
    if source.kind == "lora":
        from peft import PeftModel

        say(f"loading base {source.model_path} (fp32)")
        base = _load_hf(source.model_path, dtype=torch.float32)
        try:
            model = PeftModel.from_pretrained(base, str(source.path)).eval()
        except (ValueError, KeyError, RuntimeError, OSError) as exc:  # adapter shapes/keys that do not fit the base
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ModelError(f"cannot load the LoRA adapter {source.path} into {source.model_path}: {first}",
                             hint="pass --base with the model the adapter was trained on") from exc
        processor = _load_processor(source.path, source.model_path)
        return model, processor

    say(f"reading {source.kind} weights from {source.path}")
    from vlmctl.checkpoints import check_rng_files

    check_rng_files(source.path)  # not needed for the weights; a checkpoint holding a refused object is refused whole
    state = read_dcp_model_state(source.path) if source.kind == "dcp" else read_deepspeed_model_state(source.path)
    dtype = next(iter(state.values())).dtype
    if not dtype.is_floating_point or source.lora:
        dtype = torch.float32  # a LoRA model is merged in fp32 (`merge_lora_model`), whatever dtype training stored
    say(f"loading model {source.model_path}" + (" (fp32)" if source.lora else ""))
    model = _load_hf(source.model_path, dtype=dtype)
    if source.lora:
        from peft import get_peft_model

        model = get_peft_model(model, _lora_config(source.lora))
    # The whole trained state: adapters, `modules_to_save` copies and the frozen base weights, so that the model is
    # the training model even when the run stored its weights in another dtype than the base folder's.
    _load_state_into(model, state, source.path)
    processor = _load_processor(source.model_path)
    return model.eval(), processor


def merge_lora_model(model, dtype: "torch.dtype"):
    """peft's `merge_and_unload` of a LoRA `PeftModel`, computed in fp32, then cast to `dtype`.

    Each adapted weight becomes W + (lora_alpha / r) * B @ A (peft's `LoraLayer.merge`, Hu et al. 2021,
    https://arxiv.org/abs/2106.09685) and `modules_to_save` copies replace their originals. Merging in fp32 and
    rounding once keeps the merged model equal to the unmerged one up to float reordering; merging into bf16
    weights instead rounds every sum to bf16 (0.002 to 0.009 in logits on a LoRA run of the tiny template). The
    model is upcast to fp32 first when it is not already (its tensors are then the rounded ones it holds). Returns
    the plain transformers model; `model` itself is consumed. Raises ModelError when the merge produces NaN or inf
    (`safe_merge`).
    """
    import torch

    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        model = model.to(torch.float32)
    try:
        merged = model.merge_and_unload(safe_merge=True)
    except ValueError as exc:  # peft's safe_merge: the adapter holds NaN/inf, or the sum overflows
        raise ModelError(f"merging the LoRA adapters failed: {exc}", hint="the adapter weights are broken (NaN/inf); convert an earlier checkpoint") from exc
    return merged.to(dtype)


# --------------------------------------------------------------------------------------------------------------------
# Verification


def probe_inputs(processor) -> dict[str, "torch.Tensor"]:
    """The fixed image+text probe: a 64x64 RGB gradient with a square, and a chat-formatted question; for a processor
    that takes audio and no images (Qwen2-Audio), a fixed 1 s chirp instead of the image.

    Returns the processor's tensors (input_ids [1, T], attention_mask [1, T], pixel_values [1, 3, H, W], ...; audio:
    input_features [1, mel bins, frames], feature_attention_mask [1, frames]).
    """
    import numpy as np

    if getattr(processor, "image_processor", None) is None and getattr(processor, "feature_extractor", None) is not None:
        return _audio_probe(processor)
    from PIL import Image

    y, x = np.mgrid[0:64, 0:64]
    pixels = np.stack([x * 4, y * 4, 255 - (x + y) * 2], axis=-1).clip(0, 255).astype(np.uint8)
    pixels[20:44, 20:44] = (230, 200, 30)
    image = Image.fromarray(pixels, "RGB")
    text = None
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROBE_TEXT}]}]
        try:
            text = processor.apply_chat_template(messages, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - templates that do not take list content fall back to plain text
            text = None
    if text is None:
        image_token = getattr(processor, "image_token", None) or "<image>"
        text = f"{image_token}\n{PROBE_TEXT}"
    return dict(processor(images=image, text=text, return_tensors="pt"))


def _audio_probe(processor) -> dict[str, "torch.Tensor"]:
    """`probe_inputs` of an audio processor: 1 s of a 200 -> 2000 Hz linear chirp at the feature extractor's rate and
    the probe question, the audio written as an `{"type": "audio"}` part through the chat template (else the
    processor's audio token before the question)."""
    import numpy as np

    rate = int(processor.feature_extractor.sampling_rate)
    t = np.arange(rate) / rate
    audio = (0.3 * np.sin(2 * np.pi * (200 * t + 900 * t * t))).astype(np.float32)  # instantaneous 200 + 1800 t Hz
    text = None
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": PROBE_TEXT}]}]
        try:
            text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - templates that do not take list content fall back to plain text
            text = None
    if text is None or getattr(processor, "audio_token", "") not in text:
        text = f"{getattr(processor, 'audio_token', '<audio>')}\n{PROBE_TEXT}"
    return dict(processor(audio=[audio], text=[text], sampling_rate=rate, return_tensors="pt"))


def probe_logits(model, inputs: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """Logits [1, T, vocab] (float32) of `model` on the probe inputs."""
    import torch

    dtype = next(model.parameters()).dtype
    batch = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    with torch.no_grad():
        return model(**batch).logits.float()


def tolerance_dtype(*names: str) -> str:
    """The coarsest of the dtype names (bf16 > fp16 > fp32): the one whose rounding bounds a comparison."""
    return max(names, key=lambda n: TOLERANCE[n])


def compare(ref: "torch.Tensor", out: "torch.Tensor", dtype_name: str, ref_dtype_name: str = "fp32") -> VerifyResult:
    """Max |ref - out| of logits [1, T, vocab] against `TOLERANCE[d] * max(1, max |ref|)`, where d is the coarser of
    the output's dtype `dtype_name` and the dtype the reference was computed in (`ref_dtype_name`). Raises
    ModelError when the shapes differ."""
    if ref.shape != out.shape:
        raise ModelError(f"verification failed: logits shapes differ ({tuple(ref.shape)} vs {tuple(out.shape)})")
    diff = float((ref - out).abs().max())
    scale = max(1.0, float(ref.abs().max()))
    tol = TOLERANCE[tolerance_dtype(dtype_name, ref_dtype_name)] * scale
    return VerifyResult(max_abs_diff=diff, tolerance=tol, ref_max_abs=float(ref.abs().max()), num_logits=ref.numel(), passed=diff <= tol)


def verify_folder(folder: Path, ref_logits: "torch.Tensor", ref_inputs: dict[str, "torch.Tensor"], dtype_name: str,
                  ref_dtype_name: str = "fp32") -> VerifyResult:
    """Load `folder` with `AutoModelForImageTextToText` (`AutoModelForMultimodalLM` for audio-language models,
    `auto_model_class`) + `AutoProcessor` (an adapter folder loads its base through transformers' peft integration),
    run the probe, and compare with the reference logits (`compare`).

    Raises ModelError when the folder does not load, its processor tokenizes the probe differently, or the logits
    differ by more than the tolerance.
    """
    import torch

    from vlmctl.models.load import load_processor  # AutoProcessor, or its image-only variant without torchvision

    cls = auto_model_class(folder)
    try:
        processor = load_processor(folder)
        model = cls.from_pretrained(str(folder), dtype="auto").eval()
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"verification failed: the output does not load with {cls.__name__}/AutoProcessor: {type(exc).__name__}: {exc}") from exc
    inputs = probe_inputs(processor)
    for key, value in ref_inputs.items():
        if key not in inputs or inputs[key].shape != value.shape or not torch.equal(inputs[key], value):
            raise ModelError(f"verification failed: the exported processor produces a different {key!r} for the probe than the source processor")
    return compare(ref_logits, probe_logits(model, inputs), dtype_name, ref_dtype_name)


def verify_megatron(folder: Path, ref_logits: "torch.Tensor", ref_inputs: dict[str, "torch.Tensor"], dtype_name: str,
                    ref_dtype_name: str = "fp32") -> VerifyResult:
    """Read the Megatron save directory `folder` back into a transformers model (`convert_megatron.load_megatron`),
    run the probe and compare with the reference logits (`compare`). Raises ModelError when it does not read back."""
    from vlmctl.convert_megatron import find_source, load_megatron

    model, _ = load_megatron(find_source(folder, None))
    return compare(ref_logits, probe_logits(model, ref_inputs), dtype_name, ref_dtype_name)


# --------------------------------------------------------------------------------------------------------------------
# Conversion


def _folder_files(folder: Path) -> list[tuple[str, int]]:
    return sorted((p.relative_to(folder).as_posix(), p.stat().st_size) for p in folder.rglob("*") if p.is_file())


def _copy_extras(source: Source, tmp: Path) -> None:
    """Files of the trained model that save_pretrained does not write (vlmctl's build record)."""
    record = Path(source.model_path or "") / MODEL_INFO
    if source.model_path and record.is_file() and not (tmp / MODEL_INFO).exists():
        shutil.copy2(record, tmp / MODEL_INFO)


def _check_output(out: Path, force: bool, inputs: list) -> None:
    """Refuse an `out` that exists without `force`, and (with it) one that is not an earlier conversion's folder or
    that holds an input (`outputs.check_replaceable`)."""
    check_inputs_outside(out, inputs, what="the output", fix="choose an output folder outside the source (-o)")
    if out.exists() and not force:
        raise UsageError(f"{out} already exists", hint="pass --force to overwrite it, or choose another -o")
    check_replaceable(out, "export", inputs=inputs, what="the output", fix="choose another -o")


def _saved_dtype(model_path: str | None) -> str | None:
    """bf16/fp16/fp32 from an HF folder's config.json (`dtype`, or `torch_dtype` before transformers 5)."""
    if not model_path or not (Path(model_path) / "config.json").is_file():
        return None
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    value = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(value))


def _adapter_checkpoint(source: Source, base: str | None, say) -> tuple[Source, bool]:
    """For `--adapter-only` on a run folder whose final/ export holds no adapter (merged): the run's latest
    checkpoint when it holds LoRA adapters, else `source` itself. Returns (source, whether it is LoRA)."""
    ckpts = _complete_checkpoints(source.run_dir)
    if ckpts:
        candidate = detect_source(ckpts[-1], base=base)
        if candidate.kind == "lora" or candidate.lora:
            say(f"source: {candidate.describe()} (final/ holds the merged model; the adapter comes from the checkpoint)")
            return candidate, True
    return source, False


def default_output(source: Source, adapter_only: bool, to: str = "hf") -> Path:
    """`<run>/export-<step>` for checkpoints, `<src>-hf` (or `-adapter`, `-megatron`) otherwise."""
    suffix = "adapter" if adapter_only else "hf"
    if to == "megatron":
        suffix = "megatron"
    if source.kind == "megatron":
        base = source.state["megatron"].path
        return base.with_name(f"{base.name}-{suffix}")
    if source.run_dir is not None and source.step is not None:
        return source.run_dir / f"export-{source.step}{'-' + suffix if suffix != 'hf' else ''}"
    return source.path.with_name(f"{source.path.name}-{suffix}")


def convert(
    src: Path | str,
    out: Path | str | None = None,
    *,
    to: str = "hf",
    from_: str | None = None,
    tensor_parallel: int | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    merge_lora: bool = True,
    adapter_only: bool = False,
    base: str | None = None,
    verify: bool = True,
    force: bool = False,
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert `src` (see module docstring) into a complete HF folder at `out` and verify it.

    `dtype` (bf16|fp16|fp32) defaults to the trained model's saved dtype (HF sources keep theirs). LoRA sources
    (adapter folders, LoRA DCP/ZeRO checkpoints) are loaded into their base in fp32 with peft and merged there
    (`merge_lora_model`: peft's `merge_and_unload` in fp32, then cast to `dtype`) unless `adapter_only` (or
    `merge_lora=False`), which exports the peft adapter (in fp32) plus the processor (`dtype` is then the base's
    saved dtype).
    With `verify`, logits of OUT on a fixed image+text probe must match the source model's (for LoRA: the unmerged
    fp32 peft model) within `TOLERANCE[d] * max(1, max |logit|)`, d the coarser of `dtype` and the dtype the source
    model ran in.

    `from_` "megatron" insists that `src` is a Megatron checkpoint (detected anyway); `to` "megatron" writes a
    Megatron save directory instead (`vlmctl.convert_megatron.write_megatron`; `tensor_parallel`: the size it must
    divide, default 1), verified by reading it back into the transformers model and comparing the probe's logits.

    Memory: the source model is instantiated once with its weights (plus the checkpoint's state dict while loading);
    LoRA sources in fp32, i.e. 4 bytes per parameter.

    Raises:
        UsageError: unknown source kind, bad option values, OUT exists without `force`.
        ModelError: truncated/incomplete checkpoints, weights that do not fit the model, failed verification.
    """
    say = progress or (lambda _m: None)
    if to not in TARGETS:
        raise UsageError(f"--to {to!r} is not supported", hint="targets: hf (a Hugging Face model folder), megatron (a torch_dist save directory)")
    if from_ not in (None, "auto", "megatron"):
        raise UsageError(f"--from {from_!r} is not supported", hint="--from megatron, or leave it out (the source is detected)")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise UsageError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    if tensor_parallel is not None and to != "megatron":
        raise UsageError("--tensor-parallel applies to --to megatron", hint="drop --tensor-parallel, or add --to megatron")
    if to == "megatron" and adapter_only:
        raise UsageError("--adapter-only exports a peft adapter; --to megatron writes whole models", hint="drop --adapter-only")
    source = detect_source(src, base=base)
    if from_ == "megatron" and source.kind != "megatron":
        raise UsageError(f"{src} is not a Megatron checkpoint (found a {source.describe()})",
                         hint="pass a Megatron save directory (latest_checkpointed_iteration.txt) or an iter_* folder")
    say(f"source: {source.describe()}")
    is_lora = source.kind == "lora" or bool(source.lora)
    if adapter_only and not is_lora and source.run_dir is not None and Path(src).resolve() == source.run_dir.resolve():
        source, is_lora = _adapter_checkpoint(source, base, say)  # a LoRA run's final/ may be merged; its checkpoint is not
    adapter_only = adapter_only or (is_lora and not merge_lora)
    if adapter_only and not is_lora:
        raise UsageError(f"--adapter-only needs a LoRA source; {source.path} has no adapter", hint="drop --adapter-only")
    out = Path(out) if out is not None else default_output(source, adapter_only, to)
    inputs = [Path(src), source.path, *local_paths(source.model_path, base)]
    if Path(source.path).resolve() in out.resolve().parents:
        raise UsageError(f"the output {out} lies inside the source {source.path}", hint="choose an output folder outside the source")
    _check_output(out, force, inputs)

    model, processor = load_source(source, progress=say)
    # the model the weights were trained as: its saved dtype is the default output dtype (a Megatron checkpoint: the
    # dtype of its tensors, which the model was built in)
    trained = source.model_path if source.kind in ("dcp", "deepspeed", "lora") else (None if source.kind == "megatron" else str(source.path))
    saved_dtype = _saved_dtype(trained) or _dtype_name(next(model.parameters()).dtype)
    if adapter_only:
        # The adapter keeps its own weights; the base is loaded in its saved dtype, which sets the tolerance.
        dtype = saved_dtype
    dtype = dtype or saved_dtype

    ref_inputs = ref_logits = None
    ref_dtype = _dtype_name(next(model.parameters()).dtype)  # LoRA sources: fp32, the unmerged peft model
    if verify:
        say("running the probe on the source model")
        ref_inputs = probe_inputs(processor)
        ref_logits = probe_logits(model, ref_inputs)

    from functools import partial
    from types import SimpleNamespace

    from vlmctl.models.build import save_model

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged = False
        notes: list[str] = list(source.state["megatron"].notes) if source.kind == "megatron" else []
        if adapter_only:
            say(f"saving the adapter ({dtype})")
            save_model(model, tmp)  # without accelerate's DeepSpeed probe (its "Setting accelerator" warning)
            # peft writes a placeholder README; `vlmctl push` generates the real model card when README.md is absent.
            (tmp / "README.md").unlink(missing_ok=True)
            # The base is referenced by path or Hub id so that transformers/peft can load the adapter directly.
            cfg_path = tmp / "adapter_config.json"
            adapter_cfg = json.loads(cfg_path.read_text())
            base_ref = source.model_path
            if base_ref and Path(base_ref).exists():
                base_ref = str(Path(base_ref).resolve())
            adapter_cfg["base_model_name_or_path"] = base_ref
            cfg_path.write_text(json.dumps(adapter_cfg, indent=2))
        else:
            if is_lora:
                say(f"merging LoRA adapters (fp32, then {dtype})")
                model = merge_lora_model(model, _dtype(dtype))
                merged = True
            model = model.to(_dtype(dtype))
            if to == "megatron":
                from vlmctl.convert_megatron import write_megatron

                notes += write_megatron(model, processor, tmp, tensor_parallel=tensor_parallel or 1, progress=say)["notes"]
            else:
                say(f"saving safetensors shards ({dtype}, max {max_shard_size} each)")
                # save_model saves through `.save_pretrained(folder)`: hand it one that keeps the shard size
                save_model(SimpleNamespace(save_pretrained=partial(model.save_pretrained, max_shard_size=max_shard_size)), tmp)
        if to == "hf":
            processor.save_pretrained(str(tmp))
        _copy_extras(source, tmp)
        info = {
            "source": str(Path(src).resolve()),
            "kind": source.kind,
            "checkpoint": str(Path(source.path).resolve()),
            "run_dir": str(source.run_dir.resolve()) if source.run_dir else None,
            "step": source.step,
            "model_path": source.model_path,
            "dtype": dtype,
            "lora": "adapter" if adapter_only else ("merged" if merged else None),
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        del model
        result_verify = None
        if verify:
            say("verifying: reloading the output and comparing logits")
            if to == "megatron":
                result_verify = verify_megatron(tmp, ref_logits, ref_inputs, dtype, ref_dtype)
            else:
                result_verify = verify_folder(tmp, ref_logits, ref_inputs, dtype, ref_dtype)
            if not result_verify.passed:
                raise ModelError(
                    f"verification failed: max |logit difference| {result_verify.max_abs_diff:.3g} > tolerance "
                    f"{result_verify.tolerance:.3g} ({tolerance_dtype(dtype, ref_dtype)})",
                    hint="the exported weights do not reproduce the source model; run with --debug and report it (or --no-verify to keep the output anyway)",
                )
        _check_output(out, force, inputs)  # checked before the work too; the folder may have appeared meanwhile
        install(tmp, out, "export")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertResult(
        source=str(src), kind=source.kind, out=str(out), dtype=dtype, files=_folder_files(out),
        adapter_only=adapter_only, merged_lora=merged, verify=result_verify,
        notes=notes,
    )
