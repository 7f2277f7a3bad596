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


def adamw_update(p, grad, step, exp_avg, exp_avg_sq, bits, lr, beta1: float, beta2: float, weight_decay: float,
                 eps: float, grad_scale, keep) -> None:
    """One AdamW step of flat tensors in place, computed in fp32: torchao's `single_param_adam` (torchao/optim/adam.py,
    `IS_ADAMW`; Loshchilov & Hutter, "Decoupled Weight Decay Regularization", arXiv:1711.05101) with three
    additions that keep the step free of host synchronization:

    - `grad_scale` (0-d tensor on the device) multiplies the gradient first: the clipping coefficient
      `min(1, max_norm / (norm + 1e-6))` (torch's `clip_grads_with_norm_`), applied here instead of in a pass of its
      own over every gradient;
    - `keep` (0-d bool tensor on the device): where False (a non-finite gradient norm) the weight and moments are
      written back unchanged, so a bad step is skipped without the host reading the norm first;
    - `bits` (int16, p's numel; None for a parameter that is not bf16): 16 random bits per element for the stochastic
      rounding of the fp32 result to bf16 (torchao's `_fp32_to_bf16_sr`: rounded away from zero with probability
      equal to the dropped 16 bits / 2^16). torchao draws them inside the kernel, one Philox call per element, which
      made its step compute-bound (58 ms for the 7B's 8.3B elements on an H200); `random_bits` draws 64 bits per
      value of one pass instead.

    `step` and `lr` are 0-d tensors (the state's step count after increment, the group's learning rate); the
    moments keep their dtype (bf16 beside bf16 weights: rounded to nearest)."""
    import torch

    p32 = p.float()
    g32 = grad.float() * grad_scale
    p32 = p32 - lr * weight_decay * p32
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    m32 = exp_avg.float().lerp(g32, 1 - beta1)
    v32 = exp_avg_sq.float().lerp(g32.square(), 1 - beta2)
    p32 = p32 - lr * (m32 / bias1) / (v32.sqrt() / bias2.sqrt() + eps)
    exp_avg.copy_(torch.where(keep, m32.to(exp_avg.dtype), exp_avg))
    exp_avg_sq.copy_(torch.where(keep, v32.to(exp_avg_sq.dtype), exp_avg_sq))
    if bits is None:
        p.copy_(torch.where(keep, p32.to(p.dtype), p))
        return
    raw = p32.view(torch.int32)
    truncated = raw & -65536  # the upper 16 bits (0xFFFF0000): p32 rounded towards zero, exactly a bf16 value
    away = (bits.to(torch.int32) & 0xFFFF) < (raw & 0xFFFF)
    rounded = torch.where(away, truncated + 0x10000, truncated).view(torch.float32).to(torch.bfloat16)
    p.copy_(torch.where(keep, rounded, p))


def random_bits(n: int, device):
    """int16 tensor [n] of uniformly random bits (16 per element) for `adamw_update`'s stochastic rounding: int64
    values over the whole 64-bit range (`random_(-2**63, None)`, four elements each), so the generator runs once per
    four elements instead of once per element."""
    import torch

    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2 ** 63), None)
    # detached: the same memory as a tensor that is not a view, so a compiled step guards on no base's size
    return words.view(torch.int16)[:n].detach()


_ONES: dict = {}  # (device, dtype) -> a 0-d one, read-only: the default scale and keep flag of every step


def _per_device(value, dtype):
    """device -> `value` (a 0-d tensor; None for 1 / True) as `dtype` on that device, copied once per device (without
    a host sync, except to the host itself). The ones of None are made once per process: the per-parameter steps of
    `OptimizerInBackward` take them for every parameter."""
    cache: dict = {}

    def on(device):
        if value is None:
            key = (device, dtype)
            if key not in _ONES:
                _ONES[key] = torch.ones((), dtype=dtype, device=device)
            return _ONES[key]
        if device not in cache:
            # to the host (an offloaded shard's device) a non-blocking copy could be read before it lands
            cache[device] = value.to(device=device, dtype=dtype, non_blocking=torch.device(device).type != "cpu")
        return cache[device]

    return on


def _flat_step():
    """`adamw_update` compiled once with dynamic sizes for flat tensors: a compiled step per parameter shape makes
    every call check the guards of dozens of compiled variants (0.5 s of CPU per step for the ~800 parameters of a
    3B VLM, measured on an H200). The step calls it on flat copies of many parameters at once (`FLAT_CHUNK`
    elements): one call per parameter still cost 0.32 s of host time per step with the GPU idle (3B, FSDP2 over
    2 H200s); the update is elementwise, so the flat copy changes no value but the rounding's random draws."""
    global _FLAT_STEP
    if _FLAT_STEP is None:
        _FLAT_STEP = torch.compile(adamw_update, fullgraph=True, dynamic=True)
    return _FLAT_STEP


