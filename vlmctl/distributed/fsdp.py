"""FSDP2 (`fully_shard`) over the data-parallel dimensions of the run's mesh (torchtitan's
`torchtitan/models/llama3/infra/parallelize.py` `apply_fsdp` order: each repeated layer, then the root). On CPU it
runs under gloo as is (accelerate does not do FSDP on CPU; `fully_shard` does).

Hybrid sharding (`train.fsdp_sharding: hybrid`) is `fully_shard` on the 2-D (dp_replicate, dp_shard) mesh: torch's
HSDP, which all-gathers and reduce-scatters along `dp_shard` (the ranks of one node) and all-reduces the gradient
shards along `dp_replicate` (across nodes); see the `mesh` argument of `torch.distributed.fsdp.fully_shard`.

Overlap (`plan_fsdp`, applied by `apply_fsdp`):

- Units: every vision-encoder layer, then every decoder layer (their forward order: the vision tower's output feeds
  the decoder), each its own FSDP group; the root group holds the rest (embeddings, LM head, final norm, projector,
  the vision tower's patch embedding).
- Root and LM head: the root is not resharded after forward (`reshard_after_forward=False`, FSDP2's own rule for the
  root, stated explicitly): the embeddings and the LM head are gathered once per step and kept until their
  backward, which follows the forward at once for the head. The LM head stays in the root rather than in a group of
  its own (torchtitan's `[norm, output]` group): liger-kernel's fused loss reads `lm_head.weight` inside the root's
  forward without calling the head, so a group of its own could hand the loss a sharded weight, and a tied head
  (`tie_word_embeddings`) shares its weight with the embeddings, which FSDP2 allows only inside one group.
- Reshard after forward (`train.fsdp_reshard_after_forward`, `config.plan.resolve_reshard`: the run plan decides it,
  or leaves it to each rank where the gathered layers' size against the rank's memory decides): true frees each layer's gathered
  weights after its forward and gathers them again for backward; the last decoder layer is kept either way (its
  backward comes right after the forward; the FSDP2 `fully_shard` documentation's advice). false keeps every layer
  gathered from its forward to its backward: one all-gather per layer and micro-batch less (a third of FSDP's
  traffic), for the memory of the whole gathered model. auto: true on one rank (nothing to save, a copy to pay),
  false when the shard group is 2 to 8 ranks and the
  gathered layers take at most a quarter of a rank's memory, else true (the reasons are in `resolve_reshard`).
- Prefetch (`train.fsdp_prefetch`, decided by the run plan: `config.plan.resolve_prefetch`;
  `FSDPModule.set_modules_to_forward_prefetch` /
  `set_modules_to_backward_prefetch`, as torchtitan sets them for its MoE models): each unit issues the all-gathers
  of the next N units when its own forward starts (the root: of the first N), and in backward of the N units before
  it that run backward (the root: of the last N). N = 1 overlaps as FSDP2's implicit prefetch does, but issues the
  all-gather earlier from the CPU; N >= 2 keeps up to N + 1 layers gathered at once (more memory) for links too slow
  to hide one layer's all-gather behind one layer's compute. off leaves FSDP2's implicit prefetch.

Neither setting changes the arithmetic: the same weights are gathered and the same gradients reduced
(`tests/unit/test_fsdp_overlap.py` checks loss and gradients equal across them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vlmctl.config.plan import pending, resolve_prefetch, resolve_reduce_dtype, resolve_reshard

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

PLAN_ATTR = "vlmctl_fsdp_plan"  # where `apply_fsdp` leaves its FsdpPlan on the root module (`fsdp_plan_of`)
RESHARD_ATTR = "vlmctl_reshard_after_forward"  # each unit's own rule (`shard_unit`), which torch has no getter for


def shard_mesh(mesh):
    """The part of `mesh` FSDP2 shards over: `dp_shard`, or (`dp_replicate`, `dp_shard`) when both exist (HSDP:
    replicated across the first, sharded along the second). With sequence parallelism (an `sp` dimension) the
    shards span `dp_shard` x `sp` (`ParallelDims.build_mesh` flattens them as `dp_shard_sp`): the sequence ranks
    hold different gradients of the same weights. A mesh without named dimensions is used as is."""
    names = mesh.mesh_dim_names or ()
    if "dp_shard" not in names:
        return mesh
    shard = "dp_shard_sp" if "sp" in names else "dp_shard"
    if "dp_replicate" in names:
        return mesh["dp_replicate", shard]
    return mesh[shard]


@dataclass
class FsdpPlan:
    """How `apply_fsdp` wrapped a model: `reshard_after_forward` of the layers (the last decoder layer is kept
    either way), `prefetch` (layers whose all-gathers are issued ahead; 0 = FSDP2's implicit prefetch), the shard
    group's size in ranks, the gathered layers' size and the rank's memory in GiB, why (`reason`), and the unit
    names of each unit's forward and backward prefetch lists (`forward` / `backward`, the root as "root")."""

    reshard_after_forward: bool
    prefetch: int
    shard_ranks: int
    gathered_gib: float
    memory_gib: float
    reason: str
    forward: dict[str, list[str]] = field(default_factory=dict)
    backward: dict[str, list[str]] = field(default_factory=dict)
    reduce_dtype: str = "fp32"
    reduce_reason: str = ""

    def describe(self) -> str:
        """One line for reports: e.g. `reshard after forward false (auto: ...), prefetch 1 layer, gradients reduced
        in bf16 (auto: ...)`."""
        what = "off (FSDP2's implicit)" if self.prefetch == 0 else f"{self.prefetch} layer{'s' * (self.prefetch > 1)}"
        line = f"reshard after forward {str(self.reshard_after_forward).lower()} ({self.reason}), prefetch {what}"
        return line + (f", gradients reduced in {self.reduce_dtype} ({self.reduce_reason})" if self.reduce_reason else "")


def gathered_bytes(units: list[Any], param_dtype=None) -> int:
    """Bytes of the units' parameters once gathered for compute: floating-point parameters in `param_dtype` (when
    given), others in their own dtype. A tensor-parallel parameter (a DTensor before FSDP2 wraps it) counts this
    rank's slice: FSDP2 gathers it over the data-parallel ranks only."""
    total = 0
    for unit in units:
        for param in unit.parameters():
            size = param.element_size()
            if param_dtype is not None and param.is_floating_point():
                size = param_dtype.itemsize
            total += (param.to_local() if hasattr(param, "to_local") else param).numel() * size
    return total


def rank_memory_bytes(device_type: str) -> int:
    """The memory one rank may use, agreed over all ranks (the smallest; the layers' policy must be the same on
    every rank or their collectives would not match): the GPU's total memory, on CPU the machine's memory divided
    among this node's processes (`LOCAL_WORLD_SIZE`)."""
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        mine = torch.cuda.get_device_properties(device).total_memory
    else:
        device = torch.device("cpu")
        mine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor([mine], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        mine = int(value.item())
    return int(mine)


def _runs_backward(units: list[Any], n_vision: int) -> list[bool]:
    """Per unit, whether its backward runs (only those are worth a backward prefetch): a decoder layer always (some
    part before or in the decoder trains in every stage); a vision layer when it or an earlier one has a parameter
    that trains (a frozen tower gets no backward)."""
    out, seen = [], False
    for i, unit in enumerate(units):
        seen = seen or any(p.requires_grad for p in unit.parameters())
        out.append(seen if i < n_vision else True)
    return out


def prefetch_lists(units: list[Any], n_vision: int, prefetch: int, *, backward: bool) -> tuple[dict, dict]:
    """The forward and backward prefetch targets (unit indices; key -1 is the root) for `prefetch` layers ahead:
    forward, each unit the next `prefetch` units and the root the first ones; backward (with `backward`, i.e. when
    layers are resharded), each unit the `prefetch` units before it that run backward (`_runs_backward`) and the
    root the last resharded ones (the last unit is kept gathered), issued while the LM head runs its backward."""
    if prefetch < 1 or not units:
        return {}, {}
    forward = {-1: list(range(min(prefetch, len(units))))}
    forward.update({i: list(range(i + 1, min(i + 1 + prefetch, len(units)))) for i in range(len(units) - 1)})
    back: dict[int, list[int]] = {}
    if backward:
        runs = _runs_backward(units, n_vision)
        order = [i for i in reversed(range(len(units))) if runs[i]]  # backward execution order
        back[-1] = [i for i in order if i != len(units) - 1][:prefetch]
        back.update({i: order[k + 1:k + 1 + prefetch] for k, i in enumerate(order)})
    return ({k: v for k, v in forward.items() if v}, {k: v for k, v in back.items() if v})


def plan_fsdp(parts: Any, mesh, *, param_dtype=None, reshard_after_forward: bool | str = "auto",
              prefetch: int | str = "auto", reduce_dtype: str = "fp32", master_weights: str = "fp32") -> FsdpPlan:
    """Resolve the settings for `parts` (a `setup.ModelParts`) on `mesh` without wrapping anything: reshard after
    forward (`resolve_reshard`, with the shard group's size, the layers' gathered size in `param_dtype` and the
    rank's memory agreed over the ranks, a collective on auto), the prefetch lists (`prefetch_lists`) and, with a
    `param_dtype` below fp32, the gradients' reduction dtype (`resolve_reduce_dtype`). Call it on every rank.
    Raises ConfigError for a value that is not a setting."""
    units = [*parts.vision_layers, *parts.decoder_layers]
    layers = resolve_prefetch(prefetch)
    ranks = int(shard_mesh(mesh).shape[-1])
    size = gathered_bytes(units, param_dtype)
    memory = rank_memory_bytes(mesh.device_type) if pending(reshard_after_forward) else 0  # the plan left it to the rank
    reshard, reason = resolve_reshard(reshard_after_forward, shard_ranks=ranks, gathered_bytes=size, memory_bytes=memory)
    forward, backward = prefetch_lists(units, len(parts.vision_layers), layers, backward=reshard)
    names = _unit_names(parts)
    named = lambda lists: {names.get(k, "root"): [names[i] for i in v] for k, v in lists.items()}  # noqa: E731
    reduce, why = resolve_reduce_dtype(reduce_dtype, master_weights)
    if param_dtype is None or param_dtype.itemsize >= 4:  # no mixed precision: gradients reduce in their own dtype
        reduce, why = "fp32", ""
    return FsdpPlan(reshard_after_forward=reshard, prefetch=layers, shard_ranks=ranks, gathered_gib=size / 2**30,
                    memory_gib=memory / 2**30, reason=reason, forward=named(forward), backward=named(backward),
                    reduce_dtype=reduce, reduce_reason=why)


def _unit_names(parts: Any) -> dict[int, str]:
    n = len(parts.vision_layers)
    return {i: (f"vision.{i}" if i < n else f"decoder.{i - n}") for i in range(n + len(parts.decoder_layers))}


def apply_fsdp(model, parts: Any, mesh, *, param_dtype=None, reshard_after_forward: bool | str = "auto",
               prefetch: int | str = "auto", reduce_dtype: str = "fp32", master_weights: str = "fp32"):
    """`fully_shard` each vision-encoder layer and decoder layer of `parts` (a `setup.ModelParts`), then the root,
    over `shard_mesh(mesh)`, with the overlap of the module docstring. Call it on every rank, after activation
    checkpointing and torch.compile were applied to the layers.

    With `param_dtype` (bf16 on GPU) parameters are gathered in that dtype for compute while gradients are
    reduced in the dtype `reduce_dtype` (`train.fsdp_reduce_dtype`: auto, fp32, bf16; auto by `master_weights`,
    `resolve_reduce_dtype`) names (`MixedPrecisionPolicy(param_dtype, reduce_dtype)`). `reshard_after_forward`
    (`train.fsdp_reshard_after_forward`: auto, true, false) and `prefetch` (`train.fsdp_prefetch`: auto, off or a
    number of layers) are resolved by `plan_fsdp`; the plan is left on the model (`fsdp_plan_of`). Returns the
    model (sharded in place). Raises ConfigError for a value that is not a setting.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plan = plan_fsdp(parts, mesh, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                     reduce_dtype=reduce_dtype, master_weights=master_weights)
    dp_mesh = shard_mesh(mesh)
    if param_dtype not in (None, torch.float32):
        mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=torch.bfloat16 if plan.reduce_dtype == "bf16" else torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    units = [*parts.vision_layers, *parts.decoder_layers]
    for i, layer in enumerate(units):
        keep = i == len(units) - 1  # the last layer's backward follows its forward at once
        shard_unit(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=plan.reshard_after_forward and not keep)
    shard_unit(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    _set_prefetch(model, units, plan, _unit_names(parts))
    setattr(model, PLAN_ATTR, plan)
    return model


def shard_unit(module, *, reshard_after_forward: bool, **kwargs: Any):
    """`torch.distributed.fsdp.fully_shard(module, reshard_after_forward=..., **kwargs)`, with the rule recorded on
    the module (`reshard_rule_of`): code that changes it for a while (`FSDPModule.set_reshard_after_forward`, e.g.
    generation keeping every unit gathered) can put it back. Returns the module."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, reshard_after_forward=reshard_after_forward, **kwargs)
    setattr(module, RESHARD_ATTR, bool(reshard_after_forward))
    return module


def reshard_rule_of(module) -> bool | None:
    """The reshard-after-forward rule `shard_unit` gave `module`, or None for a module it did not shard."""
    return getattr(module, RESHARD_ATTR, None)


def _set_prefetch(model, units: list[Any], plan: FsdpPlan, names: dict[int, str]) -> None:
    """Hand the plan's prefetch lists (unit names) to the FSDP modules."""
    index = {name: i for i, name in names.items()}
    module = lambda name: model if name == "root" else units[index[name]]  # noqa: E731
    for name, targets in plan.forward.items():
        module(name).set_modules_to_forward_prefetch([module(t) for t in targets])
    for name, targets in plan.backward.items():
        module(name).set_modules_to_backward_prefetch([module(t) for t in targets])


def fsdp_plan_of(model) -> FsdpPlan | None:
    """The FsdpPlan `apply_fsdp` used for `model` (the module it returned), or None for a model it did not wrap."""
    return getattr(model, PLAN_ATTR, None)
