"""The scales of the weights FSDP2 all-gathers in float8 (`distributed.float8`, torchao's
`WeightWithDynamicFloat8CastTensor`), beside the scale each weight's current values give, for the tests that check
`float8.scale_hook` (tests/unit/test_fp8.py, tests/integration/test_tensor_parallel.py)."""

from __future__ import annotations


def weight_scales(model) -> dict:
    """{layer path: (the scale its weight is all-gathered with (None before one was computed), e4m3's largest value /
    the whole weight's amax, as torchao's `amax_to_scale` computes it in float64)} of the layers of `model` whose
    weights FSDP2 all-gathers in float8; collective (each weight gathered whole)."""
    import torch

    out = {}
    for name, layer in model.named_modules():
        local = getattr(getattr(layer, "weight", None), "_local_tensor", None)
        if type(local).__name__ == "WeightWithDynamicFloat8CastTensor":
            amax = layer.weight.full_tensor().detach().abs().max().to(torch.float64).clamp(min=1e-12)
            scale = local._precomputed_scale
            out[name] = (None if scale is None else scale.clone(), (torch.finfo(torch.float8_e4m3fn).max / amax).float())
    return out
