"""Activation checkpointing of the decoder layers and vision blocks (`train.activation_checkpointing`).

Modes (torchtitan's `full` and `selective` modes, `torchtitan/models/llama3/infra/parallelize.py`):

- `off`: every activation is kept for the backward pass.
- `full`: each layer keeps only its input; its forward runs again in the backward pass (about a third more compute).
- an integer k: every k-th layer of the language model and of the vision tower is checkpointed (selective per layer:
  memory and extra compute in between off and full).
- `op`: every layer is checkpointed, but the outputs of its matrix multiplications and attention kernels are kept
  (selective per op, `torch.utils.checkpoint.create_selective_checkpoint_contexts`): the backward pass recomputes
  only the cheap elementwise work (norms, activations, rotary).

A mode only gives the chosen layers an instance `forward` that runs through `torch.utils.checkpoint` (any
`nn.Module` works), so parameter names, FSDP2 units and checkpoints stay the same and a mode can be changed on a
wrapped model (the start-up probe does).
"""

from __future__ import annotations

import functools
from typing import Any

MODES = ("off", "full", "op")  # plus a positive integer k


def describe(mode) -> str:
    """A short label for a mode: "off", "full", "op (selective)" or "every 2nd layer"."""
    if mode == "op":
        return "op (selective)"
    if isinstance(mode, int) and not isinstance(mode, bool):
        if mode == 1:
            return "full"
        suffix = {2: "nd", 3: "rd"}.get(mode, "th")
        return f"every {mode}{suffix} layer"
    return str(mode)


def _op_policy():
    """Save the outputs of matmuls and attention kernels, recompute the rest (torchtitan's `_save_list` policy)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"):
        op = getattr(aten, name, None)
        if op is not None:
            save.add(op.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_function(mode):
    """The function a layer runs its forward through when checkpointed: non-reentrant `torch.utils.checkpoint`,
    with the selective per-op context for `op`."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "op":
        context = functools.partial(create_selective_checkpoint_contexts, _op_policy())
        return functools.partial(checkpoint, use_reentrant=False, context_fn=context)
    return functools.partial(checkpoint, use_reentrant=False)


def _checkpointed(function, forward, *args, **kwargs):
    return function(forward, *args, **kwargs)


def apply_activation_checkpointing(layer_groups: list[list[Any]], mode) -> int:
    """Set `mode` (off, full, op or an integer stride k) on the layers of each group (the decoder layers, the vision
    blocks); with a stride, layers 0, k, 2k, ... of each group are checkpointed. Returns the number of layers
    checkpointed. Raises ValueError for an unknown mode.

    A checkpointed layer gets an instance `forward` that runs its class's forward through `checkpoint_function`:
    module hooks stay outside the checkpoint, so FSDP2's pre-forward cast of the inputs to the compute dtype is not
    skipped when backward recomputes the layer (transformers' own layer checkpointing wraps `__call__` in some
    versions, and a recompute then saw fp32 rotary tensors where the forward had bf16 ones).
    """
    if not (mode in MODES or (isinstance(mode, int) and not isinstance(mode, bool) and mode > 0)):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}: use off, full, op or a positive integer")
    stride = 1 if mode in ("full", "op") else (mode if isinstance(mode, int) else 0)
    function = checkpoint_function(mode) if stride else None
    count = 0
    for layers in layer_groups:
        for i, layer in enumerate(layers):
            layer.__dict__.pop("forward", None)  # back to the class's forward
            if getattr(layer, "gradient_checkpointing", False):
                layer.gradient_checkpointing = False  # one mechanism only: ours
            if stride and i % stride == 0:
                layer.forward = functools.partial(_checkpointed, function, type(layer).forward.__get__(layer))
                count += 1
    return count
