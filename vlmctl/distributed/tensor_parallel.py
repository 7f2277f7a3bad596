"""Tensor parallelism of the language model (`train.tensor_parallel`): PyTorch DTensor plans on the mesh's `tp`
dimension (modelled on torchtitan's `apply_tp`, `torchtitan/models/llama3/infra/parallelize.py`; the arithmetic is
Megatron-LM's, Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053).

Each decoder layer is split by its family's plan (`FamilySpec.tensor_parallel_plan`, relative module name ->
style): the q/k/v and gate/up projections column-wise (each rank computes its own heads and its slice of the MLP),
the o and down projections row-wise (their partial outputs are summed over the tp ranks: one all-reduce after
attention and one after the MLP), per-head norms (Qwen3's q/k norms) on each rank's heads. The embedding is split
over the vocabulary (rows; the ranks' partial lookups are summed) and so is the LM head (its logits stay split
over the vocabulary: `vocab_parallel_cross_entropy` computes the loss without gathering them). A tied head shares
the embedding's split weight. The vision tower and projector are replicated: every tp rank runs them on the same
images (the same batch), so their gradients agree without a collective.

Attention reshapes its projections with `-1` heads, so each rank runs its heads with the unchanged
`num_key_value_groups` (packed rows and varlen kernels see the local heads only). Under FSDP2 each parameter is a
DTensor on the 2-D (dp_shard, tp) mesh; the data-parallel mesh (the sampler, the loss reduction) leaves tp out: the
ranks of a tp group read the same batch.

Float8 layers (`train.fp8`: torchao's `Float8Linear`, swapped in before this split, `distributed.parallelize` step
0) are split by the same plan: their weights become DTensors, and torchao casts DTensor operands to float8 as it
casts whole ones. Each tensor's amax is reduced over the tp ranks (a Partial max that DTensor all-reduces: the
weights of every layer, the row-split input of o/down, the column-split output gradient of q/k/v and gate/up), so a
rank scales its part of a tensor as one process scales the whole and casts the values TP=1 casts (but for a value on
a float8 rounding boundary, which the row-split matmuls' partial sums, added in another order, can round the other
way). Under FSDP2's float8 all-gather the weights' scales come from `float8.scale_hook`'s one all-reduce over the
whole mesh.

Every rank splits its own copy of the weights (`src_data_rank=None`: no broadcast while splitting): the ranks hold
the same weights, or (`setup.defer_weights`) empty ones that rank 0's weights fill once the model is wrapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlmctl.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

STYLES = ("colwise", "rowwise", "head_norm")


def check_tensor_parallel(tp: int, text_config: Any, family: Any, vocab: int | None = None) -> None:
    """Raise ConfigError (naming `train.tensor_parallel`) unless `family` has a tensor-parallel plan and `tp`
    divides the language model's attention heads, key/value heads, MLP width and vocabulary (`vocab`: the embedding's
    rows)."""
    if tp <= 1:
        return
    if not family.tensor_parallel_plan:
        raise ConfigError(f"train.tensor_parallel={tp}: the {family.name} family has no tensor-parallel plan",
                          hint="set train.tensor_parallel: 1 (FSDP2 shards the model instead)")
    heads = text_config.num_attention_heads
    sizes = {"attention heads": heads,
             "key/value heads (GQA groups)": getattr(text_config, "num_key_value_heads", None) or heads,
             "MLP width (intermediate_size)": text_config.intermediate_size}
    if vocab is not None:
        sizes["vocabulary (embedding rows)"] = vocab
    for what, n in sizes.items():
        if n % tp:
            raise ConfigError(f"train.tensor_parallel={tp} does not divide the language model's {n} {what}",
                              hint="set train.tensor_parallel to a divisor of it (each rank computes an equal share)")


def head_norm():
    """A ParallelStyle for a norm over each head's features (Qwen3's q_norm / k_norm): its input [..., heads,
    head_dim] holds this rank's heads (a DTensor split on dim -2 while the norm runs), its weight [head_dim] is
    replicated; the weight's gradient, partial on each rank (its heads only), is summed over the tp ranks by DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def partition(name, module, mesh):
        for key, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(key, _param(distribute_tensor(param, mesh, [Replicate()], src_data_rank=None)))

    def inputs(module, args, mesh):
        x = args[0]
        return (DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False), *args[1:])

    class HeadNorm(ParallelStyle):
        def _apply(self, module, mesh):
            return distribute_module(module, mesh, partition, inputs, lambda module, out, mesh: out.to_local())

    return HeadNorm()


