"""Reading and writing Megatron checkpoints as canonical tensors (full size, one per name, layers numbered globally,
Transformer Engine's fused layer-norm names; `layouts` maps those names to transformers').

Folders (Megatron-LM `megatron/training/checkpointing.py`, Megatron-Bridge's checkpoints are the same):

- a save directory: `latest_checkpointed_iteration.txt` (an iteration number or `release`) next to `iter_0000100/`
  (or `release/`) iteration folders; the tracker's iteration is read, or the latest `iter_*` folder;
- `torch_dist` (megatron-core `dist_checkpointing`): an iteration folder with `metadata.json`
  (`"sharded_backend": "torch_dist"`) and a torch Distributed Checkpoint (`.metadata`, `__*_*.distcp`). Each tensor is
  stored once with its global shape whatever the tensor/pipeline split, so it is read with plain PyTorch DCP in one
  process (`vlmctl.checkpoints.dcp_load`, nothing unpickled but DCP's metadata classes). The layers of a
  `TransformerBlock` are stacked on a leading axis (`decoder.layers.self_attention.linear_qkv.weight` [layers, ...]);
  the local layer specs' `input_layernorm` / `pre_mlp_layernorm` are stored under the fused names by the GPT
  spec and under their own by the ViT spec (both are read). The gated MLP's
  `linear_fc1` is [gate; up] of the whole layer (megatron-core `apply_swiglu_sharded_factory`);
- legacy: `mp_rank_XX/model_optim_rng.pt` (tensor-parallel rank XX) or `mp_rank_XX_YYY/` (pipeline stage YYY),
  loaded with `torch.load(weights_only=True)` (argparse's Namespace of the run's arguments and the in-memory bytes
  of Transformer Engine's FP8 state allowed; anything else that needs code to unpickle is refused). Each file holds its rank's slices (column-parallel layers split on dim 0,
  row-parallel on dim 1, the gated `linear_fc1` as this rank's [gate; up]) and its stage's layers numbered from 0;
  `model0`, `model1`, ... are virtual pipeline chunks.

Writing makes a `torch_dist` folder with plain DCP in one process: `iter_0000000/` + the tracker, `metadata.json`,
`common.pt` (checkpoint version and iteration), the layer-stacked tensors and an empty `_extra_state` per linear layer
(what megatron-core's local and Transformer Engine layers keep there when no FP8 state exists).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from vlmctl.convert_megatron.layouts import MODEL_PREFIXES
from vlmctl.errors import ModelError, UsageError

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

TRACKER = "latest_checkpointed_iteration.txt"
METADATA_JSON = "metadata.json"
ITERATION = "iter_{:07d}"
_LEGACY = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
_LAYER = re.compile(r"(.*\.layers)\.(\d+)\.(.*)")
# local layer spec names -> the fused names a torch_dist checkpoint uses (megatron-core `get_gpt_layer_local_spec`'s
# `sharded_state_dict_keys_map`)
_LOCAL_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"), ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
# tensor-parallel splits of legacy files: column-parallel on dim 0, row-parallel on dim 1 (megatron-core
# `tensor_parallel/layers.py`); everything else is replicated
_COLUMN = re.compile(r".*(linear_qkv\.(weight|bias)|linear_fc1\.(weight|bias)|word_embeddings\.weight|output_layer\.weight)")
_ROW = re.compile(r".*(linear_proj|linear_fc2)\.weight")


def is_megatron(folder: Path) -> bool:
    """True for a Megatron save directory, iteration folder (torch_dist or legacy)."""
    folder = Path(folder)
    if (folder / TRACKER).is_file() or any(_iterations(folder)):
        return True
    return _backend(folder) is not None or any(_LEGACY.fullmatch(p.name) for p in folder.iterdir() if p.is_dir())


def _iterations(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("iter_*") if p.is_dir() and re.fullmatch(r"iter_\d{7}", p.name))


def _backend(folder: Path) -> str | None:
    path = folder / METADATA_JSON
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return None


def iteration_folder(folder: Path) -> Path:
    """The iteration folder of a Megatron `folder`: itself, the tracker's, else the latest `iter_*`. Raises
    UsageError when there is none."""
    folder = Path(folder)
    tracker = folder / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        name = "release" if text == "release" else (ITERATION.format(int(text)) if text.isdigit() else None)
        if name is None:
            raise UsageError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'",
                             hint="pass the iteration folder (iter_*) itself")
        if not (folder / name).is_dir():
            raise UsageError(f"{tracker} names {name}, which is not in {folder}", hint="pass an iteration folder that exists")
        return folder / name
    iterations = _iterations(folder)
    if iterations:
        return iterations[-1]
    if (folder / "release").is_dir():
        return folder / "release"
    return folder


def describe(folder: Path) -> str:
    """`torch_dist` or `legacy (TP x PP)` for an iteration folder."""
    if _backend(folder) == "torch_dist":
        return "torch_dist"
    ranks = _legacy_ranks(folder)
    tp = len({t for t, _ in ranks})
    pp = len({p for _, p in ranks})
    return f"legacy, tensor parallel {tp} x pipeline {pp}"


# ---------------------------------------------------------------------------------------------------- reading


def read(folder: Path, gated: "callable") -> dict[str, "torch.Tensor"]:
    """Canonical model tensors of the iteration folder `folder` (see the module docstring). `gated(name)`: whether
    the `linear_fc1` called `name` is a gated [gate; up] projection (legacy files interleave it per rank).

    Raises UsageError for a folder that is no Megatron checkpoint or another backend (zarr), CheckpointError for
    damaged or refused files, ModelError for files that do not fit together.
    """
    folder = Path(folder)
    backend = _backend(folder)
    if backend == "torch_dist":
        return _read_dist(folder)
    if backend is not None:
        raise UsageError(f"{folder} is a {backend} checkpoint; vlmctl reads torch_dist and legacy ones",
                         hint="convert it to torch_dist with Megatron-LM's tools/checkpoint/convert.py (--ckpt-format torch_dist)")
    if _legacy_ranks(folder):
        return _read_legacy(folder, gated)
    raise UsageError(f"{folder} holds no Megatron checkpoint (no metadata.json of a torch_dist save, no mp_rank_* folders)",
                     hint="pass a Megatron save directory or one of its iter_* folders")


def _read_dist(folder: Path) -> dict[str, "torch.Tensor"]:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from vlmctl.checkpoints import check_dcp, dcp_load

    metadata = check_dcp(folder)
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(MODEL_PREFIXES) and isinstance(meta, TensorStorageMetadata)}
    if not state:
        found = ", ".join(sorted({k.split(".")[0] for k in metadata.state_dict_metadata})[:8]) or "none"
        raise ModelError(f"the torch_dist checkpoint {folder} holds no vision-language model weights (top-level names: {found})",
                         hint="vlmctl reads Megatron-LM LLaVA and Megatron-Bridge Qwen-VL checkpoints (language_model.*, vision_model.*, visual.*)")
    dcp_load(state, folder, no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        head, sep, tail = key.partition(".layers.")
        if sep and not tail[:1].isdigit() and head.endswith("decoder"):  # stacked layers [L, ...]
            for i, layer in enumerate(tensor.unbind(0)):
                out[_canonical(f"{head}.layers.{i}.{tail}")] = layer.clone()
        else:
            out[_canonical(key)] = tensor
    return out


def _legacy_ranks(folder: Path) -> dict[tuple[int, int], Path]:
    found = {}
    for path in folder.iterdir() if folder.is_dir() else ():
        m = _LEGACY.fullmatch(path.name)
        if m and path.is_dir():
            found[(int(m.group(1)), int(m.group(2) or 0))] = path / "model_optim_rng.pt"
    return found


def _load_legacy(path: Path) -> dict:
    import argparse
    import io

    from vlmctl.checkpoints import load_tensors

    # argparse.Namespace: the run's arguments, a plain attribute holder; io.BytesIO: Transformer Engine's FP8 state
    # (`_extra_state`, bytes in memory, not read); anything else needing code is refused
    data = load_tensors(path, allow=(argparse.Namespace, io.BytesIO))
    if not isinstance(data, dict):
        raise ModelError(f"{path} holds a {type(data).__name__}, not a Megatron checkpoint dictionary")
    return data


def _read_legacy(folder: Path, gated) -> dict[str, "torch.Tensor"]:
    import torch

    ranks = _legacy_ranks(folder)
    tp = 1 + max(t for t, _ in ranks)
    pp = 1 + max(p for _, p in ranks)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp) if (t, p) not in ranks]
    if missing:
        raise ModelError(f"the legacy checkpoint {folder} lacks {', '.join(missing)}", hint="copy every rank's folder")
    files = {key: _load_legacy(path) for key, path in sorted(ranks.items())}
    chunks = sorted({k for data in files.values() for k in data if re.fullmatch(r"model\d*", k)}, key=lambda k: (len(k), k))
    if not chunks:
        raise ModelError(f"{ranks[(0, 0)]} holds no model state (keys: {', '.join(sorted(files[(0, 0)])[:8])})")
    out: dict[str, torch.Tensor] = {}
    offsets: dict[str, int] = {}
    # virtual pipeline chunk c of stage p holds the (c * pp + p)-th group of layers (Megatron-LM's interleaved schedule)
    for chunk in chunks:
        for p in range(pp):
            shards = [{k: v for k, v in _as_dict(files[(t, p)].get(chunk), ranks[(t, p)]).items() if k.startswith(MODEL_PREFIXES)}
                      for t in range(tp)]
            counts: dict[str, int] = {}
            for name in shards[0]:
                tensors = [s.get(name) for s in shards]
                if not isinstance(tensors[0], torch.Tensor):
                    continue  # _extra_state (None, or Transformer Engine's FP8 state)
                if any(not isinstance(t, torch.Tensor) for t in tensors):
                    raise ModelError(f"{name} is missing from some tensor-parallel ranks of {folder}")
                full = _merge(name, tensors, gated)
                canonical = _canonical(name)
                m = _LAYER.fullmatch(canonical)
                if m:
                    counts[m.group(1)] = max(counts.get(m.group(1), 0), int(m.group(2)) + 1)
                    canonical = f"{m.group(1)}.{int(m.group(2)) + offsets.get(m.group(1), 0)}.{m.group(3)}"
                out[canonical] = full
            for block, n in counts.items():
                offsets[block] = offsets.get(block, 0) + n
    return out


def _as_dict(value, path: Path) -> dict:
    if not isinstance(value, dict):
        raise ModelError(f"{path} holds no model state dictionary")
    return value


def _canonical(name: str) -> str:
    for local, fused in _LOCAL_NAMES:
        name = name.replace("." + local, "." + fused)
    return name


def _merge(name: str, tensors: list["torch.Tensor"], gated) -> "torch.Tensor":
    """One tensor from its tensor-parallel slices (replicated ones: the first rank's)."""
    import torch

    if len(tensors) == 1:
        return tensors[0]
    if _ROW.fullmatch(name):
        return torch.cat(tensors, dim=1)
    if _COLUMN.fullmatch(name):
        if name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias"):
            if gated(_canonical(name)):
                halves = [t.chunk(2, dim=0) for t in tensors]
                return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(tensors, dim=0)
    return tensors[0]


# ---------------------------------------------------------------------------------------------------- writing


def stacked(tensors: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """torch_dist's names: the layers of each `decoder` stacked on a leading axis (layers 0..L-1 must all be there)."""
    import torch

    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in tensors.items():
        m = _LAYER.fullmatch(name)
        if m and m.group(1).endswith("decoder.layers"):
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = tensor
        else:
            out[name] = tensor
    for (block, tail), layers in groups.items():
        if sorted(layers) != list(range(len(layers))):
            raise ModelError(f"{block}.*.{tail}: layers {sorted(layers)} are not 0..{len(layers) - 1}")
        out[f"{block}.{tail}"] = torch.stack([layers[i] for i in range(len(layers))])
    return out


def _extra_states(names: list[str], layers: dict[str, int]) -> dict[str, list]:
    """Empty `_extra_state` objects of the linear layers as megatron-core saves a ShardedObject: `[None]` (the list
    of the object's local pieces, `_mcore_to_torch_sharded_object`), keyed `<key>/shard_<offset>_<shape>` (the
    layer index and count for stacked layers); DCP's planner stores each as `torch.save` bytes."""
    out = {}
    for name in names:
        if not re.search(r"(linear_qkv|linear_proj|linear_fc1|linear_fc2|output_layer)\.weight$", name):
            continue
        key = name[: -len("weight")] + "_extra_state"
        block = next((b for b in layers if name.startswith(b + ".")), None)
        shards = [f"shard_{i}_{layers[block]}" for i in range(layers[block])] if block else ["shard_0_1"]
        for shard in shards:
            out[f"{key}/{shard}"] = [None]
    return out


def write(folder: Path, tensors: dict[str, "torch.Tensor"], *, iteration: int = 0) -> Path:
    """Write canonical `tensors` as a torch_dist save directory into the (new, empty) `folder`: the tracker and
    `iter_<iteration>/`. Returns the iteration folder."""
    import torch
    import torch.distributed.checkpoint as dcp

    from vlmctl.checkpoints import dcp_writer

    it = Path(folder) / ITERATION.format(iteration)
    it.mkdir(parents=True)
    state = stacked(tensors)
    layers = {}
    for name, t in state.items():
        head, sep, tail = name.partition(".layers.")
        if sep and head.endswith("decoder") and not tail[:1].isdigit():
            layers[f"{head}.layers"] = t.shape[0]
    state.update(_extra_states(list(state), layers))
    dcp.save(state, storage_writer=dcp_writer(it), no_dist=True)
    torch.save({"checkpoint_version": 3.0, "iteration": iteration}, it / "common.pt")
    (it / METADATA_JSON).write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                "common_backend": "torch", "common_backend_version": 1}))
    (Path(folder) / TRACKER).write_text(str(iteration))
    return it
