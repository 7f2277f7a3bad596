"""The parallel dimensions of a run and its one device mesh (modelled on torchtitan's
`torchtitan/distributed/parallel_dims.py`).

The world is split, outermost first, into data-parallel replicas (`dp_replicate`: DDP, or HSDP's replicas), data-
parallel shards (`dp_shard`: FSDP2 / ZeRO), sequence-parallel ranks (`sp`) and tensor-parallel ranks (`tp`, the
innermost: neighbouring ranks share the fastest links). One `DeviceMesh` with the dimensions larger than one is
built per run; the data-parallel ranks (`dp_replicate x dp_shard`) are the ones a batch is split over and the loss
is reduced over.

Tensor parallelism (`train.tensor_parallel`, `vlmctl.distributed.tensor_parallel`): the `tp` ranks of a group read
the same batch and each computes its share of every decoder layer (heads, MLP slices, vocabulary). They are not
data-parallel ranks, and they hold different parameters (their shards): FSDP2 shards over `dp_shard` only, each
parameter a DTensor on the 2-D (dp_shard, tp) mesh. `dp = world / (sp x tp)`.

Sequence parallelism (`train.sequence_parallel`, `vlmctl.distributed.sequence`): the `sp` ranks of a group read the
same batch and split each row along the sequence. They are not data-parallel ranks (the sampler deals over
`dp_mesh`), but they hold different gradients of the same weights: the gradients are reduced, and FSDP2 / ZeRO
shard, over every data-parallel and sequence-parallel rank (`grad_mesh`; FSDP2's `dp_shard_sp`, torchtitan's
`dp_shard_cp`).

Hybrid sharding (`train.fsdp_sharding: hybrid`, HSDP) puts the nodes on `dp_replicate` and the processes of one node
on `dp_shard`: torchrun numbers the ranks node by node (global rank = node's group rank x processes per node + local
rank), so the row-major mesh keeps every shard group inside one node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vlmctl.distributed.engine import is_deepspeed, is_fsdp
from vlmctl.errors import ConfigError

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Light vlmctl modules are imported next to their use as well.

DIM_NAMES = ("dp_replicate", "dp_shard", "sp", "tp")
DP_DIMS = ("dp_replicate", "dp_shard")
SHARDINGS = ("full", "hybrid")
# train.fsdp_sharding as the launcher hands it to the ranks (`train.launch.rank_env`)
SHARDING_ENV = "VLMCTL_FSDP_SHARDING"


@dataclass
class ParallelDims:
    """Sizes of the parallel dimensions; their product must be `world_size`. `dp_shard=-1` takes what is left of
    the world. `hsdp`: FSDP2 runs on the (dp_replicate, dp_shard) mesh even where `dp_shard` is 1 (hybrid sharding
    with one process per node). Raises ConfigError for a size below 1, tp with sp, or a product that is not the
    world."""

    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1
    tp: int = 1
    world_size: int = 1
    hsdp: bool = False
    _mesh: Any = field(default=None, init=False, repr=False)
    _dp_mesh: Any = field(default=None, init=False, repr=False)
    _grad_mesh: Any = field(default=None, init=False, repr=False)
    _fsdp_mesh: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def for_strategy(cls, strategy: str, world_size: int, *, sharding: str | None = None,
                     ranks_per_node: int | None = None, sp: int = 1, tp: int = 1) -> "ParallelDims":
        """ddp replicates the model on every rank (`dp_replicate = world`); fsdp, zero2 and zero3 shard it
        (`dp_shard = world`); fsdp with `sharding="hybrid"` (`train.fsdp_sharding`) shards it over the ranks of a
        node and replicates it across nodes (`dp_replicate = world / ranks_per_node`, `dp_shard = ranks_per_node`:
        HSDP, as torchtitan's `data_parallel_replicate_degree`). `sp` (`train.sequence_parallel`) ranks of
        each group split the sequence, `tp` (`train.tensor_parallel`) ranks each decoder layer: the data-parallel
        sizes are the world divided by `sp x tp`.

        `sharding` None: the launcher's `VLMCTL_FSDP_SHARDING`, else full. `ranks_per_node` None: torchrun's
        `LOCAL_WORLD_SIZE`, else the world (one node). Raises ConfigError for an unknown sharding, hybrid with
        another strategy than fsdp, and what `check_nodes_agree` and `check_tensor_split` raise.
        """
        sharding = sharding or os.environ.get(SHARDING_ENV) or "full"
        if sharding not in SHARDINGS:
            raise ConfigError(f"train.fsdp_sharding = {sharding!r} is not one of {', '.join(SHARDINGS)}",
                              hint="set train.fsdp_sharding to full or hybrid")
        if sharding == "hybrid" and not is_fsdp(strategy):
            raise ConfigError(f"train.fsdp_sharding=hybrid needs train.strategy=fsdp, not {strategy}",
                              hint="set train.strategy=fsdp, or train.fsdp_sharding=full")
        per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        check_nodes_agree(world_size, sharding, per_node)
        check_sequence_split(world_size, sp, per_node)
        check_tensor_split(strategy, world_size, tp, per_node, sp=sp, sharding=sharding)
        if sharding == "hybrid":
            nodes = world_size // per_node
            return cls(dp_replicate=nodes, dp_shard=per_node // sp, sp=sp, world_size=world_size, hsdp=nodes > 1)
        if is_fsdp(strategy) or is_deepspeed(strategy):  # the weights or their optimizer state are sharded
            return cls(dp_replicate=1, dp_shard=world_size // (sp * tp), sp=sp, tp=tp, world_size=world_size)
        return cls(dp_replicate=world_size // (sp * tp), dp_shard=1, sp=sp, tp=tp, world_size=world_size)

    def _validate(self) -> None:
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "sp": self.sp, "tp": self.tp}
        if self.world_size < 1:
            raise ConfigError(f"the world size must be at least 1, got {self.world_size}")
        for name, size in sizes.items():
            if size < 1 and not (name == "dp_shard" and size == -1):
                raise ConfigError(f"parallel dimension {name}={size} must be at least 1 (dp_shard=-1: the rest of the world)")
        if self.tp > 1 and self.sp > 1:
            raise ConfigError(f"tensor parallelism (tp={self.tp}) and sequence parallelism (sp={self.sp}) are not combined",
                              hint="set train.tensor_parallel: 1 or train.sequence_parallel: 1")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.sp * self.tp
            if self.world_size % rest:
                raise ConfigError(f"dp_replicate={self.dp_replicate} x sp={self.sp} x tp={self.tp} = {rest} does not "
                                  f"divide the {self.world_size} processes", hint="launch a multiple of that many processes")
            self.dp_shard = self.world_size // rest
        product = self.dp_replicate * self.dp_shard * self.sp * self.tp
        if product != self.world_size:
            raise ConfigError(f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x sp={self.sp} x tp={self.tp} "
                              f"= {product}, but the world has {self.world_size} processes",
                              hint="launch as many processes as the product (nproc_per_node x nnodes), or change the sizes")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: replicas x shards (the ranks a global batch is split over)."""
        return self.dp_replicate * self.dp_shard

    def mesh_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(names, sizes) of the mesh: the dimensions larger than one, outermost first; `dp_shard` is kept when no
        data-parallel dimension is larger than one, so that the mesh always has a data-parallel dimension, for
        `hsdp`, so that FSDP2 replicates across `dp_replicate`, and with sequence parallelism (flattened with `sp`)."""
        sizes = dict(zip(DIM_NAMES, (self.dp_replicate, self.dp_shard, self.sp, self.tp)))
        names = tuple(n for n in DIM_NAMES
                      if sizes[n] > 1 or (n == "dp_shard" and (self.dp_replicate == 1 or self.hsdp or self.sp > 1)))
        return names, tuple(sizes[n] for n in names)

    def build_mesh(self, device_type: str):
        """Build (once) and return the run's `DeviceMesh` over the default process group, which must be
        initialized (`env.init_distributed`). `device_type`: "cuda" or "cpu" (gloo)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            names, shape = self.mesh_dims()
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            dp = [n for n in DP_DIMS if n in names]
            # both data-parallel dimensions (HSDP): one flattened group over all of them, as torchtitan does
            self._dp_mesh = mesh[dp[0]] if len(dp) == 1 else mesh[tuple(dp)]._flatten("dp")
            self._grad_mesh = self._dp_mesh
            self._fsdp_mesh = None  # `fsdp.shard_mesh(mesh)`
            if self.sp > 1:
                # FSDP2 / ZeRO shard over the sequence ranks too; flattened meshes are kept here, not sliced again
                # from the root mesh (deprecated)
                shards = mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
                self._fsdp_mesh = mesh["dp_replicate", "dp_shard_sp"] if self.hsdp else shards
                self._grad_mesh = mesh[(*dp, "sp")]._flatten("dp_sp")
            self._mesh = mesh
        return self._mesh

    @property
    def world_mesh(self):
        """The mesh of `build_mesh`. Raises RuntimeError before it is built."""
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    @property
    def dp_mesh(self):
        """The 1-D data-parallel mesh (dp_replicate x dp_shard flattened)."""
        self.world_mesh  # noqa: B018 - raises before build_mesh
        return self._dp_mesh

    @property
    def grad_mesh(self):
        """The 1-D mesh of every rank gradients are reduced over: the data-parallel ranks and, with sequence
        parallelism, their sequence-parallel ranks (`dp_sp`); equal to `dp_mesh` otherwise."""
        self.world_mesh  # noqa: B018 - raises before build_mesh
        return self._grad_mesh

    @property
    def fsdp_mesh(self):
        """The mesh FSDP2 shards over (`fsdp.shard_mesh` of the world mesh): `dp_shard`, (`dp_replicate`,
        `dp_shard`) for HSDP, and with sequence parallelism `dp_shard_sp` (or (`dp_replicate`, `dp_shard_sp`))."""
        from vlmctl.distributed.fsdp import shard_mesh

        return self._fsdp_mesh if self._fsdp_mesh is not None else shard_mesh(self.world_mesh)

    @property
    def grad_size(self) -> int:
        """Ranks gradients are averaged over (`grad_mesh`): data-parallel x sequence-parallel."""
        return self.dp_size * self.sp

    @property
    def tp_mesh(self):
        """The 1-D tensor-parallel mesh of this rank's group (None without tensor parallelism)."""
        return self.world_mesh["tp"] if self.tp > 1 else None

    @property
    def sp_group(self):
        """The sequence-parallel process group of this rank (None without sequence parallelism)."""
        return self.world_mesh["sp"].get_group() if self.sp > 1 else None

    @property
    def sp_rank(self) -> int:
        """This rank's index in its sequence-parallel group (0 without sequence parallelism)."""
        return self.world_mesh["sp"].get_local_rank() if self.sp > 1 else 0

    @property
    def dp_group(self):
        """The data-parallel process group (the default group while dp size equals the world)."""
        return self.dp_mesh.get_group()

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which part of the batch it reads)."""
        return self.dp_mesh.get_local_rank()


def check_sequence_split(world_size: int, sp: int, per_node: int) -> None:
    """Raise ConfigError unless `sp` (`train.sequence_parallel`) ranks per group divide the processes of a node
    (a group's all-to-alls stay on the fast links inside one node)."""
    if sp < 1:
        raise ConfigError(f"train.sequence_parallel={sp} must be at least 1")
    if sp > 1 and (per_node % sp or world_size % sp):
        raise ConfigError(f"train.sequence_parallel={sp} does not divide the {per_node} processes per node "
                          f"({world_size} in all)", hint=f"launch a multiple of {sp} processes per node, or lower train.sequence_parallel")


def check_tensor_split(strategy: str, world_size: int, tp: int, per_node: int, *, sp: int = 1,
                       sharding: str = "full") -> None:
    """Raise ConfigError unless `tp` (`train.tensor_parallel`) ranks per group divide the processes of a node (a
    group's all-reduces run after every attention and MLP: they stay on the fast links inside one node) and the
    strategy can hold tensor-parallel (DTensor) parameters: FSDP2 with full sharding, or no data parallelism
    (`ddp` with every process in one tp group)."""
    if tp < 1:
        raise ConfigError(f"train.tensor_parallel={tp} must be at least 1")
    if tp == 1:
        return
    if per_node % tp or world_size % tp:
        raise ConfigError(f"train.tensor_parallel={tp} does not divide the {per_node} processes per node "
                          f"({world_size} in all)", hint=f"launch a multiple of {tp} processes per node, or lower train.tensor_parallel")
    if sp > 1:
        raise ConfigError(f"train.tensor_parallel={tp} and train.sequence_parallel={sp} are not combined",
                          hint="set one of them to 1")
    if is_deepspeed(strategy):
        raise ConfigError(f"train.tensor_parallel={tp} needs train.strategy=fsdp (DeepSpeed's ZeRO does not take "
                          "DTensor parameters)", hint="set train.strategy: fsdp")
    if sharding == "hybrid":
        raise ConfigError(f"train.tensor_parallel={tp} runs with train.fsdp_sharding: full",
                          hint="set train.fsdp_sharding: full")
    if not is_fsdp(strategy) and world_size > tp:
        raise ConfigError(f"train.tensor_parallel={tp} with {world_size // tp} data-parallel groups needs "
                          f"train.strategy=fsdp (DDP does not take DTensor parameters)", hint="set train.strategy: fsdp")


def check_nodes_agree(world_size: int, sharding: str, per_node: int) -> None:
    """Raise ConfigError (on every rank) unless all ranks build the same mesh: the same `sharding` everywhere (each
    node's launcher hands its own `train.fsdp_sharding` to its ranks) and, for hybrid, nodes of `per_node` ranks
    each. The ranks' values are gathered over the default process group when one of `world_size` ranks is
    initialized (one small collective at start-up), else only this rank's are checked."""
    import torch.distributed as dist

    mine = (sharding, per_node)
    found = [mine]
    if world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        found = [None] * world_size
        dist.all_gather_object(found, mine)
    shardings, sizes = sorted({s for s, _ in found}), sorted({n for _, n in found})
    if len(shardings) > 1:
        raise ConfigError(f"train.fsdp_sharding differs between the nodes of this run: {' and '.join(shardings)}",
                          hint="start every node with the same train.fsdp_sharding")
    if sharding == "hybrid" and (len(sizes) > 1 or per_node < 1 or world_size % per_node):
        raise ConfigError(f"train.fsdp_sharding=hybrid needs the same number of processes on every node; the "
                          f"{world_size} ranks run {' and '.join(map(str, sizes))} per node",
                          hint="launch the same train.nproc_per_node on every node, or set train.fsdp_sharding=full")
