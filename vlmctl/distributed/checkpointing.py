"""Activation checkpointing of the decoder layers and vision blocks (`train.activation_checkpointing`).

Modes (torchtitan's `full` and `selective` modes, `torchtitan/models/llama3/infra/parallelize.py`):

- `off`: every activation is kept for the backward pass.
- `full`: each layer keeps only its input; its forward runs again in the backward pass (about a third more compute).
- `vision`: every block of the vision tower is checkpointed, no decoder layer is (ms-swift's
  `vit_gradient_checkpointing` without the language model's). A visual token stands for several patches (4 in
  Qwen2-VL's 2 x 2 merge), each with a block's activations in every vision layer, so on image-heavy rows the vision
  tower holds a larger share of the activation memory than of the FLOPs (42% of the memory on the 3B's heaviest
  rows of `vlmctl bench`, docs/benchmarks.md; its recompute there cost more time than every 2nd layer's).
- an integer k: every k-th layer of the language model and of the vision tower is checkpointed (selective per layer:
  memory and extra compute in between off and full).
- `op`: every layer is checkpointed, but the outputs of its matrix multiplications and attention kernels are kept
  (selective per op, `torch.utils.checkpoint.create_selective_checkpoint_contexts`): the backward pass recomputes
  only the cheap elementwise work (norms, activations, rotary).
- `keep_attention`: every layer is checkpointed and only its attention kernel's output (and log-sum-exp) is kept:
  the backward pass recomputes the matmuls and elementwise work but not the attention. On long rows attention is
  most of a layer's FLOPs (it grows with the segment length, the rest does not), so this drops most of full
  checkpointing's extra compute for (tokens x hidden size) more bytes per layer, where `op` keeps every matmul's
  output (several times that).

`train.activation_checkpointing_layers: N` limits a mode to the first N decoder layers (Megatron-LM's
`recompute_method: block` with `recompute_num_layers`): the last layers keep every activation and are not
recomputed. Where rows leave memory beside full (or `keep_attention`) checkpointing, as sequence-parallel rows do
(they are not probed, and their `auto` is full), each layer left out saves its share of the recompute (its
forward again, a quarter of its step with `full`) for all of its activations instead of its input. Measured on one
H200 (docs/benchmarks.md): the 7B preset at 32,768-token rows with `keep_attention`, the first 22 of 28 layers
checkpointed, trained 1.7% faster for 3.95 GiB more per layer left out.

A mode only gives the chosen layers an instance `forward` that runs through `torch.utils.checkpoint` (any
`nn.Module` works), so parameter names, FSDP2 units and checkpoints stay the same and a mode can be changed on a
wrapped model (the start-up probe does).

Two more memory helpers for long rows (the ALST paper, arXiv 2506.13996, section 3):

- Checkpoint offload (`train.activation_offload`): a checkpointed layer's input, the one activation full
  checkpointing keeps per layer ((tokens x hidden size) each), is copied to pinned host memory in forward and back
  for the layer's recompute in backward. The copies run on the compute stream, in order with the kernels around them.
- Tiled MLP (`train.tiled_mlp: N`, `apply_tiled_mlp`): each decoder layer's MLP runs over N slices of the sequence
  under DeepSpeed's `TiledMLP` (it recomputes a slice's forward in backward), so its (tokens x intermediate size)
  activations exist for one slice at a time.
"""

from __future__ import annotations

import functools
from typing import Any

from vlmctl.config.plan import pending

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# deepspeed (an optional dependency) is imported only where used, so the rest works without it.
# Light vlmctl modules are imported next to their use as well.

MODES = ("off", "full", "op", "keep_attention", "vision")  # plus a positive integer k
SELECTIVE = ("op", "keep_attention")  # every layer, some ops' outputs kept (`_save_policy`)


def describe(mode) -> str:
    """A short label for a mode: "off", "full", "op (selective)", "full, attention kept", "vision tower only" or
    "every 2nd layer"."""
    if mode == "op":
        return "op (selective)"
    if mode == "keep_attention":
        return "full, attention kept"
    if mode == "vision":
        return "vision tower only"
    if isinstance(mode, int) and not isinstance(mode, bool):
        if mode == 1:
            return "full"
        suffix = {2: "nd", 3: "rd"}.get(mode, "th")
        return f"every {mode}{suffix} layer"
    return str(mode)


