"""Attention backends for packed batches and the memory-light language-modelling loss.

Attention (`train.attn_implementation`):
- `varlen`: PyTorch's own `torch.nn.attention.varlen.varlen_attn` (CUDA only, torch >= 2.10; no flash-attn build),
  registered with transformers' `AttentionInterface` as `vlmctl_varlen`. It receives the packed sample boundaries
  as `cu_seq_lens_q/k` and `max_length_q/k` keyword arguments passed through the model's forward.
- `flash_attn`: transformers' `flash_attention_2` (flash-attn's varlen functions), when the package is installed.
- `sdpa` / `flex` / `eager`: transformers' own; with packing, transformers builds the block-diagonal causal mask
  from the per-sample position ids, so these are the correct CPU fallback.

Loss: only assistant tokens carry labels, usually a small fraction of a VLM batch. `token_losses` asks the model
for logits at exactly those positions (`logits_to_keep` given as an index tensor, which the HF VLM classes pass to
`slice_logits_to_keep` before the LM head), so the (tokens x vocabulary) logits of the whole batch are never
materialized and the call goes through the root module's forward (so FSDP2's root hooks run). On CUDA with
liger-kernel installed, its fused linear cross-entropy patches replace this (see `apply_liger`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

VARLEN_NAME = "vlmctl_varlen"


def resolve_attn_implementation(requested: str, device_type: str) -> str:
    """Map `train.attn_implementation` to a transformers attention implementation name for this device.

    auto -> `vlmctl_varlen` on CUDA (PyTorch varlen), `sdpa` elsewhere. Raises ValueError when the request cannot
    run here (varlen off CUDA, flash_attn without the package).
    """
    if requested == "auto":
        requested = "varlen" if device_type == "cuda" and _has_varlen() else "sdpa"
    if requested == "varlen":
        if device_type != "cuda" or not _has_varlen():
            raise ValueError("train.attn_implementation=varlen needs CUDA and torch >= 2.10; use sdpa or flex on CPU")
        register_varlen_attention()
        return VARLEN_NAME
    if requested == "flash_attn":
        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError("train.attn_implementation=flash_attn needs the flash-attn package (pip install 'vlmctl[flash]'); varlen needs no extra package")
        return "flash_attention_2"
    return {"sdpa": "sdpa", "flex": "flex_attention", "eager": "eager"}[requested]


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def register_varlen_attention() -> None:
    """Register `vlmctl_varlen` with transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_NAME, varlen_attention_forward)
    try:  # the mask interface must know the name too; varlen needs no mask
        from transformers import AttentionMaskInterface

        AttentionMaskInterface.register(VARLEN_NAME, lambda *args, **kwargs: None)
    except ImportError:
        pass


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs) -> tuple[Any, None]:
    """transformers attention function over packed rows with PyTorch's varlen kernel.

    query: (1, H, T, D), key/value: (1, H_kv, T, D); `cu_seq_lens_q/k` int32 (num_samples + 1,) and
    `max_length_q/k` come from the packed batch. Returns ((1, T, H, D), None) like transformers' sdpa function.
    Without `cu_seq_lens_q` (e.g. an unpacked batch of one sample) the whole row is one sequence.
    """
    import torch
    from torch.nn.attention.varlen import varlen_attn

    if query.shape[0] != 1:
        raise ValueError("varlen attention expects packed rows of batch size 1; enable train.packing")
    total = query.shape[2]
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None:
        cu_q = torch.tensor([0, total], dtype=torch.int32, device=query.device)
        max_q = total
    else:
        max_q = int(kwargs.get("max_length_q") or total)
    cu_k = kwargs.get("cu_seq_lens_k", cu_q)
    max_k = int(kwargs.get("max_length_k") or max_q)
    q = query[0].transpose(0, 1)  # (T, H, D)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    causal = getattr(module, "is_causal", True)
    out = varlen_attn(
        q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
        scale=scaling, window_size=(-1, 0) if causal else (-1, -1), enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[None], None


def token_losses(model, batch: dict[str, Any]):
    """Per-token cross-entropy (nats) of the labelled tokens of `batch`, without full logits.

    `batch` holds model inputs plus `labels` (B, T) with -100 on unlabelled tokens. Returns `(losses, index)`:
    `losses` (n,) float32, one per labelled target token, and `index` (n,) the flat positions (b * T + t) of
    those target tokens, so callers can sum losses per packed sample. The model is called with
    `logits_to_keep` = the positions that predict a labelled token (t - 1), and no `labels`.
    """
    import torch
    import torch.nn.functional as F

    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "seq_lens")}
    # A KV cache disables transformers' packed-sequence mask detection; training never needs one.
    inputs.setdefault("use_cache", False)
    B, T = labels.shape
    if B != 1:
        # logits_to_keep indexes the sequence dim of every row alike: gather per row on the full logits instead
        out = model(**inputs)
        logits = out.logits[:, :-1].float()
        target = labels[:, 1:]
        mask = target != -100
        losses = F.cross_entropy(logits[mask], target[mask], reduction="none")
        pos = torch.nonzero(mask.reshape(-1), as_tuple=False).squeeze(1)
        index = (pos // (T - 1)) * T + pos % (T - 1) + 1
        return losses, index
    target_pos = torch.nonzero(labels[0] != -100, as_tuple=False).squeeze(1)
    target_pos = target_pos[target_pos > 0]
    if target_pos.numel() == 0:
        # keep every parameter in the graph (FSDP/ZeRO-3 need the same collectives on every rank)
        out = model(**inputs, logits_to_keep=torch.tensor([T - 1], device=labels.device))
        return out.logits.float().sum()[None] * 0.0, torch.zeros(0, dtype=torch.long, device=labels.device)
    out = model(**inputs, logits_to_keep=target_pos - 1)
    logits = out.logits[0].float()  # (n, V)
    losses = F.cross_entropy(logits, labels[0, target_pos], reduction="none")
    return losses, target_pos


def per_sample_sums(losses, index, seq_lens: list[int]):
    """Sum token losses per packed sample: `seq_lens` are the packed samples' lengths (tokens) in order."""
    import torch

    bounds = torch.tensor(seq_lens, device=index.device).cumsum(0)
    owner = torch.bucketize(index, bounds, right=True)
    sums = torch.zeros(len(seq_lens), dtype=losses.dtype, device=losses.device)
    counts = torch.zeros(len(seq_lens), dtype=torch.long, device=losses.device)
    if index.numel():
        sums = sums.index_add(0, owner, losses)
        counts = counts.index_add(0, owner, torch.ones_like(owner))
    return sums, counts


def liger_available(device_type: str) -> bool:
    """liger-kernel's Triton kernels need CUDA and the package (`pip install 'vlmctl[gpu]'`)."""
    return device_type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


LIGER_PATCHES = {
    # family -> liger_kernel.transformers function that patches the model class in place
    "qwen2_vl": "apply_liger_kernel_to_qwen2_vl",
    "qwen2_5_vl": "apply_liger_kernel_to_qwen2_5_vl",
    "qwen3_vl": "apply_liger_kernel_to_qwen3_vl",
    "llava": "apply_liger_kernel_to_llava",
}


def apply_liger(model, family: str) -> bool:
    """Apply liger-kernel's RMSNorm / SwiGLU / RoPE / fused linear cross-entropy patches to `model` in place.

    Returns False when liger has no patch for `family` (the plain-torch path is used then).
    """
    import liger_kernel.transformers as lk

    name = LIGER_PATCHES.get(family)
    fn = getattr(lk, name, None) if name else None
    if fn is None:
        return False
    fn(model=model, fused_linear_cross_entropy=True, cross_entropy=False)
    return True
