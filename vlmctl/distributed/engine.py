"""The training engine of a rank: what differs between the torch strategies (ddp, fsdp) and DeepSpeed (zero2,
zero3) behind one protocol, so that the step loop, validation, checkpoints and the export never ask which one runs.

An `Engine` holds the model as `distributed.parallelize.parallelize` left it (DDP / FSDP2 wrapped, or handed to
DeepSpeed), its optimizer and LR schedule, and does:

- `forward(objective, batch)`: the objective's loss (`train.objectives.Objective.loss`) of one micro-batch run
  through the engine's root module (its hooks run) under the engine's precision (torch's autocast outside FSDP2,
  whose `MixedPrecisionPolicy` casts itself; DeepSpeed's module in its own dtype, pixel values cast to it);
- `sync(last)`, `backward(loss, scale)`, `micro_step()`, `step(skip)`: gradient accumulation over a window, the
  scaled backward, and the optimizer step (gradient clipping, a skipped step) with its gradient norm;
- `lr`, `save(folder, step)`, `load(folder)`, `gather(rank, dtype)`: the learning rate, checkpoints (torch DCP or
  DeepSpeed's own layout) and the full state dict for the export;
- `step_hooks`: callables run after every optimizer step that changed the weights and after a checkpoint is
  loaded (what follows the weights: the float8 weights' scales, `distributed.float8.scale_hook`).

This module is also the one place that reads a strategy's name (`strategy_of`): every other module asks the
`Strategy` it returns (`tests/unit/test_strategy_tests.py` enforces it).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from vlmctl.distributed.float8 import high_precision, scale_hook
from vlmctl.distributed.fsdp import reshard_rule_of
from vlmctl.errors import ConfigError

# torch, DeepSpeed and the modules built on them are imported inside the functions that use them: importing
# vlmctl (the CLI's start-up) must not pay for them.

TORCH_STRATEGIES = ("ddp", "fsdp")
DEEPSPEED_STAGES = {"zero2": 2, "zero3": 3}


@dataclass(frozen=True)
class Strategy:
    """What a data-parallel strategy name means to the rest of the code.

    `fsdp`: FSDP2 shards the weights (and computes in its own mixed precision); `ddp`: DDP replicates them;
    `deepspeed`: DeepSpeed's engine runs it, ZeRO stage `zero_stage`; `shards`: the weights or optimizer state are
    split over the data-parallel ranks (the mesh's `dp_shard` dimension)."""

    name: str
    fsdp: bool = False
    ddp: bool = False
    zero_stage: int | None = None

    @property
    def deepspeed(self) -> bool:
        return self.zero_stage is not None

    @property
    def shards(self) -> bool:
        return self.fsdp or self.deepspeed

    @property
    def checkpoint_format(self) -> str:
        """"deepspeed" (`engine.save_checkpoint`'s layout) or "dcp" (torch.distributed.checkpoint)."""
        return "deepspeed" if self.deepspeed else "dcp"


def strategy_of(name: str) -> Strategy:
    """The `Strategy` of a resolved `train.strategy` (ddp, fsdp, zero2, zero3). Raises ConfigError for another
    name (`auto` must be resolved first)."""
    if name in DEEPSPEED_STAGES:
        return Strategy(name, zero_stage=DEEPSPEED_STAGES[name])
    if name in TORCH_STRATEGIES:
        return Strategy(name, fsdp=name == "fsdp", ddp=name == "ddp")
    raise ConfigError(f"train.strategy = {name!r} is not one of {', '.join((*TORCH_STRATEGIES, *DEEPSPEED_STAGES))}",
                      hint="set train.strategy to ddp, fsdp, zero2 or zero3 (or auto before the run starts)")


def is_deepspeed(name: str) -> bool:
    """Whether `train.strategy` (`auto` included, which never resolves to DeepSpeed) runs under DeepSpeed."""
    return name in DEEPSPEED_STAGES


def is_torch(name: str) -> bool:
    """Whether `train.strategy` is a resolved torch strategy (ddp, fsdp); False for `auto`."""
    return name in TORCH_STRATEGIES


def is_fsdp(name: str) -> bool:
    """Whether `train.strategy` is fsdp (FSDP2); False for `auto`."""
    return name == "fsdp"


def is_ddp(name: str) -> bool:
    """Whether `train.strategy` is ddp; False for `auto`."""
    return name == "ddp"


@runtime_checkable
class Engine(Protocol):
    """One rank's model, optimizer and schedule for a strategy (see the module docstring).

    `model`: the root module a forward goes through (DDP / FSDP2 module, DeepSpeed engine); `module`: the model
    under it (HF or peft); `params`: the trained parameters; `checkpoint_format`: "dcp" or "deepspeed";
    `reshards`: whether a checkpoint can be loaded on another number of ranks; `none_norm_skips`: whether a step
    that returns no gradient norm left the weights as they were (torch: the update is skipped for a non-finite
    norm; DeepSpeed steps at the window's boundary whatever the norm); `step_hooks`: see the module docstring."""

    model: Any
    optimizer: Any
    scheduler: Any
    params: list
    step_hooks: list
    checkpoint_format: str
    reshards: bool
    none_norm_skips: bool

    @property
    def module(self) -> Any: ...

    def inputs(self, batch: dict[str, Any]) -> dict[str, Any]: ...

    def forward(self, objective, batch: dict[str, Any]): ...

    def sync(self, last: bool): ...

    def backward(self, loss, scale: float) -> None: ...

    def micro_step(self) -> None: ...

    def step(self, skip: bool) -> float | None: ...

    @property
    def lr(self) -> float: ...

    def save(self, folder, step: int) -> None: ...

    def load(self, folder) -> None: ...

    def gather(self, rank: int, dtype=None) -> dict | None: ...


def grad_norm_tensor(params):
    """The 2-norm over the gradients of `params` (those that have one) as a plain 0-d tensor on their device, without
    a host sync (FSDP2's DTensor norm is all-reduced into a full tensor). Gradients on different meshes (tensor
    parallelism under FSDP2: the split layers' on (dp_shard, tp), the others' on dp_shard) are normed per mesh, each
    norm gathered, then combined (torchtitan's `clip_grad_norm_` does the same)."""
    import torch

    groups = {mesh: [p.grad for p in group] for mesh, group in _by_mesh(params).items()}
    if len(groups) <= 1:
        grads = next(iter(groups.values()), [])
        total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        return total.full_tensor() if hasattr(total, "full_tensor") else total
    norms = [torch.nn.utils.get_total_norm(grads) for grads in groups.values()]
    return torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]).norm()


