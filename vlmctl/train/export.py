"""The final export of a run: `run_dir/final/`, an HF folder (LoRA merged) or the peft adapter."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vlmctl.errors import VlmctlError


def gather_state_dict(model, engine, rank: int):
    """The full model state dict on rank 0 (CPU; None on other ranks for ZeRO-2), gathered collectively from a
    DDP/FSDP2 model or a DeepSpeed engine. Every rank calls this."""
    if engine is not None:
        if engine.zero_optimization_stage() == 3:
            return engine._zero3_consolidated_16bit_state_dict()
        return engine.module.state_dict() if rank == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_final(run_dir: Path, cfg, *, model, engine, source: str, dtype, rank: int, lora, parts_trainable: set[str]) -> Path:
    """Write `run_dir/final/`: an HF folder loadable by AutoModelForImageTextToText + AutoProcessor (LoRA merged),
    or the peft adapter with `train.lora.keep_adapter`. Every rank calls this (gathering weights is collective).

    The trained state is loaded into a fresh fp32 copy of the model; LoRA adapters are merged there with peft
    (`vlmctl.convert.merge_lora_model`). Saved in fp32 when training ran in fp32, else in bf16. Raises VlmctlError
    when the trained weights do not fit a freshly loaded model.
    """
    import torch
    import torch.distributed as dist

    state = gather_state_dict(model, engine, rank)
    final = Path(run_dir) / "final"
    if rank == 0:
        _write_final(Path(run_dir), cfg, state, source=source, lora=lora, parts_trainable=parts_trainable,
                     out_dtype=torch.float32 if dtype == torch.float32 else torch.bfloat16)
    dist.barrier()
    return final


def _write_final(run_dir: Path, cfg, state: dict, *, source: str, lora, parts_trainable: set[str], out_dtype) -> None:
    """Load the trained `state` into a fresh copy of `source` and save it (with its processor) atomically."""
    import torch

    from vlmctl.convert import merge_lora_model
    from vlmctl.train.setup import apply_lora, load_source, model_parts

    fresh, processor, family = load_source(source, cfg, dtype=torch.float32)
    if lora is not None:
        fresh = apply_lora(fresh, lora, model_parts(fresh, family), parts_trainable)
    quantized = lora is not None and lora.quantize != "none"
    if quantized:  # the trained tensors are the adapters (and fully trained parts); the base is re-read in full
        state = {k: v for k, v in state.items() if "lora_" in k or "modules_to_save" in k}
    missing, unexpected = fresh.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or (not quantized and [k for k in missing if "lm_head" not in k]):
        raise VlmctlError(f"the trained weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}",
                          hint="report this with the model family and strategy")
    tmp = run_dir / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    if lora is not None and not lora.keep_adapter:
        fresh = merge_lora_model(fresh, out_dtype)  # peft's merge_and_unload in fp32, then one rounding
    fresh.to(out_dtype).save_pretrained(tmp)
    if lora is not None and lora.keep_adapter:
        # peft's placeholder card names the base by its local path; `vlmctl push` writes the model card.
        (tmp / "README.md").unlink(missing_ok=True)
    processor.save_pretrained(tmp)
    final = run_dir / "final"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
