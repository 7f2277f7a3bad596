"""`parallelize`: everything a rank does to a prepared model over the run's mesh, in one fixed order (modelled on
torchtitan's `torchtitan/models/llama3/infra/parallelize.py` `parallelize_llama`).

::

    kernels, stage/freeze, LoRA         train.setup.prepare_model (before; see below)
      |
    0. float8 linears                   apply_float8            (torchao; train.fp8, `distributed.float8`)
    1. tensor-parallel plan             apply_tensor_parallel   (DTensor, `distributed.tensor_parallel`; tp > 1)
    2. sequence split                   split_sequence          (Ulysses, `distributed.sequence`; sp > 1)
    3. activation checkpointing         checkpoint_layers       (+ tiled MLP; trained models only)
    4. compile                          compile_layers          (per decoder layer / vision block)
    5. FSDP2 / HSDP | DDP | DeepSpeed   wrap                    (DeepSpeed: handed to `engine.build_engine`)

Why this order: float8 comes first, as torchtitan converts before `parallelize_llama`: the swapped layers
(`Float8Linear`) are what the tensor-parallel plan splits, what compile traces and what FSDP2 shards, which
all-gathers their weights in float8 (tensorwise); a conversion after sharding would leave FSDP2's bf16
all-gathers in place. The tensor-parallel plan and the sequence split change what a layer computes and must be in place
before a layer's forward is checkpointed (a recompute must run the split layer); checkpointing wraps the layer's
forward that compile then traces (torchtitan: "apply AC before compile"); FSDP2 shards last, over the layers as
they will run, and each checkpointed or compiled layer becomes one FSDP unit. Neither checkpointing nor compile
renames a parameter, so weights read before (`setup.defer_weights`) fit the wrapped model.

The kernels (attention backend, liger-kernel, the vision tower's kernels) are applied by `setup.prepare_model` to
the bare HF model before peft wraps it, not here: liger patches the HF classes' forwards and the vision kernels
replace HF modules, which must happen before LoRA's adapters and the cost model read the model.

`trainable=False` serves a frozen model a run holds next to the trained one (forward only, no optimizer: a
reference model of a preference objective): every parameter is frozen and the model is put in eval mode, no layer
is converted to float8 or checkpointed (there is no backward to save memory for), DDP is not applied (nothing to reduce) and under
DeepSpeed the model is placed on the device whole (DeepSpeed's engine is built for a trained model).

The autotune probe changes the checkpointing mode of a wrapped model through step 3 (`checkpoint_layers`): a mode
only replaces the layers' instance `forward` (`distributed.checkpointing`), so it can change after FSDP2 wrapped them.
Its float8 trial switches the layers step 0 converted between float8 and bf16 the same way (`float8.use_float8`).
"""

from __future__ import annotations

from vlmctl.config.plan import pending
from vlmctl.distributed import float8
from vlmctl.distributed.checkpointing import apply_activation_checkpointing, apply_tiled_mlp
from vlmctl.distributed.ddp import apply_ddp
from vlmctl.distributed.engine import strategy_of
from vlmctl.distributed.fsdp import apply_fsdp
from vlmctl.distributed.sequence import SequenceShard, apply_sequence_parallel, check_sequence_parallel
from vlmctl.distributed.weights import place_weights
from vlmctl.errors import ConfigError

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.


def parallelize(model, *, family, parts, train, dims, device, dtype, core_attention=None, deferred=None,
                trainable: bool = True):
    """Apply steps 0-5 of the module docstring to `model` (prepared by `setup.prepare_model`; `parts`: its
    `setup.ModelParts`) on this rank and return the module to train or run: FSDP2-sharded, DDP-wrapped, on
    `device`, or (DeepSpeed) as it is for `engine.build_engine`.

    Reads `train.strategy` (resolved), `fp8`, `sequence_parallel`, `packing`, `activation_checkpointing`,
    `activation_offload`, `tiled_mlp`, `compile`, `compile_vision`, `fsdp_reshard_after_forward`, `fsdp_prefetch`,
    `fsdp_reduce_dtype`, `master_weights`;
    `dims`: the run's `ParallelDims` (mesh built); `dtype`: the compute dtype (FSDP2's `param_dtype`); `core_attention`:
    the attention the sequence split runs after Ulysses' all-to-all (`train.kernels.sequence_core_attention`: the
    varlen kernel where the run attends with it; None: sdpa with the row's segment mask);
    `deferred`: the weights rank 0 alone read (`setup.defer_weights`), placed once the model is wrapped;
    `trainable`: False for a frozen model (see the module docstring). Collective under FSDP2 and DDP.
    Raises ConfigError where the sequence cannot be split (`sequence.check_sequence_parallel`).
    """
    if not trainable:
        for param in model.parameters():
            param.requires_grad_(False)
        model.eval()
    if trainable:
        apply_float8(model, family, train, device)
    apply_tensor_parallel(model, family, dims)
    split_sequence(model, family, train, dims, core_attention)
    if trainable:
        checkpoint_layers([parts.decoder_layers, parts.vision_layers], train.activation_checkpointing, train)
        tile_mlps(parts, train.tiled_mlp)
    compile_layers(parts, train)
    return wrap(model, parts, train, dims, device, dtype, deferred=deferred, trainable=trainable)