def _step_chunk(chunk, group, grad_scale, keep) -> None:
    """One compiled AdamW step over `chunk` (`_chunks`: ((param, grad, exp_avg, exp_avg_sq), step) of plain shards)
    with `group`'s settings, `grad_scale` and `keep` (`adamw_update`): on the tensors themselves when the chunk is
    one contiguous parameter, else on one flat copy of each kind, copied back after."""
    (p, g, m, v), step = chunk[0]
    n = sum(item[0][0].numel() for item in chunk)
    bits = random_bits(n, p.device) if p.dtype is torch.bfloat16 else None
    args = (group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"], grad_scale, keep)
    if len(chunk) == 1 and all(t.is_contiguous() for t in (p, g, m, v)):
        # flat aliases that are not views and need no gradient, as the flat copies below: Dynamo guards on both
        # (a view's base, requires_grad), so one compiled graph serves both (the step writes the same storage)
        p, g, m, v = (t.view(-1).detach() for t in (p, g, m, v))
        _flat_step()(p, g, step, m, v, bits, *args)
        return
    # one flat copy of each: one compiled call and a few copy kernels instead of one call per parameter
    params, grads, avgs, sqs = (list(ts) for ts in zip(*(item for item, _ in chunk)))
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in (params, grads, avgs, sqs)]
    _flat_step()(flat[0], flat[1], step, flat[2], flat[3], bits, *args)
    sizes = [t.numel() for t in params]
    for targets, source in ((params, flat[0]), (avgs, flat[2]), (sqs, flat[3])):
        torch._foreach_copy_(targets, [part.view(t.shape) for part, t in zip(source.split(sizes), targets)])


def stochastic_adamw(groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float):
    """AdamW for bf16 parameters whose update is computed in fp32 and rounded to bf16 stochastically (torchao's
    `_AdamW(bf16_stochastic_round=True)`, its moments in the parameters' dtype), stepped through one compiled
    kernel for all parameter sizes (`_flat_step`), on flat copies of up to `FLAT_CHUNK` elements of parameters at a
    time. Its `step` also takes the gradient clipping coefficient and a skip flag as device tensors (`adamw_update`),
    so `TorchEngine.step` clips and skips a bad step without a host sync and without a pass of its own over the
    gradients. `groups`: AdamW parameter groups ({"params", "lr", "weight_decay"}); the groups' learning rates become
    0-d tensors (read inside the compiled step). Works on plain tensors and FSDP2's DTensor shards (the local shard
    is stepped; the state is a DTensor like the parameter, so torch.distributed.checkpoint saves it sharded). A
    parameter that is not bf16 is updated without rounding."""
    return _stochastic_adamw_class()(groups, lr=lr, betas=betas, eps=eps, weight_decay=0.0, bf16_stochastic_round=True)


_SR_CLASS = None


def _step_batches(optimizer, group, local) -> dict[tuple, list]:
    """The parameters of `group` that have a gradient, their state created on first use and their step counts
    advanced, as ((param, grad, exp_avg, exp_avg_sq) plain tensors by `local`, step) lists keyed by what lets them
    be stepped together: the same dtypes, device and step count."""
    batches: dict[tuple, list] = {}
    for p in group["params"]:
        if p.grad is None:
            continue
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = optimizer._new_buffer(p, True)
            state["exp_avg_sq"] = optimizer._new_buffer(p, False)
        state["step"] += 1
        item = (local(p), local(p.grad), local(state["exp_avg"]), local(state["exp_avg_sq"]))
        key = (*(t.dtype for t in item), p.device, float(state["step"]))
        batches.setdefault(key, []).append((item, state["step"]))
    return batches


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

        clips_on_device = True  # `step` takes the clipping coefficient and the skip flag as device tensors

        @torch.no_grad()
        def step(self, closure=None, *, grad_scale=None, keep=None):
            """One AdamW step of every parameter that has a gradient, its gradient multiplied by `grad_scale` and
            the step applied only if `keep` (0-d device tensors, `adamw_update`; default 1 and True). The step
            counts advance either way: `unstep` takes them back after a step `keep` skipped."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            scale_on, keep_on = _per_device(grad_scale, torch.float32), _per_device(keep, torch.bool)
            for group in self.param_groups:
                for items in _step_batches(self, group, local).values():
                    for chunk in _chunks(items, FLAT_CHUNK):
                        device = chunk[0][0][0].device
                        _step_chunk(chunk, group, scale_on(device), keep_on(device))
            return loss

        def unstep(self) -> None:
            """Take back the step count of every parameter that has a gradient: after a `step` whose `keep` was
            False, which left weights and moments unchanged, so the next step's bias correction is the right one."""
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and self.state.get(p):
                        self.state[p]["step"] -= 1

    _SR_CLASS = StochasticAdamW
    return _SR_CLASS
