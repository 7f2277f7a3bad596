"""Attention backends for packed batches and the memory-light language-modelling loss.

Attention (`train.attn_implementation`):
- `varlen`: PyTorch's own `torch.nn.attention.varlen.varlen_attn` (CUDA only, torch >= 2.10; no flash-attn build),
  registered with transformers' `AttentionInterface` as `vlmctl_varlen`. It receives the packed sample boundaries
  as `packed_cu_seqlens` / `packed_max_seqlen` keyword arguments passed through the model's forward (see
  `vlmctl.data.packing`), or a Qwen-VL vision tower's window boundaries as `cu_seq_lens_q/k`.
- `flash_attn`: transformers' `flash_attention_2` (flash-attn's varlen functions), when the package is installed.
- `sdpa` / `flex` / `eager`: transformers' own; with packing, transformers builds the block-diagonal causal mask
  from the per-sample position ids, so these are the correct CPU fallback.

Loss: only assistant tokens carry labels. `token_losses` asks the model for the hidden states of exactly those
positions (`logits_to_keep` given as an index tensor, which the HF VLM classes pass to `slice_logits_to_keep`
before the LM head), and the LM head computes their cross-entropy in chunks (`chunked_loss_head`), so the
(tokens x vocabulary) logits are never materialized, even where most tokens carry labels (long answers), and the
call goes through the root module's forward (so FSDP2's root hooks run). On CUDA with liger-kernel installed, its
fused linear cross-entropy patches replace this (see `apply_liger`; under sequence parallelism with the labels of
the rank's slice, `train.objectives.loss_sum`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# So are the vlmctl modules that load numpy when imported.
# liger_kernel (an optional dependency) is imported only where used, so the rest works without it.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

# No "flash" in the name: transformers' set_attn_implementation would look for a Hub kernel of that name.
VARLEN_NAME = "vlmctl_varlen"
# The same kernel, named so that Qwen-VL vision towers pass it their window boundaries (see `set_attention`).
VISION_VARLEN_NAME = "vlmctl_flash_varlen"


def resolve_attn_implementation(requested: str, device_type: str) -> str:
    """Map the run plan's attention backend (`RunPlan.attention`: varlen, flash_attn, sdpa, flex or eager; `auto` is
    decided in `vlmctl.config.plan`) to a transformers attention implementation name for this device. Raises
    ValueError when the backend cannot run here (varlen off CUDA, flash_attn without the package)."""
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


def sequence_core_attention(implementation: str | None):
    """The core attention sequence parallelism runs after Ulysses' all-to-all (`distributed.parallelize`): the varlen
    kernel where the run attends with it (`implementation`, the name `set_attention` set), else None (sdpa with the
    row's segment mask, `distributed.sequence.segment_attention`)."""
    return varlen_attention_forward if implementation == VARLEN_NAME else None


def set_attention(model, implementation: str, vision_varlen: bool = False, encoders=None) -> None:
    """Select `implementation` for the language model of `model` (and its encoders, see below).

    With the varlen kernel each encoder of `encoders` (a family's `EncoderSpec`s; None: the model's `vision_config`
    as an image encoder's) whose sub-config (`config_key`) the model has keeps its own `attention` (sdpa for vision
    towers; None: the language model's). Encoders that attend within per-image windows or segments (`varlen`:
    Qwen-VL, Pixtral) get the same kernel over all windows of the step in one call when `vision_varlen` is set:
    transformers hands the window boundaries (`cu_seqlens`) only to implementations whose name contains "flash"
    (`is_flash_attention_requested`), and its `set_attn_implementation` would look such a name up on the Hub, so
    the encoder config's dispatch name is set directly. Otherwise the encoder keeps sdpa (one call per window).
    """
    if encoders is None:
        from vlmctl.families.encoders import EncoderSpec

        encoders = [EncoderSpec(path="", varlen=vision_varlen)]
    subs = getattr(model.config, "sub_configs", {})
    present = [enc for enc in encoders if enc.config_key in subs]
    if implementation == VARLEN_NAME and present:
        model.set_attn_implementation({"text_config": implementation,
                                       **{enc.config_key: enc.attention or implementation for enc in present}})
        for enc in present:
            if vision_varlen and enc.varlen and enc.attention is not None:
                getattr(model.config, enc.config_key)._attn_implementation_internal = VISION_VARLEN_NAME
    else:
        model.set_attn_implementation(implementation)


def unwrapped(model):
    """The model under DDP's and DeepSpeed's engine wrappers (their `.module`); FSDP2 and peft models are their own
    modules and come back as they are."""
    import torch

    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


@contextlib.contextmanager
def padded_attention(model):
    """While open, the language model of `model` (any wrapper: DDP, FSDP2, DeepSpeed, peft) attends with sdpa where
    it was set to the varlen kernel (`VARLEN_NAME`), which takes packed rows of batch size 1 only: what generating
    from left-padded rows (a GRPO step's rollouts) needs. Encoders keep theirs (they run one packed call per step).
    transformers reads the attention implementation from the config at every forward, so the switch is a config
    attribute, restored on exit."""
    config = unwrapped(model).config
    configs = {id(c): c for c in (config, config.get_text_config() if hasattr(config, "get_text_config") else config)}
    switched = [c for c in configs.values() if getattr(c, "_attn_implementation_internal", None) == VARLEN_NAME]
    for c in switched:
        c._attn_implementation_internal = "sdpa"
    try:
        yield
    finally:
        for c in switched:
            c._attn_implementation_internal = VARLEN_NAME


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
    AttentionInterface.register(VISION_VARLEN_NAME, varlen_attention_forward)
    try:
        _varlen_params()
    except ImportError:  # a torch without varlen attention: the forward raises where it is used
        pass
    try:  # the mask interface must know the name too; varlen needs no mask
        from transformers import AttentionMaskInterface

        AttentionMaskInterface.register(VARLEN_NAME, lambda *args, **kwargs: None)
    except ImportError:
        pass


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs) -> tuple[Any, None]:
    """transformers attention function over packed rows with PyTorch's varlen kernel.

    query: (1, H, T, D), key/value: (1, H_kv, T, D). Boundaries: `cu_seq_lens_q/k` + `max_length_q/k` when the
    caller passes them (Qwen-VL vision windows), else `packed_cu_seqlens` int32 (num_samples + 1,) +
    `packed_max_seqlen` from the packed batch, else the whole row is one sequence.
    Returns ((1, T, H, D), None) like transformers' sdpa function.
    """
    import torch
    from torch.nn.attention.varlen import varlen_attn

    if query.shape[0] != 1:
        raise ValueError("varlen attention expects packed rows of batch size 1; enable train.packing")
    total = query.shape[2]
    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q, max_q = kwargs["cu_seq_lens_q"], int(kwargs.get("max_length_q") or total)
        cu_k, max_k = kwargs.get("cu_seq_lens_k", cu_q), int(kwargs.get("max_length_k") or max_q)
    elif kwargs.get("packed_cu_seqlens") is not None:
        cu_q = cu_k = kwargs["packed_cu_seqlens"]
        max_q = max_k = int(kwargs.get("packed_max_seqlen") or total)
    else:
        cu_q = cu_k = torch.tensor([0, total], dtype=torch.int32, device=query.device)
        max_q = max_k = total
    # the kernel wants (T, H, D) with contiguous memory, in fp16/bf16: under autocast (fp32 master weights without
    # FSDP) the parts computed outside autocast-aware ops, such as fp32 rotary embeddings, arrive in fp32
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("varlen attention computes in bf16 or fp16; set train.precision=bf16 (or train.attn_implementation=sdpa)")
    q = query[0].transpose(0, 1).to(dtype).contiguous()
    k = key[0].transpose(0, 1).to(dtype).contiguous()
    v = value[0].transpose(0, 1).to(dtype).contiguous()
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    params = _varlen_params()
    extra: dict[str, Any] = {"scale": scaling}
    # The signature grew between torch releases: causality was `is_causal` before `window_size` existed.
    if "window_size" in params:
        extra["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        extra["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # grouped-query attention without kernel support: repeat the kv heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **extra)
    return out[None], None


def _varlen_params() -> frozenset[str]:
    """The keyword names of this torch's `varlen_attn`, read once (`register_varlen_attention` reads them before any
    layer is compiled: inside a compiled layer, Dynamo would trace `inspect.signature` again and warn that it skips
    an lru_cache)."""
    global _VARLEN_PARAMS
    if _VARLEN_PARAMS is None:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
    return _VARLEN_PARAMS


_VARLEN_PARAMS: frozenset[str] | None = None


def token_losses(model, batch: dict[str, Any], shard=None):
    """Per-token cross-entropy (nats) of the labelled tokens of `batch`, without the (tokens x vocabulary) logits.

    `batch` holds model inputs of one packed row plus `labels` (1, T) with -100 on unlabelled tokens. Returns
    `(losses, index)`: `losses` (n,) float32, one per labelled target token, and `index` (n,) the positions t of
    those target tokens, so callers can sum losses per packed sample. The model is called with
    `logits_to_keep` = the positions that predict a labelled token (t - 1), and no `labels`; its LM head computes
    the cross-entropy of those positions `LOSS_CHUNK_BYTES` of fp32 logits at a time (`chunked_loss_head`), so
    memory holds one chunk's logits however many tokens carry labels (long answers label most of a row). With a
    sequence-parallel `shard` (`distributed.sequence.SequenceShard`) the model's output covers this rank's slice of
    the row only: the targets are those predicted from it (`sequence.local_targets`), and the group's ranks'
    losses add up to the row's. Raises ValueError for more than one row.
    """
    from vlmctl.distributed.sequence import local_targets

    import torch

    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "seq_lens")}
    # A KV cache disables transformers' packed-sequence mask detection; training never needs one.
    inputs.setdefault("use_cache", False)
    B, T = labels.shape
    if B != 1:
        # logits_to_keep indexes the sequence dim of every row alike, so it cannot pick per-row positions
        raise ValueError(f"token_losses takes one packed row (batch size 1), got {B} rows; padded batches use train.objectives.token_loss_sum")
    target_pos = torch.nonzero(labels[0] != -100, as_tuple=False).squeeze(1)
    target_pos = target_pos[target_pos > 0]
    target_pos, keep = local_targets(target_pos, T, shard)
    if target_pos.numel() == 0:
        # keep every parameter in the graph (FSDP/ZeRO-3 need the same collectives on every rank)
        last = T - 1 if shard is None else 0
        out = model(**inputs, logits_to_keep=torch.tensor([last], device=labels.device))
        return out.logits.float().sum()[None] * 0.0, torch.zeros(0, dtype=torch.long, device=labels.device)
    targets = labels[0, target_pos]
    with chunked_loss_head(model, targets, positions=keep) as head:
        out = model(**inputs, logits_to_keep=keep)
    return head.losses(out.logits), target_pos