def vocab_parallel_head():
    """A ParallelStyle for the LM head: its weight [V, H] split over the vocabulary (Shard(0)), its input (the
    replicated hidden states) made a Replicate DTensor, its logits left split over the vocabulary (a DTensor,
    Shard(-1)) for `vocab_parallel_cross_entropy`. Output that is not a DTensor passes through: the chunked loss
    head (`train.kernels.chunked_loss_head`) replaces the forward and returns the loss itself."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def partition(name, module, mesh):
        module.register_parameter("weight", _param(distribute_tensor(module.weight, mesh, [Shard(0)], src_data_rank=None)))
        if module.bias is not None:
            module.register_parameter("bias", _param(distribute_tensor(module.bias, mesh, [Shard(0)], src_data_rank=None)))

    def inputs(module, args, mesh):
        x = args[0]
        return (x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False), *args[1:])

    class VocabParallelHead(ParallelStyle):
        def _apply(self, module, mesh):
            return distribute_module(module, mesh, partition, inputs, lambda module, out, mesh: out)

    return VocabParallelHead()


def _param(tensor):
    import torch

    return torch.nn.Parameter(tensor, requires_grad=tensor.requires_grad)


def _style(name: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "head_norm":
        return head_norm()
    raise ValueError(f"unknown tensor-parallel style {name!r} (styles: {', '.join(STYLES)})")


def apply_tensor_parallel(model, family, mesh) -> int:
    """Split the language model of `model` (a transformers VLM of `family`, unwrapped or under peft) over the 1-D
    `mesh` (the run's `tp` dimension) in place: the family's plan per decoder layer, the embedding and LM head over
    the vocabulary (see the module docstring). Returns the number of modules split. Raises ConfigError where the
    family has no plan or no decoder layer has a module it names."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from vlmctl.families.spec import decoder_layers

    plan = dict(family.tensor_parallel_plan or {})
    if not plan:
        raise ConfigError(f"train.tensor_parallel: the {family.name} family has no tensor-parallel plan",
                          hint="set train.tensor_parallel: 1")
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    split = 0
    for layer in decoder_layers(inner, family):
        names = {name for name, _ in layer.named_modules()}
        layer_plan = {name: _style(style) for name, style in plan.items() if name in names}
        if layer_plan:
            parallelize_module(layer, mesh, layer_plan, src_data_rank=None)
            split += len(layer_plan)
    if not split:
        raise ConfigError(f"train.tensor_parallel: no decoder layer of this {family.name} model has the modules its "
                          f"plan names ({', '.join(plan)})", hint="set train.tensor_parallel: 1")
    embedding, head = inner.get_input_embeddings(), inner.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    # the vocabulary split: embedding rows (partial lookups summed), the head's logits left split for the loss
    parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate()), src_data_rank=None)
    if head is not None:
        parallelize_module(head, mesh, vocab_parallel_head(), src_data_rank=None)
        if tied:  # both split their rows (Shard(0)): one parameter again
            head.weight = embedding.weight
    return split + 2


# ------------------------------------------------------------------------------------------------ the loss


def is_vocab_parallel(tensor) -> bool:
    """True for logits (or an LM-head weight) split over the vocabulary by `apply_tensor_parallel`."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _autograd():
    import torch
    import torch.distributed as dist

    class CopyToTensorParallel(torch.autograd.Function):
        """Identity forward; backward sums the gradient over the tp group (Megatron-LM's `f`): the head's input is
        replicated, each rank's slice of the vocabulary adds its part of the input's gradient."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class VocabParallelCrossEntropy(torch.autograd.Function):
        """Cross-entropy of logits split over the vocabulary (Megatron-LM's `_VocabParallelCrossEntropy`,
        `megatron/core/tensor_parallel/cross_entropy.py`): the max, the sum of exponentials and the target's logit
        are reduced over the tp group; no rank holds the whole vocabulary's logits."""

        @staticmethod
        def forward(ctx, logits, targets, start, group):
            logits = logits.float()
            peak = logits.max(dim=-1).values
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            shifted = logits - peak.unsqueeze(-1)
            local = targets - start
            mine = (local >= 0) & (local < logits.shape[-1]) & (targets != -100)
            safe = local.clamp(0, logits.shape[-1] - 1)
            target_logit = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mine
            exp = shifted.exp()
            total = exp.sum(dim=-1)
            both = torch.stack([target_logit, total])
            dist.all_reduce(both, group=group)
            target_logit, total = both[0], both[1]
            ignored = targets == -100
            loss = torch.where(ignored, torch.zeros_like(total), total.log() - target_logit)
            ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), safe, mine, ignored)
            return loss

        @staticmethod
        def backward(ctx, grad):
            softmax, safe, mine, ignored = ctx.saved_tensors
            out = softmax.clone()
            out.scatter_add_(-1, safe.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
            out.mul_((grad * ~ignored).unsqueeze(-1))
            return out, None, None, None

    return CopyToTensorParallel, VocabParallelCrossEntropy


def vocab_parallel_cross_entropy(logits, targets):
    """Per-token cross-entropy (nats, fp32, 0 where `targets` is -100) of `logits` [..., V] split over the
    vocabulary (a DTensor, Shard(-1) on the tp mesh) against `targets` [...] (whole-vocabulary ids), without
    gathering the logits. Returns a plain tensor of `targets`' shape, the same on every tp rank."""
    _, parallel_ce = _autograd()
    mesh = logits.device_mesh
    local = logits.to_local()
    start = mesh.get_local_rank() * local.shape[-1]
    return parallel_ce.apply(local, targets, start, mesh.get_group())


def vocab_parallel_head_loss(hidden, weight, bias, targets):
    """Cross-entropy of `hidden` (n, H) (replicated over the tp ranks) through an LM head whose `weight` (V, H) is
    split over the vocabulary (a DTensor, Shard(0)), against `targets` (n,): each rank computes its (n, V / tp)
    logits only. Returns (n,) float32."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    copy, parallel_ce = _autograd()
    mesh = weight.device_mesh
    if isinstance(hidden, DTensor):  # the head's input hook made it a Replicate DTensor
        hidden = hidden.to_local()
    local_weight = weight.to_local()
    local_bias = bias.to_local() if bias is not None else None
    logits = F.linear(copy.apply(hidden, mesh.get_group()), local_weight, local_bias)
    start = mesh.get_local_rank() * local_weight.shape[0]
    return parallel_ce.apply(logits, targets, start, mesh.get_group())