class HostValues:
    """A tensor's values as they stand at this point of the device's stream, on their way to the host: copied into
    pinned host memory without a host sync, so that reading them does not wait for work queued after the copy (the
    optimizer's update, the next step's forward). `get()` waits for that copy alone (a CUDA event) and returns the
    host tensor (same shape and dtype). On the CPU it is a copy made at once (`inference.inputs.to_host`)."""

    def __init__(self, tensor) -> None:
        from vlmctl.inference.inputs import to_host

        self.host, self.event = to_host(tensor.detach())

    def get(self):
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


def total_grad_norm(params) -> tuple[Any, float]:
    """`grad_norm_tensor(params)` and its value (a host sync)."""
    total = grad_norm_tensor(params)
    return total, float(total)


def _by_mesh(params) -> dict:
    """The parameters that have a gradient, by their gradient's mesh (None for plain tensors)."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups


def clip_grads(params, max_norm: float, total) -> None:
    """Scale the gradients of `params` by `max_norm / total` (torch's `clip_grads_with_norm_`), one mesh at a time
    (a foreach op takes the DTensors of one mesh)."""
    import torch

    for group in _by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


class TorchEngine:
    """An nn.Module wrapped (or not) in DDP or FSDP2 with a torch optimizer (AdamW, or its in-backward form) and
    a torch LR schedule. `autocast_dtype`: the compute dtype for torch.autocast (None or fp32: none; FSDP2 casts
    itself); `max_grad_norm`: the clipping limit (0: none)."""

    checkpoint_format = "dcp"
    reshards = True
    none_norm_skips = True

    def __init__(self, model, optimizer, scheduler, *, max_grad_norm: float, autocast_dtype=None, device=None):
        import torch

        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.device = device
        self.autocast_dtype = autocast_dtype if autocast_dtype not in (None, torch.float32) else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step_hooks: list = []

    @property
    def module(self):
        return getattr(self.model, "module", self.model)  # DDP's; FSDP2 wraps the module in place

    def inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The model inputs of `batch`; its vision towers' precomputed inputs staged for their forward
        (`train.tower_inputs`)."""
        from vlmctl.data.collate import model_inputs
        from vlmctl.train.tower_inputs import stage

        stage(batch)
        return model_inputs(batch)

    def forward(self, objective, batch: dict[str, Any]):
        """`objective.loss(self, batch)` under torch.autocast where the engine computes in a lower precision."""
        import torch

        ctx = torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext()
        with ctx:
            return objective.loss(self, batch)

    def sync(self, last: bool):
        """Skip the gradient all-reduce/reduce-scatter on all but the last micro-batch of a window."""
        if hasattr(self.model, "no_sync"):
            return contextlib.nullcontext() if last else self.model.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def backward(self, loss, scale: float) -> None:
        (loss * scale).backward()

    def micro_step(self) -> None:
        """Nothing: torch steps once per window (`step`)."""

    def step(self, skip: bool) -> float | None:
        """Clip and step unless `skip` or the gradient norm is not finite; returns the norm (None if skipped)."""
        import torch

        norm = None
        if hasattr(self.optimizer, "grad_norm"):  # OptimizerInBackward: the parameters were stepped in backward
            if not skip:
                norm = self.optimizer.grad_norm()
                self.scheduler.step()
                run_hooks(self.step_hooks)  # every parameter stepped inside backward, whatever the norm
            self.optimizer.zero_grad(set_to_none=True)
            return norm if norm is not None and math.isfinite(norm) else None
        if not skip and getattr(self.optimizer, "clips_on_device", False):
            norm = self._step_on_device()
        elif not skip:
            total, norm = total_grad_norm(self.params)
            # clip_grad_norm_ scales every gradient even when the norm is below the limit: one pass saved here
            if math.isfinite(norm) and 0 < self.max_grad_norm < norm:
                clip_grads(self.params, self.max_grad_norm, total)
            if math.isfinite(norm):
                self.optimizer.step()
                self.scheduler.step()
                run_hooks(self.step_hooks)
            else:
                norm = None
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def queue_update(self) -> HostValues:
        """Queue the clipped update of an optimizer that takes the clipping coefficient and the skip flag as device
        tensors (`clips_on_device`: `optimizer.stochastic_adamw`) without a host sync; returns the gradient norm (a
        0-d fp32 tensor) on its way to the host, copied before the update was queued, so that reading it waits for
        the backward and the norm but not for the update."""
        import torch

        total = grad_norm_tensor(self.params).float()
        norm = HostValues(total)
        scale = None
        if self.max_grad_norm > 0:  # torch's clip_grads_with_norm_: min(1, max_norm / (norm + 1e-6))
            scale = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        self.optimizer.step(grad_scale=scale, keep=torch.isfinite(total))
        return norm

    def _step_on_device(self) -> float | None:
        """`queue_update`, then read the norm: the host queues the whole update before it waits for the norm, so the
        device does not idle between backward and the update while the host walks the parameters, and no pass of
        its own scales the gradients; the norm's value left the device before the update, so the host goes on to
        the next step while the update runs. A non-finite norm left the weights and moments unchanged (the step
        counts are taken back, the schedule does not move); returns the norm, or None then."""
        norm = float(self.queue_update().get())
        if not math.isfinite(norm):
            self.optimizer.unstep()
            return None
        self.scheduler.step()
        run_hooks(self.step_hooks)
        return norm

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])  # a tensor with torchao's AdamW

    def reschedule(self, scheduler) -> None:
        """Use `scheduler` from now on (a schedule built once the run's step count is known)."""
        self.scheduler = scheduler

    def save(self, folder, step: int) -> None:
        """DCP shards of {"model", "optim", "scheduler"} into `folder` (collective); keys are the unwrapped model's
        `state_dict()` keys (`torch.distributed.checkpoint.state_dict.get_state_dict` strips DDP/FSDP wrappers)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from vlmctl.checkpoints import dcp_writer

        model_sd, optim_sd = get_state_dict(self.model, _optimizers(self.optimizer))
        # files of about 1 GiB: DCP stages a whole file's tensors in host memory until it closes it (`dcp_writer`)
        dcp.save({"model": model_sd, "optim": optim_sd, "scheduler": _plain(self.scheduler.state_dict())},
                 storage_writer=dcp_writer(folder))

    def load(self, folder) -> None:
        """Restore model, optimizer and scheduler from the DCP files of `folder` (resharded onto this world size)."""
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from vlmctl.checkpoints import dcp_load

        model, optimizer, scheduler = self.model, self.optimizer, self.scheduler
        model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer))
        strict = {"model": model_sd, "scheduler": _plain(scheduler.state_dict())}
        dcp_load(strict, folder)
        # Parameters that never received a gradient (e.g. a vision layer after the selected feature layer) have
        # no AdamW state in the checkpoint; the placeholders `get_state_dict` creates for them stay unused.
        optim = {"optim": optim_sd}
        dcp_load(optim, folder, allow_partial_load=True)
        set_state_dict(model, _optimizers(optimizer), model_state_dict=strict["model"], optim_state_dict=optim["optim"])
        scheduler.load_state_dict({**scheduler.state_dict(), **strict["scheduler"]})
        # DCP restores the groups' lr for one optimizer but not across several (OptimizerInBackward): the
        # scheduler's last learning rates are the groups' current ones either way
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            if isinstance(group["lr"], torch.Tensor):  # torchao's AdamW keeps a tensor it reads in its compiled step
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = lr
        run_hooks(self.step_hooks)  # the loaded weights' own scales

    def gather(self, rank: int, dtype=None) -> dict | None:
        """The full model state dict on rank 0 (CPU tensors, in `dtype` when given; None on other ranks); every
        rank calls this. The sharded state dict (`get_model_state_dict`: DTensor shards under FSDP2, no copy) is
        gathered tensor by tensor (`DTensor.full_tensor`), so no rank holds more than one full tensor it does not
        keep."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.tensor import DTensor

        gathered = {}
        for key, value in get_model_state_dict(self.model).items():
            sharded = isinstance(value, DTensor)
            full = value.full_tensor() if sharded else value  # collective for a shard: every rank, in the same order
            plain = high_precision(full)  # a float8 all-gather weight: one rank's full_tensor() is its own shard
            if rank == 0:  # a copy of an unsharded tensor: the export must not share storage with the trained model
                copy = not sharded or plain is not full
                gathered[key] = plain.detach().to("cpu", dtype=dtype or plain.dtype, copy=copy)
            del full, plain
        return gathered if rank == 0 else None