# fp32 logits of one chunk of the chunked loss: 1 GiB (1,765 tokens of a 152k vocabulary)
LOSS_CHUNK_BYTES = 2**30


def chunked_cross_entropy(hidden, weight, bias, targets, chunk_tokens: int | None = None):
    """Cross-entropy (nats, fp32) of `hidden` (n, H) through the LM head `weight` (V, H) (+ `bias` (V,)) against
    `targets` (n,) (-100: ignored, loss 0), `chunk_tokens` rows at a time (default: `LOSS_CHUNK_BYTES` of fp32
    logits). Each chunk runs under non-reentrant `torch.utils.checkpoint`, so backward recomputes its logits
    instead of keeping them: at most one chunk's (chunk x V) logits exist at a time, for one more LM-head matmul.
    A head split over the vocabulary by tensor parallelism (`weight` a DTensor) computes each rank's (chunk x V / tp)
    logits and the vocabulary-parallel loss (`distributed.tensor_parallel.vocab_parallel_head_loss`).
    Returns (n,) float32."""
    import torch
    from torch.utils.checkpoint import checkpoint

    n = hidden.shape[0]
    chunk = chunk_tokens or max(256, LOSS_CHUNK_BYTES // (4 * weight.shape[0]))
    if n <= chunk:
        return _cross_entropy_chunk(hidden, weight, bias, targets)
    return torch.cat([checkpoint(_cross_entropy_chunk, hidden[i:i + chunk], weight, bias, targets[i:i + chunk], use_reentrant=False)
                      for i in range(0, n, chunk)])


def _cross_entropy_chunk(hidden, weight, bias, targets):
    import torch.nn.functional as F

    from vlmctl.distributed.tensor_parallel import is_vocab_parallel, vocab_parallel_head_loss

    if is_vocab_parallel(weight):  # tensor parallelism: each rank holds a slice of the vocabulary
        return vocab_parallel_head_loss(hidden, weight, bias, targets)
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="none")


