"""`train` section: stage, strategy, launcher, optimization, packing, LoRA, checkpoints."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from vlmctl.config.base import ProjectPath, Section
from vlmctl.config.objective import OBJECTIVE_NAMES, DPOSection, GRPOSection, ObjectiveSection, ORPOSection

SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def name_problem(value: str) -> str | None:
    """Why `value` cannot be a folder name and a shell word (None when it can): letters, digits and `._-` only,
    no `..`, not starting with `.` or `-`, at most 128 characters."""
    if not value:
        return "must not be empty"
    if len(value) > 128:
        return "must be at most 128 characters"
    if ".." in value or not SAFE_NAME.fullmatch(value):
        return "may hold only letters, digits and . _ - (no '/', no '..', no spaces; not starting with '.' or '-')"
    return None


class LoraSection(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input. 0 by default, as peft's `LoraConfig` and LLaMA-Factory: a nonzero value keeps a dropped-out copy of every adapted layer's input (measured 7% fewer tokens/s on the 3B preset, docs/benchmarks.md); the QLoRA paper used 0.05-0.1 as a regularizer on small data sets (Dettmers et al. 2023, arXiv:2305.14314).")
    target_modules: list[str] | Literal["auto"] = Field("auto", description="Module name patterns to adapt; auto = the language model's linear layers.")
    quantize: Literal["none", "4bit", "8bit"] = Field("none", description="QLoRA: load the frozen base in 4-bit (nf4) or 8-bit (bitsandbytes, GPU only).")
    keep_adapter: bool = Field(False, description="Keep the final export as a peft adapter instead of merging it.")


class TrainSection(Section):
    stage: Literal["align", "finetune", "full"] = Field("finetune", description="align: projector only; finetune: projector + LLM; full: everything.")
    freeze: list[Literal["vision", "projector", "llm"]] | None = Field(None, description="Parts to freeze, overriding the stage's default.")
    strategy: Literal["auto", "ddp", "fsdp", "zero2", "zero3"] = Field("auto", description="Data-parallel strategy: ddp, fsdp (FSDP2), zero2, zero3 (DeepSpeed); auto = fsdp on GPUs (weights, gradients and AdamW state sharded; fp32 master weights computed on bf16 copies gathered per layer), ddp on one GPU storing bf16 weights (nothing to shard or cast), on CPU and for QLoRA. ddp in one process trains the model unwrapped (DDP would only copy its gradients).")
    launcher: Literal["torchrun", "accelerate", "slurm", "none"] = Field("torchrun", description="How processes are spawned; none runs in this process.")
    nproc_per_node: int | Literal["auto"] = Field("auto", description="Processes per node; auto = visible GPUs, else 1.")
    nnodes: int = Field(1, gt=0, description="Number of nodes.")
    node_rank: int = Field(0, ge=0, description="Rank of this node (multi-node torchrun/accelerate).")
    master_addr: str = Field("127.0.0.1", description="Rendezvous host (multi-node).")
    master_port: int = Field(29500, gt=0, lt=65536, description="Rendezvous port. Multi-node runs use it as given; single-node runs use it when it is free and no other vlmctl run on the machine claimed it, else a free port.")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description="Compute precision; auto = bf16 on GPUs that support it, fp32 on CPU.")
    master_weights: Literal["auto", "fp32", "bf16"] = Field("auto", description="Stored trained parameters, gradients and AdamW state: fp32 master weights with compute in train.precision (mixed precision: 16 bytes per trained parameter), or bf16 throughout (8 bytes: half the memory of weights, gradients and optimizer state; ddp/fsdp only). In bf16 an update smaller than half the weight's spacing (2^-8 of its size) is rounded away with round-to-nearest, so fine-tuning learning rates lose most updates (Micikevicius et al. 2018, arXiv:1710.03740); train.stochastic_rounding (on with bf16) rounds each update up or down with the probabilities that keep it unbiased, which closed the gap to fp32 master weights in these studies (Zamirai et al. 2020, arXiv:2010.06192; Ozkara et al. 2025, arXiv:2502.20566). auto = bf16 with stochastic rounding on a GPU computing in bf16 with ddp or fsdp when full weights are trained (the memory goes into longer rows and less recomputation), fp32 with LoRA (peft keeps adapters in fp32), DeepSpeed (its own fp32 master copy), on CPU, or without torchao. Frozen parameters are stored in the compute dtype either way.")
    stochastic_rounding: Literal["auto", "on", "off"] = Field("auto", description="With bf16 master weights: round every AdamW update to bf16 stochastically (the update computed in fp32 by torchao's AdamW step with bf16_stochastic_round, compiled once for every parameter size; the moments stored in bf16 as in DeepSeek-V3's training, arXiv:2412.19437 section 3.3.3), or to nearest (torch's fused AdamW: a few percent faster, loses updates below 2^-8 of a weight). auto = on with bf16 master weights when torchao is installed; no effect with fp32 master weights.")
    micro_batch_size: int | Literal["auto"] = Field("auto", description="Samples per device per forward pass (without packing; packing uses tokens_per_batch); auto = the largest that fits in GPU memory, measured by a probe at start-up (ddp/fsdp on a GPU), else 1.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    learning_rate: float = Field(2e-5, gt=0, description="Peak learning rate.")
    vision_lr: float | None = Field(None, gt=0, description="Learning rate of the vision tower when it is trained (default: learning_rate).")
    projector_lr: float | None = Field(None, gt=0, description="Learning rate of the projector (default: learning_rate).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="LR schedule after warmup (transformers.get_scheduler).")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps used for linear warmup.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm (0 disables).")
    optimizer_in_backward: bool = Field(False, description="Step AdamW per parameter as soon as its gradient is ready in the backward pass and free the gradient (saves the gradient memory); needs max_grad_norm 0, gradient_accumulation_steps 1, and fsdp or a single process.")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to run; overrides num_epochs when set.")
    num_epochs: float = Field(1.0, gt=0, description="Passes over the training data (when max_steps is unset).")
    max_bad_steps: int = Field(10, ge=0, description="Steps with NaN/inf loss that are skipped before the run aborts.")
    gc_freeze_step: int = Field(3, ge=0, description="After this many steps of a training process (the compile and the first allocations done), the objects alive are moved out of the garbage collector's reach (gc.freeze, Python's gc module; as vlmctl serve does after its warm-up), so the full collections the interpreter runs now and then walk only what later steps allocate, not the hundreds of thousands of objects torch.compile, transformers and the model leave behind; each such collection stops the step it falls in (on one H200 a full collection took 0.48 s of one of the 7B's float8 steps without the freeze, none over 1.2 ms with it: docs/benchmarks.md). 0 = never. Objects are still freed by their reference counts; only reference cycles made before the freeze stay.")
    packing: bool = Field(True, description="Pack samples into token-budget batches with per-sample attention (no padding).")
    tokens_per_batch: int | Literal["auto"] = Field("auto", description="Token budget of one packed micro-batch per device; auto = the fastest budget that fits in GPU memory, measured by a probe at start-up (ddp/fsdp on a GPU); on CPU the packed row length `vlmctl data prepare` suggested for the data (manifest.json) when below 8192; else 8192.")
    sequence_parallel: int = Field(1, ge=1, description="Ranks that split each packed row along the sequence (Ulysses sequence parallelism: DeepSpeed-Ulysses' all-to-alls around the attention, with fsdp, ddp, zero2 or zero3): a row of up to tokens_per_batch x sequence_parallel tokens is spread over that many GPUs, so one sample can be longer than one GPU holds. Must divide the processes per node and the language model's attention heads; needs packing. 1 = off.")
    tensor_parallel: int = Field(1, ge=1, description="Ranks that split each decoder layer of the language model (Megatron-style tensor parallelism as PyTorch DTensor plans): q/k/v and gate/up by columns, o and down by rows, the embedding and LM head over the vocabulary (with a vocabulary-parallel loss); the vision tower is replicated. The ranks of a group read the same batch, so data parallelism is processes / tensor_parallel; with fsdp the parameters are sharded over both. Must divide the processes per node, the attention and key/value heads, the MLP width and the vocabulary; trains the sft objective with full weights (no LoRA), with fsdp (or ddp when all processes form one group), not with sequence_parallel or DeepSpeed. With a train.fp8 recipe the float8 layers are split the same way, each tensor scaled over its whole (all tp ranks' amax); fp8 auto stays off (its start-up trial does not run under tensor parallelism). Pipeline parallelism is not offered: docs/megatron.md says why and what to use. 1 = off.")
    activation_offload: bool = Field(False, description="With activation checkpointing (full or every k-th layer): keep each checkpointed layer's input hidden states in pinned host memory instead of GPU memory, copied back for the layer's recompute in backward (the ALST paper's checkpoint offload, arXiv 2506.13996). Saves (layers x tokens x hidden size) of GPU memory for long rows at the cost of PCIe traffic; no effect without checkpointing or on CPU.")
    tiled_mlp: int | Literal["off"] = Field("off", description="Run each decoder layer's MLP over this many slices of the sequence, recomputing a slice's intermediate activations in backward (DeepSpeed's TiledMLP, the ALST paper, arXiv 2506.13996): the MLP's (tokens x intermediate size) activations shrink by that factor, for very long rows. off = one pass.")
    group_by_modality: bool = Field(False, description="Every optimizer step draws its samples from one modality (image, video, audio or text-only) on every data-parallel rank, so no rank runs a dummy input for a modality another rank has; off (the default) mixes modalities and gives a rank without one a dummy input so every rank runs every tower.")
    group_by_length: bool = Field(True, description="Batch samples of similar length together (without packing).")
    balance: Literal["auto", "on", "off"] = Field("auto", description="Compute-balanced batches: each optimizer step's samples are split again over the data-parallel ranks and accumulated micro-batches so that their estimated training FLOPs (vision tower, attention's quadratic term, LM head on labelled tokens: vlmctl/train/flops.py) are as equal as possible, within tokens_per_batch (packed) or micro_batch_size (padded). A step keeps the same samples, so its loss is unchanged. auto = on with more than one data-parallel rank; on also balances one rank's accumulated micro-batches; off keeps the token-packed (or length-grouped) split.")
    attn_implementation: Literal["auto", "varlen", "flash_attn", "sdpa", "flex", "eager"] = Field("auto", description="Attention backend; auto picks varlen on CUDA and sdpa/flex on CPU.")
    liger: Literal["auto", "on", "off"] = Field("auto", description="liger-kernel fused cross-entropy and norms (CUDA only); auto = when installed.")
    compile: Literal["auto", "on", "off"] = Field("auto", description="torch.compile each language-model decoder layer (with dynamic shapes for packed rows; fuses norms, SwiGLU, rotary and LoRA's adapter arithmetic, and cuts the host's per-kernel launch work). auto = on for ddp/fsdp on a GPU except QLoRA (bitsandbytes' 4/8-bit layers are not compiled), else off. true/false read as on/off. Why: on one H100 it raised the 3B preset's tokens/s by 15% (full fine-tuning, every 2nd layer checkpointed, 16,384 tokens) and LoRA's by 37% (docs/benchmarks.md); the first steps take longer (compilation).")
    fp8: Literal["auto", "off", "tensorwise", "rowwise"] = Field("auto", description="FP8 training: the language model's linear layers (those inside its decoder layers; never the LM head, the embeddings, MoE router gates, the vision/audio encoders or the projector, nor a layer with a dimension not divisible by 16) compute their matmuls in float8 (torchao's convert_to_float8_training; the inputs, weights and output gradients are scaled and cast to float8 e4m3/e5m2 for each matmul). Weights, gradients, AdamW state, checkpoints and exports stay bf16/fp32, so a run can resume with fp8 switched on or off. tensorwise = one scale per tensor (cuBLAS; under fsdp the weights are all-gathered in float8 and their scales computed in one all-reduce after each optimizer step); rowwise = one scale per row (more accurate, slower). Needs a GPU with compute capability >= 8.9 (H100, H200, L40S, RTX 4090, B200), torchao, ddp or fsdp (not DeepSpeed), the language model's full weights trained (no LoRA/QLoRA), bf16 compute and compiled decoder layers (train.compile, turned on where auto). With train.tensor_parallel the converted layers are split over the tp ranks (set a recipe: auto is off there). auto = tensorwise where all of that holds, the language model's linears are large enough (torchao's size rule for tensorwise) and the start-up probe measured it faster than bf16 on the run's rows, else off; the run's plan says why (auto converts without the float8 all-gather: the probe runs the same layers in both precisions). Why: on one H200 compiled stacks of the 7B's decoder linears (8,192 tokens, forward + backward) ran 1.46x bf16 tensorwise and 1.04x rowwise; a whole step gains less (the vision tower, attention, the loss and the optimizer stay bf16/fp32; benchmarks/bench_fp8_gpu.sh measures whole steps). MFU is still counted against the bf16 peak.")
    fp8_layers: Literal["all", "sized"] = Field("sized", description="Which of the language model's linear layers float8 converts (train.fp8 tensorwise, rowwise, or auto once its trial keeps float8): sized = only those torchao's size rule for the recipe keeps (torchao.float8's _auto_filter_for_recipe, from its H100 measurements: tensorwise skips a layer with in_features <= 4096 and out_features <= 1024, such as the key/value projections of the 3B and 7B presets; rowwise skips more); all = every layer whose dimensions are multiples of 16. Measured on H200s (docs/benchmarks.md), the 7B preset at 8,192-token rows, tensorwise: 1.10-1.23x bf16 with all and 1.11-1.25x with sized over every pair measured, neither ahead in every call; over 300 steps of the 3B from the same seed the last 100 steps' mean loss was 5.1% above bf16 with all (one run) and 0.76% above on average with sized (five runs: -0.73% to +2.65%; bf16 itself, run twice on the same seed and data, differed by 1.6%), so sized is the default. A recipe that leaves no layer to convert is refused with this key named. auto tries float8 only where at least one layer passes the size rule.")
    fp8_skip: list[str] = Field(default_factory=list, description="Module-path fragments of the language model's linear layers float8 never converts, on top of train.fp8_layers (torchtitan's float8 filter_fqns): a layer whose path contains one of them stays bf16, e.g. [q_proj, o_proj] keeps the attention's projections in bf16 and converts only the MLP. A recipe that leaves no layer to convert is refused with this key named.")
    fp8_fast_accum: Literal["forward", "all"] = Field("forward", description="Which float8 matmuls accumulate with cuBLAS's fast accumulation (torchao's Float8GemmConfig.use_fast_accum; train.fp8 tensorwise or rowwise): forward = the output matmul only (torchao's default: the two backward matmuls, input and weight gradients, promote their partial sums to fp32 more often, as Transformer Engine's split accumulator does); all = the backward matmuls too. On one H200, compiled 7B-shaped decoder blocks at 8,192 tokens ran 1.33x bf16 with forward and 1.39-1.40x with all, the whole 7B step about 3% faster (docs/benchmarks.md), at the cost of gradients summed with fewer fp32 promotions over long inner dimensions (the row's tokens for weight gradients). Its convergence is not established: the 3B over 300 steps from one seed ended 5.4-5.5% below bf16's loss (two pairs; that float8 run repeated itself to the last digit) and 15.9 points above its eval accuracy, outside the band the default stays in, so forward is the default.")
    compile_vision: Literal["auto", "blocks", "kernels", "off"] = Field("auto", description="torch.compile in the vision tower: blocks = each vision block whole, as train.compile does the decoder layers (fuses its norms, residual adds, rotary and MLP, and lets the compiled backward recompute elementwise results instead of keeping them; attention stays the backend's kernel); kernels = only its rotary embedding and width-aligned MLP; off = eager. auto = blocks where the decoder layers are compiled (train.compile on), kernels on other CUDA runs, off on CPU. on (the older word) reads as kernels.")
    activation_checkpointing: Literal["auto", "off", "full", "op", "keep_attention", "vision"] | int = Field("auto", description="Recompute activations in the backward pass to save memory: off; full = every decoder layer and vision block; an integer k = every k-th layer (selective per layer); op = every layer, keeping matmul and attention outputs (selective per op); keep_attention = every layer, keeping only the attention kernels' outputs (long rows: attention, most of their FLOPs, is not recomputed, for one (tokens x hidden) tensor more per layer); vision = every vision block, no decoder layer; auto = the fastest mode that fits, measured by the start-up probe (ddp/fsdp on a GPU), else off.")
    activation_checkpointing_layers: int | None = Field(None, ge=0, description="Checkpoint only the first N decoder layers in the mode activation_checkpointing names (full, op, keep_attention or every k-th); the last layers keep all their activations and are not recomputed (Megatron-LM's recompute_method block with recompute_num_layers N). For rows that leave GPU memory beside checkpointing every layer, such as sequence-parallel rows, whose auto mode is full: each layer left out saves its forward's recompute for its activations. The vision blocks follow the mode. null = every decoder layer the mode names.")
    gradient_checkpointing: bool | None = Field(None, description="Older name: true = activation_checkpointing: full, false = off (when activation_checkpointing is auto).")
    fsdp_sharding: Literal["full", "hybrid"] = Field("full", description="FSDP2 (train.strategy: fsdp) over several nodes: full = parameters, gradients and optimizer state sharded over every rank of the run; hybrid = sharded over the ranks of one node and replicated across nodes (HSDP on a (nodes x processes per node) mesh, what FSDP1 calls HYBRID_SHARD): the per-layer all-gathers and reduce-scatters stay on the fast links inside a node, one all-reduce of the gradient shards per step crosses nodes, and each rank holds 1/(processes per node) of the model state instead of 1/(all ranks). Needs the same number of processes on every node. On one node both are the same.")
    fsdp_reshard_after_forward: bool | Literal["auto"] = Field("auto", description="FSDP2: true frees each layer's gathered weights after its forward and gathers them again for backward (least memory; the last decoder layer, whose backward follows at once, is kept); false keeps every layer gathered from its forward to its backward: one all-gather per layer and micro-batch less (a third of FSDP's traffic), for the memory of the whole model in the compute dtype on every rank (as ZeRO-2). auto = true on a one-rank shard group (one GPU: keeping the gathered copy saves no collective and doubles the weights), false when the shard group has 2 to 8 ranks and the gathered layers take at most a quarter of a rank's memory (GPU memory; on CPU the machine's memory per process), else true. Why: on one node of 4 H200s false raised per-GPU efficiency from 75.0% to 82.7% (docs/benchmarks.md); the gathered model does not shrink with more ranks while the sharded state does, so a shard group wider than one 8-GPU node (full sharding across nodes, chosen for its memory) keeps resharding (hybrid sharding keeps the shard group inside a node and gets false), and the quarter leaves the rest to the sharded state and the activations, whose batch the start-up probe fits. The embeddings and the LM head are never resharded after forward (they stay in FSDP2's root group, gathered once per step).")
    fsdp_prefetch: Literal["auto", "off"] | int = Field("auto", description="FSDP2: how many layers ahead each layer issues its all-gathers (FSDPModule.set_modules_to_forward_prefetch / set_modules_to_backward_prefetch, as torchtitan sets them): 1 overlaps as FSDP2's implicit prefetch does but issues each all-gather earlier from the CPU, at no extra memory; N >= 2 keeps up to N + 1 layers gathered at once (more memory), for links too slow to hide one layer's all-gather behind one layer's compute; off leaves FSDP2's implicit prefetch. auto = 1. The results are the same whatever the setting.")
    fsdp_reduce_dtype: Literal["auto", "fp32", "bf16"] = Field("auto", description="FSDP2 with bf16 compute: the dtype the gradients are reduce-scattered in (MixedPrecisionPolicy.reduce_dtype). fp32 casts each bf16 gradient to fp32 for the reduction (twice the bytes on the links, a cast before and after); bf16 reduces the bf16 gradients as they are. auto = bf16 with bf16 master weights (train.master_weights: the reduced shard is stored in bf16 anyway; over 2 ranks the bf16 sum rounds once, as the fp32 sum cast back does, over more each hop of the ring rounds its partial sum), fp32 with fp32 master weights, whose fp32 gradient shards keep the fp32 sum. Measured once on the 7B over 2 H200s: 0.91 s per step against 1.01 s, the fp32 run first on a fresh machine (docs/benchmarks.md).")
    lora: LoraSection | None = Field(None, description="LoRA/QLoRA adapters through peft; unset trains full weights.")
    objective: Literal[OBJECTIVE_NAMES] = Field("sft", description="What the run optimizes: sft (next-token cross-entropy on the assistant turns), dpo (preference pairs, data.kind: preference; train.dpo) or grpo (rollouts scored by rewards on prompts with reference answers; train.grpo) or orpo (preference pairs without a reference model; train.orpo). Names the run folder after the stage for sft, after the objective otherwise. See docs/post-training.md.")
    dpo: DPOSection = Field(default_factory=DPOSection, description="Settings of train.objective: dpo.")
    grpo: GRPOSection = Field(default_factory=GRPOSection, description="Settings of train.objective: grpo.")
    orpo: ORPOSection = Field(default_factory=ORPOSection, description="Settings of train.objective: orpo.")
    deepspeed_config: ProjectPath | None = Field(None, description="A DeepSpeed JSON config to use instead of the generated one (\"auto\" values are filled in).")
    num_workers: int = Field(2, ge=0, description="DataLoader worker processes per rank.")
    save_steps: int = Field(500, gt=0, description="Save a checkpoint every this many optimizer steps.")
    save_total_limit: int | None = Field(3, gt=0, description="Keep at most this many checkpoints (oldest pruned).")
    logging_steps: int = Field(10, gt=0, description="Log metrics every this many steps.")
    eval_steps: int | None = Field(None, gt=0, description="Validate every this many optimizer steps and at the last step: the loss on the prepared val split (data.prepared_dir/val; data.val_ratio sets its size), batched as training batches (packed or padded) on every rank and normalised as the training loss (summed token loss / label tokens over the data-parallel ranks). Shown in the step line as val loss, recorded as val_loss in metrics.jsonl, TensorBoard and W&B (eval/loss), and drawn on loss.png. Unset = no validation.")
    save_best: Literal["val_loss"] | None = Field(None, description="Keep the checkpoint of the best value of this validation metric (needs eval_steps): the best step is checkpointed when it is not a save step, kept past save_total_limit, recorded in trainer_state.json (a resumed run continues from it) and named in final/best_checkpoint.json. val_loss: lower is better.")
    early_stopping_patience: int | None = Field(None, gt=0, description="Stop (checkpoint and export) after this many validations in a row without a better value of save_best's metric (val_loss when save_best is unset); needs eval_steps. Unset = never stop early.")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list, description="Experiment trackers to log to.")
    resume: str | None = Field(None, description="auto = continue from the last complete checkpoint; or a checkpoint path.")
    run_name: str | None = Field(None, description="Run folder name under output_dir: letters, digits and . _ - only (default: <project>-<stage>-<timestamp>, with -2, -3, ... when taken). A fresh run refuses a name that already holds a run; --resume continues it.")
    output_dir: ProjectPath = Field(Path("outputs/runs"), description="Where run folders (config, checkpoints, metrics, final export) go.")
    seed: int = Field(0, ge=0, description="Training seed (initialization, data order, dropout).")

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _yaml_checkpointing_word(cls, value):
        """YAML 1.1 reads a bare `off` as false (and `on` as true): take `off` as typed, `on` as full."""
        return {True: "full", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("stochastic_rounding", "liger", "compile", "balance", mode="before")
    @classmethod
    def _yaml_switch_word(cls, value):
        """YAML 1.1 reads a bare `on` / `off` as true / false: take them as typed."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("fp8", mode="before")
    @classmethod
    def _yaml_fp8_word(cls, value):
        """YAML 1.1 reads a bare `off` as false: take it as typed; true names no recipe."""
        if value is True:
            raise ValueError("must name a recipe: tensorwise, rowwise, auto or off")
        return "off" if value is False else value

    @field_validator("fsdp_prefetch", mode="before")
    @classmethod
    def _yaml_prefetch_word(cls, value):
        """YAML 1.1 reads a bare `off` as false (and `on` as true): take `off` as typed, `on` as auto."""
        value = {True: "auto", False: "off"}.get(value, value) if isinstance(value, bool) else value
        if isinstance(value, int) and value <= 0:
            raise ValueError("must be auto, off or a positive number of layers")
        return value

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _yaml_tiles_word(cls, value):
        """YAML 1.1 reads a bare `off` as false; one slice or fewer is off."""
        if value is False or (isinstance(value, int) and not isinstance(value, bool) and value <= 1):
            return "off"
        if value is True:
            raise ValueError("must be off or a number of slices (2 or more)")
        return value

    @field_validator("micro_batch_size", "tokens_per_batch", "activation_checkpointing")
    @classmethod
    def _positive(cls, value):
        if isinstance(value, int) and value <= 0:
            raise ValueError("must be a positive integer or auto")
        return value

    @model_validator(mode="after")
    def _deepspeed_config_needs_deepspeed(self):
        """A DeepSpeed JSON is read only by the DeepSpeed strategies: set with another, it would be ignored."""
        if self.deepspeed_config is not None and self.strategy not in ("zero2", "zero3"):
            raise ValueError(f"train.deepspeed_config is read only by train.strategy zero2 or zero3, not {self.strategy}: "
                             "set train.strategy=zero2 (or zero3), or remove train.deepspeed_config")
        return self

    @model_validator(mode="after")
    def _objective_fits(self):
        """The objective's section (`train.<objective>`) refuses the settings its objective cannot train with."""
        section = getattr(self, self.objective, None)
        problem = section.refuse(self) if isinstance(section, ObjectiveSection) else None
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _tensor_parallel_fits(self):
        """Tensor parallelism splits the language model's layers; sequence parallelism and LoRA are not combined with
        it (DeepSpeed: `config.plan.check_plan`; objectives that read whole logits refuse it themselves:
        `_objective_fits`)."""
        if self.tensor_parallel > 1:
            if self.sequence_parallel > 1:
                raise ValueError("train.tensor_parallel and train.sequence_parallel are not combined: set one of them to 1")
            if self.lora is not None:
                raise ValueError("train.tensor_parallel splits the language model's linear layers, which LoRA wraps in adapters: "
                                 "remove train.lora (full fine-tuning) or set train.tensor_parallel: 1")
        return self

    @model_validator(mode="after")
    def _validation_keys(self):
        """save_best and early stopping judge validations: they need eval_steps."""
        for key in ("save_best", "early_stopping_patience"):
            if getattr(self, key) is not None and self.eval_steps is None:
                raise ValueError(f"train.{key} needs validation: set train.eval_steps too (e.g. train.eval_steps={self.save_steps})")
        return self

    @model_validator(mode="after")
    def _older_checkpointing_key(self):
        """`gradient_checkpointing: true/false` keeps its meaning where `activation_checkpointing` was left auto."""
        if self.gradient_checkpointing is not None and self.activation_checkpointing == "auto":
            self.activation_checkpointing = "full" if self.gradient_checkpointing else "off"
        return self

    @field_validator("compile_vision", mode="before")
    @classmethod
    def _older_compile_vision_word(cls, value):
        """`on` (also YAML's bare on, read as true) meant the rotary and MLP kernels before blocks existed."""
        value = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
        return "kernels" if value == "on" else value

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, value: str | None) -> str | None:
        """The run name becomes a folder and a word of the SLURM script: safe characters only."""
        problem = None if value is None else name_problem(value)
        if problem:
            raise ValueError(problem)
        return value