class DeepSpeedEngine:
    """The same protocol over a DeepSpeed engine (`deepspeed.initialize`'s): it accumulates gradients over the
    window, clips, steps and schedules itself at the window's boundary."""

    checkpoint_format = "deepspeed"
    reshards = False
    none_norm_skips = False

    def __init__(self, engine, optimizer=None, scheduler=None):
        self.engine = engine
        self.model = engine
        self.optimizer = optimizer if optimizer is not None else engine.optimizer
        self.scheduler = scheduler if scheduler is not None else engine.lr_scheduler
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.step_hooks: list = []

    @property
    def module(self):
        return self.engine.module

    def inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The model inputs, pixel values cast to the module's dtype (DeepSpeed runs no autocast); the vision towers'
        precomputed inputs staged for their forward (`train.tower_inputs`)."""
        from vlmctl.data.collate import model_inputs
        from vlmctl.train.tower_inputs import stage

        stage(batch)
        inputs = model_inputs(batch)
        dtype = next((p.dtype for p in self.engine.module.parameters()), None)
        if "pixel_values" in inputs and dtype is not None:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        return inputs

    def forward(self, objective, batch: dict[str, Any]):
        return objective.loss(self, batch)

    def sync(self, last: bool):
        return contextlib.nullcontext()

    def backward(self, loss, scale: float) -> None:
        # Our scale already averages over the window, so DeepSpeed must not divide by the accumulation steps again.
        self.engine.backward(loss * scale, scale_wrt_gas=False)

    def micro_step(self) -> None:
        """DeepSpeed's `step` after every micro-batch: it steps the optimizer at the window's boundary only."""
        self.engine.step()

    def step(self, skip: bool) -> float | None:
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else None
        run_hooks(self.step_hooks)  # DeepSpeed stepped at the window's boundary (`micro_step`), whatever `skip`
        return None if skip or norm is None or not math.isfinite(norm) else norm

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def reschedule(self, scheduler) -> None:
        raise ConfigError("DeepSpeed's LR schedule is fixed when its engine is built",
                          hint="build the engine once the step count is known")

    def save(self, folder, step: int) -> None:
        self.engine.save_checkpoint(str(folder), tag=f"global_step{step}", client_state={"step": step})

    def load(self, folder) -> None:
        """`engine.load_checkpoint` with weights-only loads; raises CheckpointError when `folder` holds none."""
        from vlmctl.checkpoints import CheckpointError, deepspeed_weights_only

        with deepspeed_weights_only():
            path, _ = self.engine.load_checkpoint(str(folder), load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {folder}", hint="pass another checkpoint, or start without --resume")
        run_hooks(self.step_hooks)

    def gather(self, rank: int, dtype=None) -> dict | None:
        """Rank 0's full state dict in `dtype` (None elsewhere): ZeRO-3's consolidated 16-bit copy (collective;
        converted tensor by tensor as it is emptied), ZeRO-2's module state dict (copied: the export must not share
        storage with the engine's module)."""
        engine = self.engine
        own = engine.zero_optimization_stage() == 3
        state = engine._zero3_consolidated_16bit_state_dict() if own else (engine.module.state_dict() if rank == 0 else None)
        if rank != 0:
            return None
        return {key: (value := state.pop(key)).detach().to("cpu", dtype=dtype or value.dtype, copy=not own) for key in list(state)}