class _LossHead:
    """The state of `chunked_loss_head`: what the head computed, read back through the model's output."""

    def __init__(self, targets) -> None:
        self.targets = targets
        self.calls = 0
        self.chunked = False

    def losses(self, logits):
        """The (n,) losses from the model's returned `logits`: the head's own output (the tensor FSDP2 and ZeRO-3
        hook for backward), or, where the head was left alone, the cross-entropy of the kept logits (n, V)."""
        import torch.nn.functional as F

        if not self.chunked:
            from vlmctl.distributed.tensor_parallel import is_vocab_parallel, vocab_parallel_cross_entropy

            if is_vocab_parallel(logits):
                return vocab_parallel_cross_entropy(logits[0], self.targets)
            return F.cross_entropy(logits[0].float(), self.targets, reduction="none")
        if self.calls != 1 or logits.shape[:2] != (1, self.targets.numel()):
            raise RuntimeError(f"the chunked loss head ran {self.calls} times and returned {tuple(logits.shape)} for "
                               f"{self.targets.numel()} targets; this model's forward post-processes its logits")
        return logits.reshape(-1)


@contextlib.contextmanager
def chunked_loss_head(model, targets, positions=None):
    """While open, the LM head of `model` (any wrapper: DDP, FSDP2, DeepSpeed, peft) returns, for the hidden states
    (1, n, H) the model hands it, the cross-entropy against `targets` (n,) as (1, n, 1) instead of logits
    (`chunked_cross_entropy`). A forward that hands the head every position of the row instead of the
    `logits_to_keep` ones (liger-kernel's patched forwards when no labels are given) has its hidden states taken at
    `positions` (n,) first. The head runs inside the model's forward, as liger-kernel's fused loss does, so its
    weight is the gathered one under FSDP2 and ZeRO-3 and the wrappers' hooks see its output. Models whose forward
    transforms the logits after the head (final logit soft-capping) keep their head: the loss is then computed from
    the kept logits. Yields a `_LossHead` whose `losses(out.logits)` gives the (n,) losses."""
    import torch

    state = _LossHead(targets)
    inner = unwrapped(model)
    head = inner.get_output_embeddings()
    text_config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    if head is None or not isinstance(head, torch.nn.Linear) or getattr(text_config, "final_logit_softcapping", None):
        yield state
        return

    def forward(hidden):
        state.calls += 1
        if positions is not None and hidden.shape[-2] != targets.shape[0]:  # the whole row: keep the predicting positions
            hidden = hidden[:, positions.to(hidden.device)]
        losses = chunked_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias, targets)
        return losses.view(1, -1, 1)

    had = head.__dict__.get("forward")
    head.forward = forward
    state.chunked = True
    try:
        yield state
    finally:
        if had is None:
            del head.forward
        else:
            head.forward = had


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