def _attention_ops() -> set:
    """The attention kernels' ops whose outputs the selective modes keep: SDPA's (CUDA and CPU flash, memory
    efficient, cuDNN) and PyTorch's varlen attention (`torch_attn._varlen_attn`, the packed rows' kernel on CUDA,
    `train.kernels.varlen_attention_forward`)."""
    import torch

    aten, ops = torch.ops.aten, set()
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
                 "_scaled_dot_product_flash_attention_for_cpu"):
        op = getattr(aten, name, None)
        if op is not None:
            ops.add(op.default)
    try:  # registered when torch.nn.attention.varlen is imported (torch >= 2.10)
        import torch.nn.attention.varlen  # noqa: F401

        ops.add(torch.ops.torch_attn._varlen_attn.default)
    except (ImportError, AttributeError):
        pass
    return ops


def _save_policy(mode):
    """The per-op policy of a selective mode: `op` saves the outputs of matmuls and attention kernels (torchtitan's
    `_save_list` policy), `keep_attention` those of the attention kernels only; everything else is recomputed."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = _attention_ops()
    if mode == "op":
        save |= {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_function(mode):
    """The function a layer runs its forward through when checkpointed: non-reentrant `torch.utils.checkpoint`,
    with the selective per-op context for `op` and `keep_attention`."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode in SELECTIVE:
        context = functools.partial(create_selective_checkpoint_contexts, _save_policy(mode))
        return functools.partial(checkpoint, use_reentrant=False, context_fn=context)
    return functools.partial(checkpoint, use_reentrant=False)


def _checkpointed(function, forward, *args, **kwargs):
    return function(forward, *args, **kwargs)


def _offloaded(function, forward, *args, **kwargs):
    """`_checkpointed`, with the layer's input hidden states (the first positional argument, or `hidden_states`) in
    pinned host memory until the recompute copies them back (CUDA tensors only; elsewhere as `_checkpointed`)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not (hasattr(hidden, "is_cuda") and hidden.is_cuda):
        return function(forward, *args, **kwargs)
    device = hidden.device
    host = _to_host().apply(hidden)

    def on_device(h, *rest, **named):
        return forward(h.to(device, non_blocking=True), *rest, **named)

    if args:
        return function(on_device, host, *args[1:], **kwargs)
    named = dict(kwargs)
    named.pop("hidden_states")
    return function(on_device, host, **named)


@functools.lru_cache(maxsize=1)
def _to_host():
    """The autograd function `_offloaded` copies with (built on first use: torch is imported lazily here)."""
    import torch

    class ToHost(torch.autograd.Function):
        """A copy to pinned host memory whose gradient is copied back to the device (both non-blocking: the copies
        are ordered on the current stream with the kernels that read and write the tensors)."""

        @staticmethod
        def forward(ctx, x):
            ctx.device = x.device
            host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
            host.copy_(x, non_blocking=True)
            return host

        @staticmethod
        def backward(ctx, grad):
            return grad.to(ctx.device, non_blocking=True)

    return ToHost


def describe_memory_helpers(train) -> str:
    """", first N decoder layers" / ", inputs offloaded to host" / ", tiled MLP (N slices)" for what `train` turns on
    (the layer limit where a mode checkpoints decoder layers; offload only where layers are checkpointed whole: not
    off, op or a still unresolved auto); "" for none."""
    mode = train.activation_checkpointing
    offload = train.activation_offload and not pending(mode) and mode not in ("off", "op")
    limit = train.activation_checkpointing_layers
    return ((f", first {limit} decoder layers" if limit is not None and mode not in ("off", "vision") else "")
            + (", inputs offloaded to host" if offload else "")
            + (f", tiled MLP ({train.tiled_mlp} slices)" if train.tiled_mlp != "off" else ""))


def apply_tiled_mlp(layers: list[Any], slices) -> int:
    """Run the MLP (`layer.mlp`) of each decoder layer over `slices` parts of the sequence with DeepSpeed's TiledMLP
    (`deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`); `slices` "off" (or 1) restores one pass. Layers
    without a dense `mlp` (mixture-of-experts blocks, whose forward also returns router logits) are left as they are.
    Each slice runs the MLP's own forward as it was (liger-kernel's SwiGLU where liger patched it), and "off" puts
    that forward back: only the wrapper installed here is ever removed (`_wrap_forward`).
    Returns the number of MLPs tiled. Raises ConfigError without DeepSpeed installed."""
    tiles = 0 if slices in ("off", None) else int(slices)
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    mlps = [m for m in mlps if m is not None and not hasattr(m, "experts") and not hasattr(m, "gate")]
    for mlp in mlps:
        _unwrap_forward(mlp)
    if tiles <= 1:
        return 0
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    except ImportError:
        from vlmctl.errors import ConfigError

        raise ConfigError("train.tiled_mlp uses DeepSpeed's TiledMLP, which is not installed",
                          hint="pip install 'vlmctl[deepspeed]', or set train.tiled_mlp=off") from None
    for mlp in mlps:
        _wrap_forward(mlp, lambda base, mlp=mlp: functools.partial(_tiled, TiledMLP, base, mlp, tiles))
    return len(mlps)


def _tiled(tiled_mlp, forward, mlp, tiles: int, x):
    # each slice needs at least one token; ZeRO-3 reads the parameters to hold their gradients until the last slice
    return tiled_mlp.apply(lambda _mlp, part: forward(part), mlp, x, max(1, min(tiles, x.shape[-2])), list(mlp.parameters()))


# The forward a module had before this file wrapped it: an instance forward installed by someone else (liger-kernel
# binds its SwiGLU / RMSNorm kernels so), or None for the class's own.
_BASE_FORWARD = "_vlmctl_base_forward"


def _wrap_forward(module, make) -> None:
    """Give `module` the forward `make(base)`, where `base` is its current forward (bound); `_unwrap_forward` puts
    `base` back. Wrapping again first unwraps, so wrappers never stack."""
    _unwrap_forward(module)
    own = module.__dict__.get("forward")
    module.__dict__[_BASE_FORWARD] = own
    module.forward = make(own if own is not None else type(module).forward.__get__(module))


def _unwrap_forward(module) -> None:
    """Undo `_wrap_forward` on `module` (nothing when it is not wrapped): another library's forward stays."""
    if _BASE_FORWARD not in module.__dict__:
        return
    own = module.__dict__.pop(_BASE_FORWARD)
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own


