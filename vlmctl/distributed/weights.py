"""The weights a rank receives once its model is wrapped, where the ranks share one read of them (rank 0 reads the
weights, the other ranks build the model on the meta device: `vlmctl.train.setup.rank0_loads`, `defer_weights`).

`parallelize` places them after FSDP2 has sharded the model (rank 0 broadcasts its full state dict tensor by tensor
and every rank keeps its shard), or before DDP wraps it (DDP broadcasts rank 0's parameters and buffers itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Modules the CLI's start-up loads anyway are imported next to their use as well.


@dataclass
class DeferredWeights:
    """The weights a rank receives once the model is wrapped, where the ranks share one read (`rank0_loads`).

    `source`: "rank0" (fsdp: `place_weights` broadcasts rank 0's `state` into every rank's shards), "ddp" (DDP's
    construction broadcasts rank 0's parameters and buffers) or "checkpoint" (a resumed run: zeros until the
    resume reads the checkpoint). `state`: rank 0's full state dict of the prepared model under "rank0" (its own
    tensors, no copy), None elsewhere."""

    source: str
    state: dict | None = None


def materialize(model, device, *, zero: bool = False) -> bool:
    """Uninitialized storage (zeros with `zero`) on `device` for the meta parameters and buffers of `model`
    (`nn.Module.to_empty`; FSDP2's sharded parameters get their local shards only). Buffers that hold values
    (computed when the model was built: rotary `inv_freq`, position ids) keep them, and a parameter shared by
    several modules (tied input and output embeddings) stays one parameter: `to_empty` gives each module its own
    copy of a meta parameter. Returns whether anything was on the meta device (False: `model` is left as it is)."""
    import itertools

    import torch

    if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return False
    kept = [(name, buf) for name, buf in model.named_buffers(remove_duplicate=False) if not buf.is_meta]
    shared: dict[int, list[tuple[Any, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                shared.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    if zero:
        with torch.no_grad():
            for tensor in itertools.chain(model.parameters(), model.buffers()):
                tensor.zero_()
    for (first, first_name), *others in shared.values():
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    for name, buf in kept:
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buf.to(device)
    return True


def place_weights(model, deferred: DeferredWeights | None, device) -> None:
    """Give the wrapped model the weights the ranks share (nothing for None): ranks that built it empty get
    storage on `device` (`materialize`); under fsdp rank 0 then broadcasts its full state dict tensor by tensor and
    every rank keeps its shard (`torch.distributed.checkpoint.state_dict.set_model_state_dict` with
    `full_state_dict` and `broadcast_from_rank0`), after which rank 0's full copy is released. A resumed run gets
    zeros here and its weights from the checkpoint. Call it after `apply_fsdp`, or before DDP wraps the model (DDP
    broadcasts rank 0's parameters and buffers when it is built). Collective under fsdp."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if deferred is None:
        return
    materialize(model, device, zero=deferred.source == "checkpoint")
    if deferred.source == "rank0":
        set_model_state_dict(model, deferred.state or {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    deferred.state = None