def apply_liger(model, family, kernels: bool = True) -> bool:
    """Apply liger-kernel's fused linear cross-entropy (and, with `kernels`, its RMSNorm / SwiGLU / RoPE) patches
    to `model` in place. Leave `kernels` off with torch.compile, which fuses those itself (and cannot trace
    liger's autograd functions). Returns False when liger has no patch for `family` (a `FamilySpec`).
    """
    import liger_kernel.transformers as lk

    name = family.liger_patch
    fn = getattr(lk, name, None) if name else None
    if fn is None:
        return False
    if kernels:
        fn(model=model, fused_linear_cross_entropy=True, cross_entropy=False)
    else:
        fn(model=model, fused_linear_cross_entropy=True, cross_entropy=False, rope=False, rms_norm=False, swiglu=False)
    return True


# Triton's JIT compiles a kernel again for each class of its plain int arguments (1, a multiple of 16, any other) and
# of its pointers (16-byte aligned or not): `triton.runtime.jit`'s specialization. liger's cross-entropy kernel takes
# the number of labelled tokens as an int, and the labels as a pointer that is aligned or not by where they start.
LABEL_COUNT_CLASSES = (1, 16, 17)


def warm_fused_loss(vocab_size: int, dtype, device, loss_fn=None, tokens: int = 32, hidden_size: int = 16) -> int:
    """Compile liger-kernel's fused linear cross-entropy for every class of label count (`LABEL_COUNT_CLASSES`) and
    every alignment of its labels and per-token losses before training, with gradients as training asks for them:
    otherwise the first row whose count of labelled tokens falls in a new class compiles the kernel inside its step
    (0.24-0.51 s on an H200, a third to two thirds of a 7B step), and a short measurement (the start-up probe,
    `vlmctl bench`) counts it as the step's time.

    The labels start at an even and at an odd element (liger's own shift, `labels[..., 1:]`, starts 8 bytes into
    its buffer), and `hidden_size` is small against `vocab_size`, so liger steps one token per chunk and each chunk's
    labels and losses start at every alignment. The kernel's specialization depends on the logits' dtype and
    `vocab_size` (its row length and block size), not on the hidden size. Calls: `tokens` x `hidden_size` hidden
    states against a zero (`vocab_size`, `hidden_size`) head, forward only (liger computes the gradient in its
    forward). `loss_fn`: liger's `liger_fused_linear_cross_entropy` by default. Returns the number of calls made.
    Raises ModuleNotFoundError without liger-kernel."""
    import torch

    if loss_fn is None:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as loss_fn
    weight = torch.zeros(vocab_size, hidden_size, dtype=dtype, device=device)
    calls = 0
    for offset in (0, 1):
        for count in LABEL_COUNT_CLASSES:
            hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=device, requires_grad=True)
            labels = torch.full((offset + tokens,), -100, dtype=torch.long, device=device)
            labels[offset:offset + count] = 0
            loss_fn(hidden, weight, labels[offset:], reduction="sum", ignore_index=-100)
            calls += 1
    return calls