def apply_activation_checkpointing(layer_groups: list[list[Any]], mode, offload: bool = False,
                                   layers: int | None = None) -> int:
    """Set `mode` (off, full, op, keep_attention, vision or an integer stride k) on the layers of each group: the
    first group is the language model's decoder layers, the others the vision tower's blocks (callers pass [decoder
    layers, vision blocks]). With a stride, layers 0, k, 2k, ... of each group are checkpointed; `vision`
    checkpoints every layer of the groups after the first and none of the first. `layers` (N, or None for all)
    limits the decoder layers the mode checkpoints to the first N (`train.activation_checkpointing_layers`, see the
    module docstring); the vision blocks follow the mode alone. With `offload`, each checkpointed
    layer's input waits for backward in pinned host memory (`train.activation_offload`; not with `op`, which keeps
    more than the input). Returns the number of layers checkpointed. Raises ValueError for an unknown mode.

    A checkpointed layer gets an instance `forward` that runs its own forward (an instance forward another library
    installed, else the class's) through `checkpoint_function`:
    module hooks stay outside the checkpoint, so FSDP2's pre-forward cast of the inputs to the compute dtype is not
    skipped when backward recomputes the layer (transformers' own layer checkpointing wraps `__call__` in some
    versions, and a recompute then saw fp32 rotary tensors where the forward had bf16 ones).
    """
    if not (mode in MODES or (isinstance(mode, int) and not isinstance(mode, bool) and mode > 0)):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}: use off, full, op, keep_attention, vision or a "
                         "positive integer")
    stride = 1 if mode in ("full", *SELECTIVE, "vision") else (mode if isinstance(mode, int) else 0)
    function = checkpoint_function(mode) if stride else None
    wrapper = _offloaded if offload and mode != "op" else _checkpointed
    count = 0
    for g, group in enumerate(layer_groups):
        for i, layer in enumerate(group):
            _unwrap_forward(layer)  # back to the forward the layer had
            if getattr(layer, "gradient_checkpointing", False):
                layer.gradient_checkpointing = False  # one mechanism only: ours
            limited = g == 0 and layers is not None and i >= layers  # past the first N decoder layers
            if stride and i % stride == 0 and not (mode == "vision" and g == 0) and not limited:
                _wrap_forward(layer, lambda base: functools.partial(wrapper, function, base))
                count += 1
    return count
