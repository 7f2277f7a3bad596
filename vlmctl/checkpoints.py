"""Reading checkpoint files that may come from elsewhere, without running code from them.

A checkpoint folder is input like any download: `vlmctl train --resume` and `vlmctl convert` read it through
this module only, and nothing in it is unpickled with arbitrary objects:

- `trainer_state.json`: JSON (`read_json`).
- `rng-<rank>.pt`: `torch.load(weights_only=True)`, tensors and plain values (`load_tensors`).
- DCP `.metadata`: an unpickler that builds only DCP's own metadata classes, `torch.Size`, dtypes and paths
  (`read_dcp_metadata`); the data files it names must be plain names inside the folder.
- DCP `.distcp`: tensors through DCP's reader (`torch.load(weights_only=True)`), and the plain values it stores as
  pickled bytes (scheduler and optimizer settings) through `SafeLoadPlanner`, also `weights_only=True`
  (torch's DefaultLoadPlanner loads those with `weights_only=False`).
- DeepSpeed files: every `torch.load` DeepSpeed itself makes while loading is forced to `weights_only=True`, with
  the few plain classes of DeepSpeed's own that its checkpoints hold (`deepspeed_weights_only`).

Every failure is a `CheckpointError` (a ModelError) naming the file: a file that asks for any other Python object
is refused ("refusing to load ..."), a truncated or corrupt one is reported as such. `check_checkpoint` runs every
check without loading the weights, so a launcher can refuse a bad checkpoint before it starts any process.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from vlmctl.errors import ModelError

if TYPE_CHECKING:
    import torch

# numpy and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not
# pay for them.
# argparse and queue (standard library, not loaded at the CLI's start-up) are imported inside the functions that use
# them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

STATE_FILE = "trainer_state.json"
METADATA_FILE = ".metadata"
EARLIER = "use an earlier checkpoint of the run (<run>/checkpoints/checkpoint-<step>)"


class CheckpointError(ModelError):
    """A checkpoint file that cannot be read, or that asks for objects vlmctl does not load (exit code 1).

    Picklable with its hint: DCP gathers the errors of every rank through pickle."""

    title = "Checkpoint error"

    def __reduce__(self):
        return (type(self), (self.message, self.hint))


def refused(path: Path | str, what: str) -> CheckpointError:
    """The error for a file that asks for a Python object outside the allow-list (`what`)."""
    return CheckpointError(
        f"refusing to load {path}: it asks for {what}, which a checkpoint written by vlmctl never holds "
        "(loading it could run code from the file)",
        hint=f"only load checkpoints you trust, or {EARLIER}")


def corrupt(path: Path | str, detail: str) -> CheckpointError:
    """The error for a truncated or damaged file."""
    return CheckpointError(f"cannot read {path}: {detail}", hint=f"the file is truncated or damaged; {EARLIER}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ----------------------------------------------------------------------------------------------------- JSON, tensors


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file (trainer_state.json). Raises CheckpointError when it is missing, not JSON or not an
    object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", hint=EARLIER) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise corrupt(path, f"not valid JSON ({_first_line(exc)})") from None
    if not isinstance(data, dict):
        raise corrupt(path, f"expected a JSON object, found {type(data).__name__}")
    return data


def _numpy_globals() -> list:
    """numpy's array reconstruction, for RNG files written before they held tensors only (numpy's documented
    allow-list for `weights_only`)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return []
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_tensors(path: Path, allow: tuple = ()) -> Any:
    """`torch.load(path, weights_only=True, map_location="cpu")`: tensors, numbers, strings, lists, tuples, dicts
    (plus the classes in `allow`). Raises CheckpointError naming the file: refused when it asks for another
    object, corrupt when it is not a torch file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing", hint=EARLIER)
    return weights_only_load(path, path, allow=(*_numpy_globals(), *allow))


def weights_only_load(source, path: Path | str, allow: tuple = ()) -> Any:
    """`torch.load(source, weights_only=True, map_location="cpu")` with `allow`ed classes; errors name `path`:
    refused for an object outside the allow-list, corrupt for bytes that are not a torch file."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(allow)):
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the error below says it all
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _unpickling_error(path, exc) from None
    except Exception as exc:  # noqa: BLE001 - zip, EOF, struct and runtime errors of a damaged file
        raise corrupt(path, _first_line(exc)) from None