# ------------------------------------------------------------------------------------------ vision-tower kernels


def apply_encoder_kernels(model, family, *, compile: bool) -> list[str]:
    """The GPU kernels each encoder of `family` (`family.encoders`) declares (`EncoderSpec.kernels`), all exact
    and parameter-preserving: `aligned_mlp` (`align_vision_mlp` on the encoder's blocks), `patch_embed_gemm`
    (`patch_embed_as_linear` in the encoder) and, with `compile`, `compiled_rotary` (`compile_vision_rotary`) and
    the aligned MLP through torch.compile (fusing their elementwise work: fp32 casts, rotate_half, the activation
    times up-projection). Returns the names of what was applied (for the run's start-up table)."""
    from vlmctl.families.encoders import submodule
    from vlmctl.families.spec import encoder_layers

    applied: list[str] = []
    layers = encoder_layers(model, family)
    for name, enc in family.encoders.items():
        if "aligned_mlp" in enc.kernels and align_vision_mlp(layers[name], compile=compile):
            applied.append("aligned MLP" + (" (compiled)" if compile else ""))
        if "patch_embed_gemm" in enc.kernels and patch_embed_as_linear(submodule(model, enc.path)):
            applied.append("patch embedding as GEMM")
        if compile and "compiled_rotary" in enc.kernels and compile_vision_rotary(model):
            applied.append("compiled rotary")
    return list(dict.fromkeys(applied))


def apply_vision_kernels(model, vision_layers, *, compile: bool) -> list[str]:
    """Every encoder kernel on `vision_layers` (blocks) and `model` (patch embeddings, rotary function), whatever
    the family declares (see `apply_encoder_kernels`, which training uses). Returns the names of what was applied."""
    applied = []
    if align_vision_mlp(vision_layers, compile=compile):
        applied.append("aligned MLP" + (" (compiled)" if compile else ""))
    if patch_embed_as_linear(model):
        applied.append("patch embedding as GEMM")
    if compile and compile_vision_rotary(model):
        applied.append("compiled rotary")
    return applied


