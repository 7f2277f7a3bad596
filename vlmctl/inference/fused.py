"""Fused input projections for decoding: the query, key and value projections of each attention layer (and the gate
and up projections of each gated MLP) read the same hidden states, so they run as one matrix product over their
weights stacked, and each projection returns its slice of the product. A decode step reads every weight once per
token; one product of [q; k; v] instead of three launches fewer kernels per layer, and at one row a GEMV is mostly
launch and tail time (the fused `qkv_proj` / `gate_up_proj` of vLLM's and Phi-3's layers).

    groups = fuse_projections(language_model)   # in place; returns how many groups were fused

The weights are stacked once into one tensor and each projection's `weight` (and `bias`) becomes a view of its rows,
so memory does not grow and a copy into a projection's weight (GRPO's replica refresh) updates the stacked tensor.
Only plain `torch.nn.Linear` projections with the same input size, dtype, device and bias-or-not are fused (a LoRA
or float8 layer is left as it is). The fused product runs only without autograd (decoding); with gradients enabled
each projection is its own `linear` over its view, so gradients reach its parameters as before.

A projection called with another tensor than the one its group last computed (cross-attention's keys and values
read other states than its queries) computes the group's product of that tensor: the result is still exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections fused when a module holds all of a group (transformers' names in Llama, Qwen2/3, Mistral,
Gemma, InternLM2-style decoders and their MoE experts)."""


class _Group:
    """One fused product: `weight` [sum of outputs, in] (and `bias`), the output columns of each member, and the last
    input and product (kept until every member took its slice, then dropped)."""

    def __init__(self, weight: "torch.Tensor", bias: "torch.Tensor | None", spans: list[tuple[int, int]]):
        self.weight, self.bias, self.spans = weight, bias, spans
        self.input = self.output = None
        self.served: set[int] = set()

    def forward(self, index: int, linear, x: "torch.Tensor") -> "torch.Tensor":
        import torch
        import torch.nn.functional as F

        if torch.is_grad_enabled():
            return F.linear(x, linear.weight, linear.bias)
        if self.input is not x or index in self.served:
            self.input, self.output, self.served = x, F.linear(x, self.weight, self.bias), set()
        self.served.add(index)
        lo, hi = self.spans[index]
        out = self.output[..., lo:hi]
        if len(self.served) == len(self.spans):  # every member has its slice: hold no activations between calls
            self.input = self.output = None
        return out


def fuse_projections(module: "torch.nn.Module", groups: tuple[tuple[str, ...], ...] = GROUPS) -> int:
    """Fuse every group of `groups` found among the children of `module`'s submodules (module docstring), in place.
    Returns the number of groups fused (0 when none qualifies, or when `module` was fused before)."""
    import torch

    fused = 0
    for parent in module.modules():
        for names in groups:
            members = [parent._modules.get(n) for n in names]
            if any(type(m) is not torch.nn.Linear for m in members) or getattr(members[0], "_vlmctl_fused", False):
                continue
            first = members[0]
            if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
                   or m.weight.device != first.weight.device or (m.bias is None) != (first.bias is None) for m in members):
                continue
            with torch.no_grad():
                weight = torch.cat([m.weight for m in members])
                bias = torch.cat([m.bias for m in members]) if first.bias is not None else None
            spans, lo = [], 0
            for m in members:
                spans.append((lo, lo + m.out_features))
                lo += m.out_features
            group = _Group(weight, bias, spans)
            for i, m in enumerate(members):
                lo, hi = spans[i]
                m.weight = torch.nn.Parameter(weight[lo:hi], requires_grad=m.weight.requires_grad)
                if bias is not None:
                    m.bias = torch.nn.Parameter(bias[lo:hi], requires_grad=m.bias.requires_grad)
                m.forward = (lambda x, _g=group, _i=i, _m=m: _g.forward(_i, _m, x))
                m._vlmctl_fused = True
            fused += 1
    return fused


__all__ = ["GROUPS", "fuse_projections"]