def build_engine(model, strategy: Strategy, *, make_optimizer, make_scheduler, max_grad_norm: float, device, dtype,
                 deepspeed_config=None) -> Engine:
    """The engine of `strategy` over `model` as `parallelize` returned it, in train mode.

    `make_optimizer(model)` -> the optimizer over the model's trained parameters; `make_scheduler(optimizer)` -> its
    LR schedule; `deepspeed_config(model)` -> DeepSpeed's config dict (`distributed.deepspeed.deepspeed_config`),
    read only by DeepSpeed strategies, whose engine wraps the optimizer and schedule (`deepspeed.initialize`).
    torch strategies autocast to `dtype` except under FSDP2 (its mixed-precision policy casts). A model whose
    weights FSDP2 all-gathers in float8 gets the hook that computes their scales after each step
    (`distributed.float8.scale_hook`), and runs it once here: the first step's scales then come from the whole weights
    as every later step's do (without it, the first all-gather scales each rank's shard over the data-parallel mesh
    alone, which under tensor parallelism is one tp rank's part of the weight)."""
    if strategy.deepspeed:
        from vlmctl.distributed.deepspeed import deepspeed_engine

        optimizer = make_optimizer(model)
        scheduler = make_scheduler(optimizer)
        engine: Engine = DeepSpeedEngine(*deepspeed_engine(model, optimizer, scheduler, deepspeed_config(model)))
    else:
        optimizer = make_optimizer(model)
        engine = TorchEngine(model, optimizer, make_scheduler(optimizer), max_grad_norm=max_grad_norm, device=device,
                             autocast_dtype=None if strategy.fsdp else dtype)
    hook = scale_hook(engine.module)
    if hook is not None:
        engine.step_hooks.append(hook)
        hook()
    engine.model.train()
    return engine