def align_vision_mlp(vision_layers, multiple: int = 64, *, compile: bool = False) -> int:
    """Run the gated MLPs of vision blocks whose hidden width is not a multiple of `multiple` (Qwen2.5-VL's 3420)
    at a zero-padded width; with `compile`, as one torch.compile'd function shared by all blocks (activations it
    knows: SiLU, GELU).

    A bf16 GEMM whose row stride is not 16-byte aligned (3420 x 2 bytes) cannot use the Hopper TMA kernels, and
    cuBLAS falls back to slower sm80 ones (`benchmarks/bench_gemm_align.py`: 2.9x slower on an H200). Padding the
    weights at each forward with zero rows (gate/up, and their biases) and zero columns (down) keeps the
    parameters and checkpoints unchanged and the output exact: the padded units compute act(0) * 0 = 0 and
    receive zero gradient. Modules whose projections are not plain nn.Linear (LoRA-wrapped) are left alone.
    Returns the number of MLPs changed.
    """
    import types

    from torch import nn

    changed = 0
    for layer in vision_layers:
        mlp = getattr(layer, "mlp", None)
        projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if mlp is None or not all(type(p) is nn.Linear for p in projs) or not hasattr(mlp, "act_fn"):
            continue
        pad = -projs[0].out_features % multiple
        if pad == 0:
            continue
        act = _functional_activation(mlp.act_fn) if compile else None
        mlp._vlmctl_pad = pad
        mlp._vlmctl_core = (_compiled_mlp_core(), act) if act is not None else (_aligned_mlp_core, mlp.act_fn)
        mlp.forward = types.MethodType(_aligned_mlp_forward, mlp)
        changed += 1
    return changed


def _functional_activation(module):
    """The stateless function of a transformers activation module, or None (one compiled graph serves every block
    only when the activation is the same function object)."""
    import torch.nn.functional as F

    return {"SiLUActivation": F.silu, "SiLU": F.silu, "GELUActivation": F.gelu, "GELU": F.gelu}.get(type(module).__name__)


def _aligned_mlp_forward(self, x):
    """down(act(gate(x)) * up(x)) at the padded width (see `align_vision_mlp`); x (..., hidden) -> (..., hidden)."""
    core, act = self._vlmctl_core
    g, u, d = self.gate_proj, self.up_proj, self.down_proj
    return core(x, g.weight, g.bias, u.weight, u.bias, d.weight, d.bias, self._vlmctl_pad, act)


def _aligned_mlp_core(x, wg, bg, wu, bu, wd, bd, pad: int, act):
    import torch.nn.functional as F

    gate = F.linear(x, F.pad(wg, (0, 0, 0, pad)), None if bg is None else F.pad(bg, (0, pad)))
    up = F.linear(x, F.pad(wu, (0, 0, 0, pad)), None if bu is None else F.pad(bu, (0, pad)))
    return F.linear(act(gate) * up, F.pad(wd, (0, pad)), bd)


@functools.lru_cache(maxsize=1)
def _compiled_mlp_core():
    import torch

    return torch.compile(_aligned_mlp_core, dynamic=True)  # patch counts change every step


def compile_vision_rotary(model) -> bool:
    """Replace the vision rotary function of the model's transformers module (`apply_rotary_pos_emb_vision` of
    Qwen2-VL, Qwen2.5-VL, Qwen3-VL: fp32 casts, rotate_half, four multiplies) by its torch.compile'd version, as
    liger-kernel replaces the text rotary. Module-wide, like liger's patches. Returns False where there is none."""
    import sys

    import torch

    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "apply_rotary_pos_emb_vision", None)
    if fn is None:
        return False
    if not getattr(fn, "_vlmctl_compiled", False):
        compiled = torch.compile(fn, dynamic=True)
        compiled._vlmctl_compiled = True
        module.apply_rotary_pos_emb_vision = compiled
    return True


def patch_embed_as_linear(model) -> int:
    """Compute the patch embedding of Qwen-VL vision towers (a Conv3d whose kernel equals its stride over
    flattened (channels, time, height, width) patches) as one GEMM with the same weight, instead of a cuDNN 3-D
    convolution. Same parameters, same result. Returns the number of modules changed."""
    import types

    from torch import nn

    changed = 0
    for module in model.modules():
        proj = getattr(module, "proj", None)
        if (type(module).__name__.endswith("PatchEmbed") and isinstance(proj, nn.Conv3d)
                and tuple(proj.kernel_size) == tuple(proj.stride) and proj.padding in ((0, 0, 0), 0) and proj.groups == 1):
            module.forward = types.MethodType(_linear_patch_embed_forward, module)
            changed += 1
    return changed


def _linear_patch_embed_forward(self, hidden_states):
    """(patches, C * T * P * P) -> (patches, embed_dim), as the Conv3d of the original forward."""
    import torch.nn.functional as F

    weight = self.proj.weight  # (embed_dim, C, T, P, P), flattened in the order the patches are
    x = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return F.linear(x, weight.reshape(weight.shape[0], -1), self.proj.bias)