def apply_float8(model, family, train, device) -> None:
    """Step 0: the language model's linear layers (the family's `float8_linears` of multiples of 16) swapped for
    torchao's float8 layers (`distributed.float8.convert`) with `train.fp8`'s recipe; under FSDP2 the tensorwise
    recipe all-gathers their weights in float8. `train.fp8: auto` still pending (the start-up probe's float8 trial
    decides it) converts the layers large enough for tensorwise float8 without the float8 all-gather and leaves
    them computing in bf16 until the trial (`float8.use_float8`); where no layer passes torchao's size rule nothing
    converts and the trial keeps bf16. Which layers convert: every aligned one (`train.fp8_layers: all`) or those
    the size rule keeps (`sized`), less those `train.fp8_skip` names; `train.fp8_fast_accum` picks the matmuls with
    cuBLAS's fast accumulation. Off CUDA the float8 matmuls are emulated (tests; the plan refuses float8 training
    there). Nothing for `off`; a frozen model is never converted.

    Raises ConfigError when a recipe set in the config leaves no layer to convert (train.fp8_layers and
    train.fp8_skip named)."""
    if train.fp8 == "off":
        return
    trial = pending(train.fp8)
    recipe = "tensorwise" if trial else train.fp8
    skip = tuple(train.fp8_skip)
    sized = train.fp8_layers == "sized" or (trial and not float8.convertible(model, family, "tensorwise", skip))
    state = float8.convert(model, family, recipe, all_gather=strategy_of(train.strategy).fsdp and not trial,
                           emulate=device.type != "cuda", sized=sized, skip=skip, fast_accum=train.fp8_fast_accum)
    if not trial and not state.layers:
        rule = "torchao's size rule (train.fp8_layers=sized)" if sized else "its alignment to 16"
        skipped = f" and train.fp8_skip={list(skip)}" if skip else ""
        raise ConfigError(f"train.fp8={recipe}: no linear layer of the language model is left for {recipe} float8 "
                          f"under {rule}{skipped}, so the run would train in bf16",
                          hint="set train.fp8=off (the float8 matmuls would not pay at these sizes), "
                               "train.fp8_layers=all to convert every layer whose dimensions are multiples of 16"
                               + (", or name fewer fragments in train.fp8_skip" if skip else ""))
    if trial:
        float8.use_float8(model, False)


def apply_tensor_parallel(model, family, dims) -> None:
    """Step 1: with tensor parallelism (`dims.tp` > 1) split the language model of `model` over the mesh's `tp`
    dimension by the family's plan (`distributed.tensor_parallel.apply_tensor_parallel`: columns / rows of each
    decoder layer, the vocabulary of the embedding and LM head; the vision tower replicated). Raises ConfigError
    where the family has no plan or `tp` does not divide the heads, MLP width or vocabulary."""
    if dims.tp <= 1:
        return
    from vlmctl.distributed.tensor_parallel import apply_tensor_parallel as split, check_tensor_parallel

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    check_tensor_parallel(dims.tp, inner.config.get_text_config(), family, inner.get_input_embeddings().weight.shape[0])
    split(model, family, dims.tp_mesh)


def sequence_shard(dims):
    """This rank's `sequence.SequenceShard` (None without sequence parallelism): what the loss of a split row needs
    (`train.objectives.SFTObjective.shard`)."""
    if dims.sp <= 1:
        return None
    return SequenceShard(dims.sp_group, dims.sp_rank, dims.sp)


def split_sequence(model, family, train, dims, core_attention=None) -> None:
    """Step 2: with sequence parallelism (`dims.sp` > 1) split the language model of `model` over this rank's
    sequence-parallel group (`sequence.apply_sequence_parallel`). The core attention after Ulysses' all-to-all is
    `core_attention` (the varlen kernel on CUDA), else sdpa with the row's segment mask. Raises ConfigError where
    the model cannot be split (padded batches, heads that do not divide, DeepSpeed missing)."""
    shard = sequence_shard(dims)
    if shard is None:
        return
    check_sequence_parallel(dims.sp, model.config.get_text_config(), packing=train.packing)
    apply_sequence_parallel(model, family, shard, core_attention)


