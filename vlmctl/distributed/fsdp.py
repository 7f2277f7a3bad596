"""FSDP2 (`fully_shard`) over the data-parallel dimensions of the run's mesh (torchtitan's
`torchtitan/distributed/fsdp.py` order: each repeated layer, then the root). On CPU it runs under gloo as is
(accelerate does not do FSDP on CPU; `fully_shard` does).

Hybrid sharding (`train.fsdp_sharding: hybrid`) is `fully_shard` on the 2-D (dp_replicate, dp_shard) mesh: torch's
HSDP, which all-gathers and reduce-scatters along `dp_shard` (the ranks of one node) and all-reduces the gradient
shards along `dp_replicate` (across nodes); see the `mesh` argument of `torch.distributed.fsdp.fully_shard`."""

from __future__ import annotations

from typing import Any


def shard_mesh(mesh):
    """The part of `mesh` FSDP2 shards over: `dp_shard`, or (`dp_replicate`, `dp_shard`) when both exist (HSDP:
    replicated across the first, sharded along the second). A mesh without named dimensions is used as is."""
    names = mesh.mesh_dim_names or ()
    if "dp_shard" not in names:
        return mesh
    if "dp_replicate" in names:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def apply_fsdp(model, parts: Any, mesh, *, param_dtype=None, reshard_after_forward: bool = True):
    """`fully_shard` each vision-encoder layer and decoder layer of `parts` (a `setup.ModelParts`), then the root,
    over `shard_mesh(mesh)`. Call it after activation checkpointing and torch.compile were applied to the layers.

    With `param_dtype` (bf16 on GPU) parameters are gathered in that dtype for compute while gradients are
    reduced in fp32 (`MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`). `reshard_after_forward`
    (`train.fsdp_reshard_after_forward`) frees each layer's gathered weights after its forward (gathered again
    for backward); false trades memory for one all-gather less per layer and step. Returns the model (sharded in
    place).
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_mesh = shard_mesh(mesh)
    if param_dtype not in (None, torch.float32):
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for layer in [*parts.vision_layers, *parts.decoder_layers]:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model
