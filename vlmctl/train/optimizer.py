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
from dataclasses import dataclass
from typing import Any

import torch

# torch at the top: `train.setup` imports this module only where it builds an optimizer, so the CLI's start-up does not
# pay for it. torchao (an optional dependency) is imported only where used, so the rest works without it.


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

FLAT_CHUNK = 1 << 26  # elements stepped in one call: 128 MiB of random bits at most
SMALL_PARAM = 1 << 20  # elements: smaller parameters are stepped through flat copies of many (their copies cost little)
LIST_SIZES = (8, 4, 2, 1)  # parameters of one size stepped by one call: one compiled graph per list length


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


def update_lists(ps, gs, step, ms, vs, bits, lr, beta1: float, beta2: float, weight_decay: float, eps: float,
                 grad_scale, keep) -> None:
    """`adamw_update` of each (ps[i], gs[i], ms[i], vs[i]): lists of k flat tensors of one size n, stepped in place;
    `bits` (int16, k * n) holds the stochastic rounding's random bits of all k, the i-th n of them for the i-th
    tensor. Compiled with dynamic sizes (`_compiled`), one graph serves every n and one list length k."""
    n = ps[0].numel()
    for i in range(len(ps)):
        adamw_update(ps[i], gs[i], step, ms[i], vs[i], bits[i * n:(i + 1) * n], lr, beta1, beta2, weight_decay, eps,
                     grad_scale, keep)


def update_lists_exact(ps, gs, step, ms, vs, lr, beta1: float, beta2: float, weight_decay: float, eps: float,
                       grad_scale, keep) -> None:
    """`update_lists` of parameters that are not bf16 (no rounding): a function of its own, so its graphs count
    towards a compile cache of their own."""
    for i in range(len(ps)):
        adamw_update(ps[i], gs[i], step, ms[i], vs[i], None, lr, beta1, beta2, weight_decay, eps, grad_scale, keep)


_COMPILED: dict = {}


def _compiled(fn):
    """`fn` compiled once with dynamic sizes for flat tensors or lists of them (a graph per list length in
    `LIST_SIZES`, four at most, under Dynamo's limit of eight per function). A compiled step per parameter shape made
    every call check the guards of dozens of compiled variants (0.5 s of CPU per step for the ~800 parameters of a 3B
    VLM, measured on an H200)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, fullgraph=True, dynamic=True)
    return _COMPILED[fn]


def _flat(t):
    """`t` (contiguous) as a flat alias that is not a view and needs no gradient: Dynamo guards on a view's base and
    on requires_grad, so every call's tensors look alike to the compiled graph (the step writes the same storage)."""
    return t.view(-1).detach()


@dataclass(slots=True)
class _Call:
    """One compiled call of a step (`_plan`): `params` (whose gradients it reads), the plain tensors it steps
    (`local`'s parameter, exp_avg and exp_avg_sq: flat aliases, or as they are when `flat` copies them), the step
    count they share, and whether they go through one flat copy of each kind (small parameters)."""

    params: list
    weights: list
    avgs: list
    sqs: list
    step: Any
    flat: bool


@dataclass(slots=True)
class _Plan:
    """The calls that step a parameter group (`_plan`), made once and kept while the same parameters have
    gradients and the optimizer's state is not replaced: walking ~730 parameters' states every step cost the host
    more time than the device spent on the update (a 7B on an H200), so the device idled."""

    key: tuple
    calls: list
    steps: list


def _runs(items: list, limit: int):
    """`items` ((param, weight, exp_avg, exp_avg_sq, step), weights of any size) in runs of at most `limit` weight
    elements (a larger one alone); empty shards are left out, having nothing to step."""
    run, size = [], 0
    for item in items:
        n = item[1].numel()
        if not n:
            continue
        if run and size + n > limit:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run


def _plan(optimizer, params: list, local) -> _Plan:
    """The calls of one step over `params` (those of a group that have a gradient), their state created on first use.
    Parameters are stepped together when they share dtypes, device and step count: of `SMALL_PARAM` elements or
    more, in place, in lists of one size (`LIST_SIZES`, at most `FLAT_CHUNK` elements a call, a larger parameter
    alone); smaller ones (biases, norms) through one flat copy of each kind per `FLAT_CHUNK` elements, copied back
    after. No parameter is copied that is not small."""
    kinds: dict[tuple, list] = {}  # what lets parameters share a call -> (param, weight, exp_avg, exp_avg_sq, step)
    for p in params:
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = optimizer._new_buffer(p, True)
            state["exp_avg_sq"] = optimizer._new_buffer(p, False)
        tensors = (local(p), local(state["exp_avg"]), local(state["exp_avg_sq"]))
        small = tensors[0].numel() < SMALL_PARAM or not all(t.is_contiguous() for t in tensors)
        key = (*(t.dtype for t in tensors), tensors[0].device, float(state["step"]), small,
               0 if small else tensors[0].numel())
        kinds.setdefault(key, []).append((p, *tensors, state["step"]))

    def call(run, flat: bool) -> _Call:
        tensors = ([item[j] for item in run] for j in (1, 2, 3))
        return _Call([item[0] for item in run], *(ts if flat else [_flat(t) for t in ts] for ts in tensors),
                     run[0][4], flat)

    calls = []
    for (*_, small, n), items in kinds.items():
        if small:  # flat copies of up to FLAT_CHUNK elements
            calls.extend(call(run, True) for run in _runs(items, FLAT_CHUNK))
            continue
        i = 0
        while i < len(items):
            k = next(k for k in LIST_SIZES if k == 1 or (k <= len(items) - i and k * n <= FLAT_CHUNK))
            calls.append(call(items[i:i + k], False))
            i += k
    # largest first: each compiled graph's kernels are tuned on their first call's sizes (a kernel tuned on a 1.5M-
    # element parameter stepped the 7B's 68M-element ones 1.35x slower than one tuned on 64M elements, on an H200)
    calls.sort(key=lambda c: -sum(t.numel() for t in c.weights))
    return _Plan(tuple(map(id, params)), calls, [optimizer.state[p]["step"] for p in params])


