"""AdamW stepped inside the backward pass (`train.optimizer_in_backward`), so no gradient outlives its layer.

Each trainable parameter gets its own AdamW, stepped by a post-accumulate-grad hook the moment autograd (or FSDP2's
reduce-scatter, which fires the same hook on the sharded parameter) has its gradient, and the gradient is freed
right after. Peak memory loses the whole gradient buffer: 2 bytes per bf16 parameter (7.5 GB for a 3.75B model).
The technique and its limits follow PyTorch's tutorial "How to save memory by fusing the optimizer step into the
backward pass" (pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html): there is no global
gradient to clip or to accumulate over micro-batches, and a non-finite gradient is applied before it can be seen.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# torchao (an optional dependency) is imported only where used, so the rest works without it.


class OptimizerInBackward(torch.optim.Optimizer):
    """Per-parameter AdamW optimizers behind one Optimizer: `param_groups` are the per-parameter optimizers' own
    group dicts (one per parameter), so an LR scheduler built on this object drives all of them; `step()` and
    `zero_grad()` have nothing left to do after backward. `checkpoint_optimizers` lists the real optimizers for
    torch.distributed.checkpoint, which accepts several.

    `groups`: AdamW parameter groups ({"params", "lr", "weight_decay"}); `make(groups)` builds one parameter's
    AdamW (`vlmctl.train.setup.adamw_factory`). Raises ValueError for an empty set.
    """

    def __init__(self, groups: list[dict[str, Any]], *, make):
        params = [p for g in groups for p in g["params"]]
        if not params:
            raise ValueError("OptimizerInBackward needs at least one parameter")
        self.optimizers: dict[torch.nn.Parameter, torch.optim.Optimizer] = {}
        for g in groups:
            for p in g["params"]:
                self.optimizers[p] = make([{"params": [p], "lr": g["lr"], "weight_decay": g["weight_decay"]}])
        self._building: list | None = []  # Optimizer.__init__ fills its own group list, checked for duplicates
        super().__init__(params, {"lr": groups[0]["lr"]})
        self._building = None
        self._sq_norms: list[torch.Tensor] = []
        self.paused = False  # the start-up memory probe runs backward passes that must not step
        for p in self.optimizers:
            p.register_post_accumulate_grad_hook(self._step_param)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        # read live: loading a state dict gives each per-parameter optimizer new group dicts
        if self._building is not None:
            return self._building
        return [opt.param_groups[0] for opt in self.optimizers.values()]

    @param_groups.setter
    def param_groups(self, value) -> None:
        if self._building is not None:  # Optimizer.__init__; afterwards the per-parameter optimizers' groups count
            self._building = value

    @property
    def checkpoint_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.optimizers.values())

    def _step_param(self, param) -> None:
        if self.paused:
            param.grad = None  # freed as in a real step, so the probe measures the same memory
            return
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # an FSDP2 shard: its own part of the norm
        self._sq_norms.append(local.detach().float().pow(2).sum())
        self.optimizers[param].step()
        param.grad = None

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients applied since the last call (the FSDP2 shards' parts all-reduced
        when a process group of more than one rank is initialized)."""
        import torch.distributed as dist

        if not self._sq_norms:
            return 0.0
        total = torch.stack(self._sq_norms).sum()
        self._sq_norms.clear()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        return math.sqrt(float(total))

    def step(self, closure=None):  # noqa: ARG002 - the parameters were stepped during backward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.optimizers:
            p.grad = None


# ------------------------------------------------------------------------------- AdamW with stochastic rounding

_FLAT_STEP = None
FLAT_CHUNK = 1 << 26  # elements stepped in one call: 4 flat bf16 copies of 128 MiB at most


def _chunks(items: list, limit: int):
    """`items` ((param, grad, exp_avg, exp_avg_sq), step) in runs of at most `limit` elements (a larger parameter
    alone)."""
    run, size = [], 0
    for item in items:
        n = item[0][0].numel()
        if run and size + n > limit:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run


def _flat_step():
    """torchao's single-parameter AdamW step (fp32 math, bf16 stochastic rounding), compiled once with dynamic
    sizes for flat tensors: torchao's own `step` compiles it per parameter shape with static sizes, so every call
    checks the guards of dozens of compiled variants (0.5 s of CPU per step for the ~800 parameters of a 3B VLM,
    measured on an H200). The step calls it on flat copies of many parameters at once (`FLAT_CHUNK` elements): one
    call per parameter still cost 0.32 s of host time per step with the GPU idle (3B, FSDP2 over 2 H200s); the
    update is elementwise, so the flat copy changes no value but the stochastic rounding's random draws."""
    global _FLAT_STEP
    if _FLAT_STEP is None:
        from torchao.optim.adam import single_param_adam

        _FLAT_STEP = torch.compile(single_param_adam, fullgraph=True, dynamic=True)
    return _FLAT_STEP


