"""Float8 training of the language model's linear layers (`train.fp8`), with torchao's float8 training
(`torchao.float8.convert_to_float8_training`; torchao's torchao/float8/README.md and torchtitan's float8 converter,
torchtitan/components/quantization/float8.py, are the models).

Each converted layer (torchao's `Float8Linear`) scales its input, weight and output gradient and casts them to
float8 (e4m3; e5m2 for tensorwise gradients) for each of its three matmuls (output, input gradient, weight
gradient: `torch._scaled_mm`), and computes the rest in the compute dtype. Its parameters stay what they were
(bf16/fp32 master weights, same names), so optimizer state, checkpoints and exports do not change.

- Which layers: `convertible` takes the family's `float8_linears` (the `nn.Linear` modules inside the language
  model's decoder layers, no MoE router: `FamilySpec.float8_exclude`) whose two dimensions are multiples of 16
  (`torch._scaled_mm`'s rule), and with `sized` torchao's size rule for the recipe (`_auto_filter_for_recipe`,
  from its H100 measurements: tensorwise skips a layer with in_features <= 4096 and out_features <= 1024), where
  the casts cost more than the faster matmul saves.
- When: `convert` runs before the parallel steps (`distributed.parallelize` step 0, as torchtitan converts before
  `parallelize_llama`), so the tensor-parallel plan splits `Float8Linear` layers (`distributed.tensor_parallel`:
  their scales reduced over the tp ranks) and FSDP2 shards their weights; under FSDP2 the tensorwise recipe
  all-gathers them in float8 (`enable_fsdp_float8_all_gather`: half the bytes of bf16) and their scales are computed
  for every layer in one all-reduce after each optimizer step and once before the first (`scale_hook`, registered
  and run by `engine.build_engine`).
- Rows of any length: the weight-gradient matmul's inner dimension is the row's token count, which packing leaves
  arbitrary; `pad_inner_dim` pads its float8 operands to a multiple of 16.
- `train.fp8: auto`: the probe's float8 trial (`vlmctl.train.autotune.float8_trial`) runs the same converted layers
  in float8 and in bf16 (`use_float8` switches them without touching a weight); so `auto` converts without the
  float8 all-gather, whose gathered weights are float8 only.
- Off CUDA (tests), `emulate` computes the scaled matmuls in high precision from the float8 values.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, replace

from vlmctl.families import float8_linears

# torch and torchao are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not
# pay for them, and torchao is an optional dependency (the `gpu` extra) imported only where a model converts.

FLOAT8_ATTR = "_vlmctl_float8"  # the root model's `Float8State`, set by `convert`
ALIGN = 16  # torch._scaled_mm: both dimensions of a float8 matmul's operands are multiples of 16


@dataclass(frozen=True)
class Float8State:
    """What `convert` did to a model: the `recipe` (tensorwise, rowwise), whether FSDP2 all-gathers the weights in
    float8 (`all_gather`), the converted layers' module paths (`layers`), and which matmuls use cuBLAS's fast
    accumulation (`fast_accum`: forward, the output matmul only, or all three)."""

    recipe: str
    all_gather: bool
    layers: tuple[str, ...]
    fast_accum: str = "forward"


def convertible(model, family, sized: str | None = None, skip: tuple[str, ...] = ()) -> list[tuple[str, object]]:
    """(module path, module) of the layers of `model` that `convert` converts: the family's `float8_linears` whose
    weight dimensions are multiples of `ALIGN`, with `sized` (a recipe name) only those torchao's size rule
    for that recipe keeps (module docstring), and none whose path contains a fragment of `skip` (`train.fp8_skip`,
    torchtitan's float8 `filter_fqns`)."""
    keep = None
    if sized is not None:
        from torchao.float8 import _auto_filter_for_recipe  # noqa: PLC0415 - torchao only where float8 is asked for

        keep = _auto_filter_for_recipe(sized, filter_fqns=[])
    return [(name, module) for name, module in float8_linears(model, family)
            if not any(d % ALIGN for d in module.weight.shape) and (keep is None or keep(module, name))
            and not any(fragment in name for fragment in skip)]


def convert(model, family, recipe: str, *, all_gather: bool = False, emulate: bool = False,
            sized: bool = False, skip: tuple[str, ...] = (), fast_accum: str = "forward") -> Float8State:
    """Swap the `convertible` layers of `model` (in place, on any device, the meta device included) for torchao's
    `Float8Linear` with `recipe` (tensorwise or rowwise: `Float8LinearConfig.from_recipe_name`), the float8
    all-gather under FSDP2 with `all_gather` (tensorwise only), `emulate` off CUDA, with `sized` torchao's size
    rule, leaving the layers whose path contains a fragment of `skip` in bf16. `fast_accum` (`train.fp8_fast_accum`):
    "forward" keeps the recipe's GEMM settings (fast accumulation in the output matmul only), "all" turns it on in
    the input- and weight-gradient matmuls too. Records and returns the `Float8State` (`FLOAT8_ATTR` on `model`).
    Parameters keep their names and values. Raises ValueError for another `fast_accum`."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415 - as above
    from torchao.float8.config import Float8GemmConfig  # noqa: PLC0415 - as above

    if fast_accum not in ("forward", "all"):
        raise ValueError(f"fast_accum must be 'forward' or 'all', not {fast_accum!r}")
    layers = {name for name, _ in convertible(model, family, recipe if sized else None, skip)}
    all_gather = all_gather and recipe == "tensorwise"  # torchao's float8 all-gather scales per tensor
    config = replace(Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=all_gather,
                     pad_inner_dim=True, emulate=emulate)
    if fast_accum == "all":
        config = replace(config, gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True),
                         gemm_config_grad_weight=Float8GemmConfig(use_fast_accum=True))
    if layers:
        convert_to_float8_training(model, module_filter_fn=lambda module, name: name in layers, config=config)
    state = Float8State(recipe, all_gather, tuple(sorted(layers)), fast_accum)
    setattr(model, FLOAT8_ATTR, state)
    return state


def state_of(model) -> Float8State | None:
    """The `Float8State` of a converted `model` (the root `convert` was given), else None."""
    return getattr(model, FLOAT8_ATTR, None)


def float8_layers(model) -> list:
    """The converted layers of `model` (torchao's `Float8Linear` modules), in module order; [] for a model
    `convert` did not convert."""
    state = state_of(model)
    if state is None or not state.layers:
        return []
    wanted = set(state.layers)
    return [module for name, module in model.named_modules() if name in wanted]


def use_float8(model, on: bool) -> int:
    """Compute the converted layers of `model` in float8 (`on`, their own forward) or in the compute dtype (`nn.Linear`'s
    forward on the same weight, set as each layer's instance `forward`; compiled layers recompile once for each and
    keep both). Returns the number of layers switched. Raises ValueError for off where FSDP2 all-gathers the weights
    in float8 (the gathered weight is float8 only)."""
    import torch  # noqa: PLC0415 - as above

    state, layers = state_of(model), float8_layers(model)
    if not on and state is not None and state.all_gather and layers:
        raise ValueError("float8 layers whose weights FSDP2 all-gathers in float8 cannot compute in bf16")
    for layer in layers:
        if on:
            layer.__dict__.pop("forward", None)
        else:
            layer.forward = types.MethodType(torch.nn.Linear.forward, layer)
    return len(layers)


def computes_float8(model) -> bool:
    """Whether the converted layers of `model` compute in float8 (False without any: `use_float8` off, or none)."""
    layers = float8_layers(model)
    return bool(layers) and "forward" not in layers[0].__dict__


def scale_hook(model):
    """The hook to run after each optimizer step of a `model` whose weights FSDP2 all-gathers in float8: torchao's
    `precompute_float8_dynamic_scale_for_fsdp` computes every such weight's scale from its updated shards in one
    all-reduce (instead of one per layer inside each all-gather), for the next forward. None for a model without
    them (nothing to do)."""
    state = state_of(model)
    if state is None or not state.all_gather or not state.layers:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: PLC0415 - as above

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)


def high_precision(tensor):
    """`tensor` without torchao's float8 all-gather wrapper (`WeightWithDynamicFloat8CastTensor`, which a one-rank
    FSDP2 `full_tensor()` hands back as it is): the bf16/fp32 weight it wraps. Other tensors are returned as they
    are; where torchao was never imported no such wrapper exists."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is not None and isinstance(tensor, fsdp_utils.WeightWithDynamicFloat8CastTensor):
        return tensor._tensor  # the wrapped weight (the subclass's only inner tensor, `__tensor_flatten__`)
    return tensor


def describe(model) -> str:
    """", float8 tensorwise linears (N layers[, float8 all-gather][, fast accumulation in backward])" for the
    start-up table and the bench's settings line; "" where no layer computes in float8."""
    state = state_of(model)
    if state is None or not computes_float8(model):
        return ""
    gather = ", float8 all-gather" if state.all_gather else ""
    fast = ", fast accumulation in backward" if state.fast_accum == "all" else ""
    return f", float8 {state.recipe} linears ({len(state.layers)} layers{gather}{fast})"