def _run(call: _Call, local, group, grad_scale, keep) -> None:
    """One compiled step of `call` with `group`'s settings, `grad_scale` and `keep` (`adamw_update`)."""
    grads = [local(p.grad) for p in call.params]
    args = (group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"], grad_scale, keep)
    bf16 = call.weights[0].dtype is torch.bfloat16
    if not call.flat:  # in place
        grads = [_flat(g) if g.is_contiguous() else g.reshape(-1) for g in grads]
        if bf16:
            bits = random_bits(sum(t.numel() for t in call.weights), call.weights[0].device)
            _compiled(update_lists)(call.weights, grads, call.step, call.avgs, call.sqs, bits, *args)
        else:
            _compiled(update_lists_exact)(call.weights, grads, call.step, call.avgs, call.sqs, *args)
        return
    # one flat copy of each kind, copied back after; a compiled function of its own, so the small copies' sizes tune
    # none of the large parameters' kernels
    p, g, m, v = (torch.cat([t.reshape(-1) for t in ts]) for ts in (call.weights, grads, call.avgs, call.sqs))
    bits = random_bits(p.numel(), p.device) if bf16 else None
    _compiled(adamw_update)(p, g, call.step, m, v, bits, *args)
    sizes = [t.numel() for t in call.weights]
    for targets, source in ((call.weights, p), (call.avgs, m), (call.sqs, v)):
        torch._foreach_copy_(targets, [part.view(t.shape) for part, t in zip(source.split(sizes), targets)])


def _step_groups(optimizer, local, grad_scale, keep) -> None:
    """One step of each of `optimizer`'s groups through its `_plan` (made again when the parameters that have a
    gradient changed, or after `load_state_dict`), the step counts advanced first; `grad_scale` and `keep` as in
    `adamw_update` (None: 1 and True)."""
    scale_on, keep_on = _per_device(grad_scale, torch.float32), _per_device(keep, torch.bool)
    plans = optimizer.__dict__.setdefault("_plans", {})
    for i, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if p.grad is not None]
        plan = plans.get(i)
        if plan is None or plan.key != tuple(map(id, params)):
            plan = plans[i] = _plan(optimizer, params, local)
        if plan.steps:
            torch._foreach_add_(plan.steps, 1.0)
        for call in plan.calls:
            device = call.weights[0].device
            _run(call, local, group, scale_on(device), keep_on(device))


def stochastic_adamw(groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float):
    """AdamW for bf16 parameters whose update is computed in fp32 and rounded to bf16 stochastically (torchao's
    `_AdamW(bf16_stochastic_round=True)`, its moments in the parameters' dtype), stepped through compiled calls
    with dynamic sizes (`update_lists`): in place over lists of parameters of one size, the small ones on flat copies
    (`_plan`, kept from step to step). Its `step` also takes the gradient clipping coefficient and a skip flag as
    device tensors (`adamw_update`), so `TorchEngine.step` clips and skips a bad step without a host sync and without
    a pass of its own over the gradients. `groups`: AdamW parameter groups ({"params", "lr", "weight_decay"}); the
    groups' learning rates become 0-d tensors (read inside the compiled step). Works on plain tensors and FSDP2's
    DTensor shards (the local shard is stepped; the state is a DTensor like the parameter, so
    torch.distributed.checkpoint saves it sharded). A parameter that is not bf16 is updated without rounding."""
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
            _step_groups(self, local, grad_scale, keep)
            return loss

        def load_state_dict(self, state_dict) -> None:
            """torch's `load_state_dict`, after which the next step makes its calls again (`_plan`): the state's
            tensors are new ones."""
            self.__dict__.pop("_plans", None)
            super().load_state_dict(state_dict)

        def unstep(self) -> None:
            """Take back the step count of every parameter that has a gradient: after a `step` whose `keep` was
            False, which left weights and moments unchanged, so the next step's bias correction is the right one."""
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and self.state.get(p):
                        self.state[p]["step"] -= 1

    _SR_CLASS = StochasticAdamW
    return _SR_CLASS