def run_hooks(hooks) -> None:
    """Call each of `hooks` (an engine's `step_hooks`) in order."""
    for hook in hooks:
        hook()


def _optimizers(optimizer):
    """What DCP saves for `optimizer`: the per-parameter optimizers of an OptimizerInBackward, else itself."""
    return getattr(optimizer, "checkpoint_optimizers", None) or optimizer


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    # LambdaLR keeps `lr_lambdas: [None, ...]`; DCP stores the rest as plain values.
    return {k: v for k, v in state.items() if k != "lr_lambdas"}


def _whole_model_fits(model) -> bool:
    """Whether every FSDP2 unit of `model` can stay gathered at once: the full parameters (global sizes, bytes) fit
    in half of what the GPU has free (the allocator's cached but unused bytes counted as free), leaving the rest for
    the KV cache and activations of decoding. Always True off CUDA."""
    import torch

    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type != "cuda":
        return True
    need = sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor's numel is its global size
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return need <= free / 2


@contextlib.contextmanager
def _fsdp_gathered(units: list, rules: list[bool]):
    """Every FSDP2 unit of `units` gathered once and kept so until the block ends, then each unit's own
    reshard-after-forward rule (`rules`) put back and every unit resharded. Public FSDP2 API only
    (`FSDPModule.set_reshard_after_forward`, `unshard`, `reshard`; torch's `_fully_shard.py`)."""
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in units:
            unit.unshard()
        yield
    finally:
        for unit, rule in zip(units, rules):
            unit.set_reshard_after_forward(rule, recurse=False)
            unit.reshard()


