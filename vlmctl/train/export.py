"""The final export of a run: `run_dir/final/`, an HF folder (LoRA merged) or the peft adapter.

Host memory: the engine gathers the weights one tensor at a time (`distributed.engine.Engine.gather`: every rank
takes part in each tensor's all-gather and ranks other than 0 drop it at once), rank 0 keeps them in the output
dtype and moves them into a model built without weights (`setup.load_empty`), so rank 0 holds one copy of the
model and the others none. QLoRA re-reads its
full-precision base from the source instead (the quantized base is not what is exported).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vlmctl.errors import VlmctlError

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules are imported next to their use as well.

EXPORT_SHARD_BYTES = "5GB"
from vlmctl.files import honour_umask


def export_final(run_dir: Path, cfg, *, engine, source: str, dtype, rank: int, lora, parts_trainable: set[str]) -> Path:
    """Write `run_dir/final/`: an HF folder loadable by AutoModelForImageTextToText + AutoProcessor (LoRA merged),
    or the peft adapter with `train.lora.keep_adapter`. Every rank calls this (gathering weights is collective).

    Saved in fp32 when training ran in fp32, else in bf16. LoRA adapters are merged with peft in fp32, then cast
    once (`vlmctl.convert.merge_lora_model`). The trained state is gathered on rank 0 (`Engine.gather`) in the
    dtype it is merged or saved in and moved into a model built without weights (`_load_trained`); no weight file
    of the source is read, except QLoRA's full-precision base. Raises VlmctlError when the trained weights do not
    fit the model.
    """
    import torch
    import torch.distributed as dist

    out_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    merges = lora is not None and not lora.keep_adapter
    state = engine.gather(rank, dtype=torch.float32 if merges else out_dtype)
    final = Path(run_dir) / "final"
    if rank == 0:
        _write_final(Path(run_dir), cfg, state, source=source, lora=lora, parts_trainable=parts_trainable,
                     out_dtype=out_dtype)
    dist.barrier()
    return final


def _write_final(run_dir: Path, cfg, state: dict, *, source: str, lora, parts_trainable: set[str], out_dtype) -> None:
    """Put the trained `state` into a model of `source` and save it (with its processor) atomically."""
    from vlmctl.convert import merge_lora_model

    fresh, processor = _load_trained(cfg, state, source=source, lora=lora, parts_trainable=parts_trainable)
    tmp = run_dir / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    if lora is not None and not lora.keep_adapter:
        fresh = merge_lora_model(fresh, out_dtype)  # peft's merge_and_unload in fp32, then one rounding
    from vlmctl.models.quiet import quiet_transformers

    try:
        with quiet_transformers():  # no "Writing model shards" bar in the run's output: the run says what it exported
            # 5 GB files (transformers' long-standing default): safetensors copies a file's tensors into one buffer to
            # write it
            fresh.to(out_dtype).save_pretrained(tmp, max_shard_size=EXPORT_SHARD_BYTES)
            if lora is not None and lora.keep_adapter:
                # peft's placeholder card names the base by its local path; `vlmctl push` writes the model card.
                (tmp / "README.md").unlink(missing_ok=True)
            processor.save_pretrained(tmp)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        failure = write_failure(exc, tmp)
        if failure is None:
            raise
        from vlmctl.checkpoints import CheckpointError
        from vlmctl.train.checkpoint import write_error

        message, hint = write_error(failure, tmp, run_dir)
        raise CheckpointError(f"{message}; the final export is not written, the run's checkpoints are intact "
                              "(resuming exports the last one)", hint=hint) from None
    final = run_dir / "final"
    if final.exists():
        shutil.rmtree(final)
    os.replace(honour_umask(tmp), final)  # safetensors writes its files 0600


def write_failure(exc: BaseException, where: Path) -> OSError | None:
    """The OSError behind a failed write of the export: `exc` itself, the `(os error N)` that safetensors'
    SafetensorError reports (a full disk is "I/O error: No space left on device (os error 28)"), or a full disk for
    torch's zip writer's RuntimeError when the filesystem has (almost) no space left; None for other failures."""
    import errno
    import re

    from vlmctl.train.checkpoint import LOW_SPACE, free_space

    if isinstance(exc, OSError):
        return exc
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code), str(where))
    if isinstance(exc, RuntimeError) and "file write failed" in str(exc) and free_space(where) < LOW_SPACE:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))
    return None


def _load_trained(cfg, state: dict, *, source: str, lora, parts_trainable: set[str]):
    """(model of `source` holding the trained `state`, processor). The model is built without weights
    (`setup.load_empty`, peft adapters added as in training) and takes `state`'s tensors as they are
    (`load_state_dict(assign=True)`, emptying `state` as it goes); tied weights are tied again. QLoRA: the
    full-precision base is loaded from `source` in fp32 and only the adapters (and fully trained parts) are taken.
    Raises VlmctlError when a weight of the model is not in `state` or `state` has keys the model does not."""
    import torch

    from vlmctl.train.setup import apply_lora, load_empty, load_source, model_parts

    quantized = lora is not None and lora.quantize != "none"
    fresh, processor, family = (load_source if quantized else load_empty)(source, cfg, dtype=torch.float32)
    if lora is not None:
        fresh = apply_lora(fresh, lora, model_parts(fresh, family), parts_trainable)
    if quantized:  # the trained tensors are the adapters (and fully trained parts); the base is re-read in full
        state = {k: v.float() for k, v in state.items() if "lora_" in k or "modules_to_save" in k}
    _, unexpected = fresh.load_state_dict(state, strict=False, assign=not quantized)
    state.clear()  # the model holds the tensors now
    (fresh.get_base_model() if lora is not None else fresh).tie_weights()
    empty = [name for name, param in fresh.named_parameters() if param.is_meta]
    if unexpected or empty:
        raise VlmctlError(f"the trained weights do not match the model: missing {empty[:3]}, unexpected {unexpected[:3]}",
                          hint="report this with the model family and strategy")
    return fresh, processor