def _unpickling_error(path: Path | str, exc: BaseException) -> CheckpointError:
    """torch's weights-only unpickler names the global it refused ("... GLOBAL posix.system ...");
    any other unpickling failure (random bytes: "Unsupported operand") is a damaged file."""
    import re

    m = re.search(r"GLOBAL ([A-Za-z_][\w.]*)", str(exc))
    if m:
        return refused(path, f"the Python object {m.group(1)}")
    text = str(exc)
    detail = next((line.strip() for line in text.splitlines() if line.strip().startswith("Unsupported")), None)
    return corrupt(path, detail or _first_line(exc))


# ----------------------------------------------------------------------------------------------------- DCP metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP's `.metadata`: DCP's metadata classes, torch.Size, dtypes, layouts and paths only.

    An explicit list of classes rather than whole modules: `torch.distributed.checkpoint` also holds functions
    that read or write arbitrary files (`format_utils.torch_save_to_dcp` calls `torch.load(weights_only=False)`).
    """

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name)
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # megatron-core's torch_dist checkpoints keep the save plans in the metadata (plain dataclasses and an enum)
        *(("torch.distributed.checkpoint.planner", name)
          for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
        ("torch.serialization", "_get_layout"), ("torch", "Size"), ("collections", "OrderedDict"),
        ("builtins", "set"), ("builtins", "frozenset"),
        ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp_metadata(folder: Path):
    """The `Metadata` of the DCP checkpoint in `folder`, read with `_MetadataUnpickler`. Raises CheckpointError:
    refused for any other object, corrupt for anything that is not DCP metadata, and for data files that are not
    plain names inside the folder."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = Path(folder) / METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", hint=EARLIER) from None
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "." in text and " " not in text:  # our refusal carries just module.name
            raise refused(path, f"the Python object {text}") from None
        raise corrupt(path, f"not DCP metadata ({_first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - random bytes fail in many ways (EOF, ValueError, MemoryError, ...)
        raise corrupt(path, f"not DCP metadata ({_first_line(exc)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise corrupt(path, f"not DCP metadata (found {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise refused(path, f"the data file {name!r}, which is not a file name inside {folder}")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def check_dcp(folder: Path):
    """`read_dcp_metadata`, then every data file it names exists and holds every byte it records. Returns the
    metadata; raises CheckpointError naming the first missing or truncated file."""
    folder = Path(folder)
    metadata = read_dcp_metadata(folder)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for name, end in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"the DCP checkpoint {folder} is incomplete: missing {name}",
                                  hint=f"the save was interrupted or a shard was not copied; {EARLIER}")
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(
                f"cannot read the DCP checkpoint {folder} (truncated: {name} has {size} bytes, the metadata records {end})",
                hint=f"the file is truncated or damaged; {EARLIER}")
    check_dcp_values(folder, metadata)
    return metadata


def check_dcp_values(folder: Path, metadata) -> None:
    """Load every plain value DCP stored as pickled bytes (optimizer and scheduler settings: small) with
    `weights_only=True`, so a checkpoint that hides an object there is refused before anything loads it."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            continue
        path = Path(folder) / info.relative_path
        with open(path, "rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
        weights_only_load(io.BytesIO(data), path)


# ----------------------------------------------------------------------------------------------------- DCP data


def dcp_reader(folder: Path):
    """A `FileSystemReader` for `folder` whose metadata comes from `read_dcp_metadata` and whose read errors name
    the data file."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        current: str | None = None

        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = read_dcp_metadata(Path(self.path))
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file, sinfo):
            self.current = sinfo.relative_path
            return super()._slice_file(file, sinfo)

        def read_data(self, plan, planner):
            try:
                return super().read_data(plan, planner)
            except CheckpointError:
                raise
            except pickle.UnpicklingError as exc:
                raise _unpickling_error(Path(self.path) / (self.current or "?"), exc) from None
            except Exception as exc:  # noqa: BLE001 - torch.load of damaged bytes raises RuntimeError and others
                raise corrupt(Path(self.path) / (self.current or "?"), _first_line(exc)) from None

    return SafeReader(str(folder))


def safe_load_planner(allow_partial_load: bool = False):
    """A DefaultLoadPlanner whose plain values (DCP's BYTE_IO items) load with `torch.load(weights_only=True)`."""
    import warnings

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            with warnings.catch_warnings():  # errors propagate to SafeReader.read_data, which names the file
                warnings.simplefilter("ignore")
                loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner(allow_partial_load=allow_partial_load)


def dcp_load(state: dict[str, Any], folder: Path, *, allow_partial_load: bool = False, no_dist: bool = False) -> None:
    """`dcp.load(state, ...)` in place through `dcp_reader` and `safe_load_planner`. With a process group every rank
    calls it and every rank raises the same CheckpointError (DCP gathers the failures of all ranks)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            if no_dist:  # torch warns that it "assumes" one process even when told so (`vlmctl convert`'s output)
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, storage_reader=dcp_reader(folder), planner=safe_load_planner(allow_partial_load), no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - CheckpointException derives from BaseException
        raise _gathered_error(folder, exc) from None


# Host bytes a rank stages per checkpoint file: torch DCP's FileSystemWriter keeps every tensor it copied to the host
# until the file it writes is closed (pytorch/pytorch#195982), so one file per rank stages the rank's whole shard of
# the weights and AdamW moments (about 50 GB per rank for a 7B model in fp32 on 2 GPUs).
DCP_FILE_BYTES = 1 << 30


def dcp_writer(folder: Path, file_bytes: int = DCP_FILE_BYTES):
    """A `torch.distributed.checkpoint.FileSystemWriter` for `folder` that writes each rank's items into files of
    about `file_bytes` bytes (one item above it gets a file of its own), one file at a time, so the host memory a
    save stages is one file's tensors instead of the rank's whole state. The files are ordinary DCP files:
    `FileSystemReader` reads them through the metadata, and the layout on load does not depend on them."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _item_size

    class _BoundedWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            import queue

            if not hasattr(self, "_write_data"):  # a torch without the file-queue step: one item per file
                self.single_file_per_rank = False
                return super().write_data(plan, planner)
            files: queue.Queue = queue.Queue()
            bucket: list = []
            size = 0

            def flush() -> None:
                nonlocal bucket, size
                if bucket:
                    name = f"{plan.storage_data.prefix}{files.qsize()}{DEFAULT_SUFFIX}"
                    files.put((self.fs.concat_path(self.path, name), name, bucket))
                bucket, size = [], 0

            for item in plan.items:
                item_bytes = _item_size(item) if item.tensor_data is not None else 0
                if bucket and size + item_bytes > file_bytes:
                    flush()
                bucket.append(item)
                size += item_bytes
            flush()
            return self._write_data(planner, files)

    return _BoundedWriter(str(folder))


def rank_failures(exc: BaseException) -> list[BaseException]:
    """The per-rank errors inside DCP's CheckpointException (`failures`: rank -> (error, traceback)), lowest rank
    first; empty for any other exception."""
    failures = getattr(exc, "failures", None) or {}
    found = []
    for rank in sorted(failures):
        cause = failures[rank]
        cause = cause[0] if isinstance(cause, tuple) and cause else getattr(cause, "exc", cause)
        if isinstance(cause, BaseException):
            found.append(cause)
    return found


def _gathered_error(folder: Path, exc: BaseException) -> CheckpointError:
    """The first rank's error inside DCP's CheckpointException, as a CheckpointError."""
    for cause in rank_failures(exc):
        return cause if isinstance(cause, CheckpointError) else corrupt(folder, _first_line(cause))
    return corrupt(folder, _first_line(exc))


def read_dcp_tensors(folder: Path, prefix: str = "model.") -> dict[str, "torch.Tensor"]:
    """Full (unsharded) tensors of the `prefix` entries of a DCP checkpoint, keys without the prefix, read in one
    process without a process group (FSDP2's DTensor shards are recorded with their global shapes). Raises
    CheckpointError for unreadable metadata, missing or truncated data files, or no `prefix` tensors."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    metadata = check_dcp(folder)
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not state:
        keys = ", ".join(sorted({k.split(".")[0] for k in metadata.state_dict_metadata})) or "none"
        raise CheckpointError(f"the DCP checkpoint {folder} has no {prefix!r} tensors (top-level keys: {keys})",
                              hint='vlmctl saves dcp.save({"model": model_state_dict, ...})')
    dcp_load(state, folder, no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}


# ----------------------------------------------------------------------------------------------------- DeepSpeed


def _deepspeed_classes() -> list:
    """The plain classes DeepSpeed's checkpoint files hold besides tensors (loss scalers, ZeRO stage, fragment
    addresses, its argparse namespace)."""
    import argparse

    found: list = [argparse.Namespace, set]
    for module, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                          ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
                          ("deepspeed.utils.tensor_fragment", ("fragment_address",))):
        try:
            mod = __import__(module, fromlist=list(names))
        except ImportError:  # pragma: no cover - deepspeed is optional
            continue
        found += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return found


@contextlib.contextmanager
def deepspeed_weights_only() -> Iterator[None]:
    """Inside, every `torch.load` (DeepSpeed's consolidation and `engine.load_checkpoint`) uses
    `weights_only=True` with `_deepspeed_classes` allowed; a refused object raises CheckpointError."""
    import torch

    original = torch.load

    def safe_load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return original(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            error = _unpickling_error(f, exc)
            if error.message.startswith("refusing"):
                raise error from None
            raise  # DeepSpeed's callers report damaged files themselves

    torch.load = safe_load
    try:
        with torch.serialization.safe_globals(_deepspeed_classes()):
            yield
    finally:
        torch.load = original


# ----------------------------------------------------------------------------------------------------- a whole checkpoint


def rng_files(folder: Path) -> list[Path]:
    """The per-rank RNG files of a checkpoint folder."""
    return sorted(Path(folder).glob("rng-*.pt"))


def check_rng_files(folder: Path) -> None:
    """Every `rng-<rank>.pt` in `folder` loads with weights only (CheckpointError naming the first that does not)."""
    for path in rng_files(folder):
        load_tensors(path)


def check_checkpoint(folder: Path) -> dict[str, Any]:
    """Every check `vlmctl train --resume` needs before loading `folder` (a `checkpoints/checkpoint-<step>`):
    trainer_state.json, the DCP metadata and data files (DeepSpeed folders: the `latest` tag's folder exists), and
    every `rng-<rank>.pt` loads with weights only. Returns trainer_state.json; raises CheckpointError."""
    folder = Path(folder)
    state = read_json(folder / STATE_FILE)
    if (folder / METADATA_FILE).exists():
        check_dcp(folder)
    elif (folder / "latest").is_file():
        tag = (folder / "latest").read_text().strip()
        if not tag or Path(tag).name != tag or not (folder / tag).is_dir():
            raise CheckpointError(f"{folder / 'latest'} names {tag!r}, which is not a folder of {folder}", hint=EARLIER)
    else:
        raise CheckpointError(f"{folder} holds neither a DCP checkpoint (.metadata) nor a DeepSpeed one (latest)",
                              hint=EARLIER)
    check_rng_files(folder)
    return state