@contextlib.contextmanager
def generation_parameters(model):
    """While open, the sharded parameters `generate` on the trained `model` (the engine's root module) needs are
    gathered (a GRPO step's rollouts, `train.rollouts`).

    FSDP2: decoding runs one forward per new token, and per-layer gathers would all-gather the whole model for every
    token; so every unit is gathered once for the whole generation and resharded after (`_fsdp_gathered`), where
    the full parameters fit in half the GPU's free memory (`_whole_model_fits`; always off CUDA) and every unit was
    sharded by `fsdp.shard_unit` (its rule recorded, to be put back). Otherwise the root's own parameters (those of
    no inner unit: embeddings, the vision embeddings, the projector...) stay gathered for the whole generation, as
    `generate` runs the vision tower through `get_image_features` before the root's forward (whose hook would gather
    them), and the inner units gather theirs in their hooks, as a training forward does. ZeRO-3: every module's
    hooks gather its own parameters, and the parameters a module reads from another one (`nn.MultiheadAttention`
    reads its `out_proj.weight`) are gathered on access while the modules are marked in a forward, as
    `DeepSpeedEngine.forward` marks them (its automated discovery of external parameters). Nothing to do for other
    models."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        # the root's first forward sets up its units' communication state; generation may reach an inner unit first
        model._get_fsdp_state()._lazy_init()
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        rules = [reshard_rule_of(m) for m in units]
        if None not in rules and _whole_model_fits(model):
            with _fsdp_gathered(units, rules):
                yield
            return
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
        return
    if not any(hasattr(p, "ds_id") for p in model.parameters()):  # not partitioned by ZeRO-3
        yield
        return
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    modules = list(model.modules())
    for module in modules:
        ensure_zero_ordered_dict(module)
        module._parameters._in_forward = True
    try:
        yield
    finally:
        for module in modules:
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = False