def _step_chunk(chunk, group) -> None:
    """One compiled AdamW step over `chunk` (`_chunks`: ((param, grad, exp_avg, exp_avg_sq), step) of plain shards)
    with `group`'s settings: on the tensors themselves when the chunk is one contiguous parameter, else on one flat
    copy of each kind, copied back after."""
    (p, g, m, v), step = chunk[0]
    args = (None, group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"], True,
            p.dtype is torch.bfloat16)
    if len(chunk) == 1 and all(t.is_contiguous() for t in (p, g, m, v)):
        _flat_step()(p.view(-1), g.view(-1), step, m.view(-1), v.view(-1), *args)
        return
    # one flat copy of each: one compiled call and a few copy kernels instead of one call per parameter
    params, grads, avgs, sqs = (list(ts) for ts in zip(*(item for item, _ in chunk)))
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in (params, grads, avgs, sqs)]
    _flat_step()(flat[0], flat[1], step, flat[2], flat[3], *args)
    sizes = [t.numel() for t in params]
    for targets, source in ((params, flat[0]), (avgs, flat[2]), (sqs, flat[3])):
        torch._foreach_copy_(targets, [part.view(t.shape) for part, t in zip(source.split(sizes), targets)])


def stochastic_adamw(groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float):
    """AdamW for bf16 parameters whose update is computed in fp32 and rounded to bf16 stochastically (torchao's
    `_AdamW(bf16_stochastic_round=True)`, its moments in the parameters' dtype), stepped through one compiled
    kernel for all parameter sizes (`_flat_step`), on flat copies of up to `FLAT_CHUNK` elements of parameters at a
    time. `groups`: AdamW parameter groups ({"params", "lr", "weight_decay"}); the groups' learning rates become
    0-d tensors (read inside the compiled step). Works on plain tensors and FSDP2's DTensor shards (the local shard
    is stepped; the state is a DTensor like the parameter, so torch.distributed.checkpoint saves it sharded). A
    parameter that is not bf16 is updated without rounding."""
    return _stochastic_adamw_class()(groups, lr=lr, betas=betas, eps=eps, weight_decay=0.0, bf16_stochastic_round=True)


_SR_CLASS = None


def _stochastic_adamw_class():
    """The torchao `_AdamW` subclass behind `stochastic_adamw`, defined once (torchao imported on first use)."""
    global _SR_CLASS
    if _SR_CLASS is not None:
        return _SR_CLASS
    from torch.distributed.tensor import DTensor
    from torchao.optim import _AdamW

    from vlmctl.distributed.float8 import high_precision

    def local(t):
        """The plain tensor the step updates in place: an FSDP2 shard's local tensor, and of a float8 layer's weight
        under FSDP2's float8 all-gather the bf16 shard inside torchao's wrapper (compiled with dynamic sizes, the
        step cannot take the wrapper: its flattened size is a product of symbols Dynamo cannot bind)."""
        return high_precision(t.to_local() if isinstance(t, DTensor) else t)

    class StochasticAdamW(_AdamW):
        def _new_buffer(self, p, signed: bool):  # noqa: ARG002 - plain AdamW moments: no quantized state
            """A moment of zeros shaped as `p`'s plain shard (`local`), a DTensor like `p` under FSDP2, so no moment
            carries the float8 wrapper into the optimizer's state and its checkpoints."""
            out = torch.zeros_like(local(p))
            if isinstance(p, DTensor):
                out = DTensor.from_local(out, device_mesh=p.device_mesh, placements=p.placements, run_check=False,
                                         shape=p.shape, stride=p.stride())
            return out.to(p.device)  # from_local moves it to the mesh's device: back beside an offloaded parameter

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                batches: dict[tuple, list] = {}  # parameters stepped together: same dtypes, device and step count
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    item = (local(p), local(p.grad), local(state["exp_avg"]), local(state["exp_avg_sq"]))
                    key = (*(t.dtype for t in item), p.device, float(state["step"]))
                    batches.setdefault(key, []).append((item, state["step"]))
                for items in batches.values():
                    for chunk in _chunks(items, FLAT_CHUNK):
                        _step_chunk(chunk, group)
            return loss

    _SR_CLASS = StochasticAdamW
    return _SR_CLASS