def checkpoint_layers(layer_groups, mode, train) -> None:
    """Step 3: activation checkpointing `mode` (`train.activation_checkpointing`: off, full, op, keep_attention,
    vision or a stride; `distributed.checkpointing`) on `layer_groups` ([decoder layers, vision blocks]), with
    `train`'s `activation_offload` and decoder-layer limit (`activation_checkpointing_layers`), replacing the mode set
    before. auto leaves the layers as they are: the start-up probe (`train.autotune.probe`) calls this on the
    wrapped model with each mode it tries, then with its choice."""
    if not pending(mode):
        apply_activation_checkpointing(layer_groups, mode, offload=train.activation_offload,
                                       layers=train.activation_checkpointing_layers)


def tile_mlps(parts, slices) -> None:
    """Step 3 too: the decoder layers' MLPs over `slices` parts of the row (`train.tiled_mlp`,
    `distributed.checkpointing.apply_tiled_mlp`), a memory helper of the backward like checkpointing."""
    apply_tiled_mlp(parts.decoder_layers, slices)


# inductor settings for the layers compiled with dynamic sizes (`compile_layers`): see its docstring
DYNAMIC_OPTIONS = {"triton.mix_order_reduction_non_strict_mode": True}


def dynamic_compile_options() -> dict:
    """The `DYNAMIC_OPTIONS` the installed torch has (`torch._inductor.config`; an older torch lacks some), for
    `torch.compile(options=...)`, which refuses a setting it does not know."""
    from torch._inductor import config

    def known(key: str) -> bool:
        section, _, name = key.rpartition(".")
        return hasattr(getattr(config, section) if section else config, name)

    return {key: value for key, value in DYNAMIC_OPTIONS.items() if known(key)}


def compile_layers(parts, train) -> None:
    """Step 4: torch.compile per decoder layer (`train.compile: on`; dynamic shapes with packing, as packed rows
    change length every step) and per vision block (`train.compile_vision: blocks`; dynamic, as the patch count
    changes every step).

    Either dynamic case turns off Dynamo's duck sizing (`torch.fx.experimental._config.use_duck_shape`, read when a
    layer is traced, so it is set for the process). With duck sizing, sizes that happen to be equal in the traced
    step share one symbol, and that equality becomes a guard. A packed row whose `cu_seqlens` length equals another
    dimension (the vision tower's 4-patch merge unit, for example) then recompiles the layers in the step where the
    sizes differ: a 16.4 s step against 5.2-5.7 s for the 7B at 65,536 tokens; with duck sizing off, no measured
    step of that row recompiled (docs/benchmarks.md).

    The dynamic compiles also take `dynamic_compile_options`: inductor's mix-order reduction (one kernel for a
    backward's row and column reductions, as an RMSNorm's input and weight gradients) checks by default that the
    traced size has at least 4,096 rows and twice as many rows as columns, and guards on the answer. A later step
    with fewer rows (a tower of fewer than 4,096 patches, a short packed row) then recompiled every block: the
    7B's vision blocks recompiled twice inside a measured step, 1.0-1.8 s with inductor's caches warm and 6.0 s cold
    (docs/benchmarks.md). Its non-strict mode skips those size checks, so nothing is guarded on them."""
    dynamic = (train.compile == "on" and train.packing) or train.compile_vision == "blocks"
    if dynamic:
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False
    options = dynamic_compile_options() if dynamic else {}
    if train.compile == "on":
        for layer in parts.decoder_layers:
            layer.compile(dynamic=train.packing, options=options if train.packing else None)
    if train.compile_vision == "blocks":
        for block in parts.vision_layers:
            block.compile(dynamic=True, options=options)


def wrap(model, parts, train, dims, device, dtype, *, deferred=None, trainable: bool = True):
    """Step 5: FSDP2 per vision block and decoder layer then the root over `dims.fsdp_mesh` (HSDP with a
    `dp_replicate` dimension; `distributed.fsdp.apply_fsdp`), then rank 0's weights placed (`distributed.weights.place_weights`);
    or DDP over the gradient mesh (`distributed.ddp.apply_ddp`; not in one process, where it would only copy every
    gradient into its buckets, nor for a frozen model); or, under DeepSpeed, nothing: `engine.build_engine` hands
    the model to `deepspeed.initialize` (a frozen model is moved to `device` instead)."""
    strategy = strategy_of(train.strategy)
    if strategy.deepspeed:
        return model if trainable else model.to(device)
    if strategy.fsdp:
        model = apply_fsdp(model, parts, dims.fsdp_mesh, param_dtype=dtype,
                           reshard_after_forward=train.fsdp_reshard_after_forward, prefetch=train.fsdp_prefetch,
                           reduce_dtype=train.fsdp_reduce_dtype, master_weights=train.master_weights)
        place_weights(model, deferred, device)  # rank 0's weights, into every rank's shards
        return model
    place_weights(model, deferred, device)  # empty storage; DDP broadcasts rank 0's weights
    model = model.to(device)
    if trainable and strategy.ddp and dims.grad_size > 1:
        model = apply_ddp(model, dims.grad_mesh, device)
    return model

