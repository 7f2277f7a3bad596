"""The run plan: every `auto` of the `train` section resolved once, with the reason for each decision.

    facts = DeviceFacts.here(processes=2)                  # or DeviceFacts(kind="cuda", memory_bytes=80 * 2**30, ...)
    plan = build_plan(cfg.train, facts, family=family)     # a frozen RunPlan; nothing in `cfg` changes
    check_plan(plan, cfg.train)                            # ConfigError for what this device cannot train with
    train = plan.train_section(cfg.train)                  # a resolved copy for the code that reads `train.*`
    write_plan(run_dir, plan)                              # RUN_DIR/plan.json (temporary file, renamed)

The launcher builds the plan before any process starts (`vlmctl train`, `--dry-run`, `vlmctl bench` print it with
`render_plan`); a rank builds it again only where its device differs from what the launcher saw (SLURM: the nodes'
GPUs are not visible to the launcher, `plan_for_rank`). What only a rank can measure, the start-up probe's batch
size and activation checkpointing on a GPU (`vlmctl.train.autotune`), is a `probe` decision in the plan until
`settle_probe` records the rank's choice.

This is the one module that reads the word `auto` of the `train` section as a decision; the others read the plan
(a test greps the source tree for it).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vlmctl.errors import ConfigError

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# rich is imported inside the functions that print: using vlmctl as a library does not load it.

PLAN_FILE = "plan.json"
DEFAULT_TOKENS = 8192  # tokens_per_batch per rank without a probe (and the data checks' row budget without a config)
DEFAULT_MICRO_BATCH = 1
PROBE = "probe"  # the value of a decision the start-up probe settles on each rank (`settle_probe`)
RANK = "rank"  # the value of a decision each rank settles on the model it wraps (`settle_reshard`)
PROBED_KEYS = ("tokens_per_batch", "micro_batch_size", "activation_checkpointing")
DEEPSPEED = ("zero2", "zero3")
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearRecipeName values `train.fp8` names
FLOAT8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0)
AUTO_MAX_SHARD_RANKS = 8  # one NVLink domain (an HGX node): the measured case of keeping layers gathered
AUTO_GATHERED_SHARE = 0.25  # at most this share of a rank's memory for the gathered layers
AUTO_PREFETCH = 1  # layers prefetched by `train.fsdp_prefetch: auto`


# ----------------------------------------------------------------------------------------------- the device


@dataclass(frozen=True)
class DeviceFacts:
    """What the plan depends on about the machine: the device kind ("cuda" or "cpu"), whether it computes in bf16,
    its memory in bytes (one GPU's; None on CPU or where unknown), its CUDA compute capability (major, minor; None
    on CPU or where unknown: float8 matmuls need >= `FLOAT8_CAPABILITY`), the processes of the run in all (every
    node), the GPUs this process sees (`gpus`: what `train.nproc_per_node: auto` counts), and the optional packages
    that change a decision (torchao, Triton, flash-attn, liger-kernel, torch's varlen attention). Tests describe a
    GPU machine by hand: `DeviceFacts(kind="cuda", memory_bytes=80 * 2**30)`."""

    kind: str = "cpu"
    bf16: bool = True
    memory_bytes: int | None = None
    processes: int = 1
    torchao: bool = False
    triton: bool = False
    flash_attn: bool = False
    liger: bool = False
    varlen: bool = False
    capability: tuple[int, int] | None = None
    gpus: int = 0

    def __post_init__(self) -> None:
        if self.capability is not None:  # plan.json holds a list
            object.__setattr__(self, "capability", tuple(int(x) for x in self.capability))

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def float8(self) -> bool:
        """Whether the GPU has float8 tensor cores (compute capability >= `FLOAT8_CAPABILITY`)."""
        return self.cuda and self.capability is not None and self.capability >= FLOAT8_CAPABILITY

    @classmethod
    def here(cls, processes: int = 1, *, cuda: bool | None = None) -> "DeviceFacts":
        """This machine's facts for a run of `processes` processes. `cuda` forces the kind (SLURM: the launcher
        plans for the nodes' GPUs without seeing them; their bf16 support is assumed, their memory unknown)."""
        import torch  # noqa: PLC0415 - torch only where the machine is asked

        seen = torch.cuda.is_available()
        gpus = visible_gpus()
        kind = "cuda" if (seen if cuda is None else cuda) else "cpu"
        bf16, memory, capability = kind == "cuda", None, None
        if seen and kind == "cuda":
            try:
                # the current device: a rank's own GPU once the process group set it
                bf16 = torch.cuda.is_bf16_supported()
                memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
                capability = tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))
            except (AssertionError, RuntimeError):  # a CUDA runtime that cannot answer: the ranks find out
                pass
        has = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731
        return cls(kind=kind, bf16=bf16, memory_bytes=memory, processes=max(1, int(processes)),
                   torchao=has("torchao"), triton=has("triton"), flash_attn=has("flash_attn"),
                   liger=has("liger_kernel"), varlen=_has_varlen(), capability=capability, gpus=gpus)


    def same_decisions(self, other: "DeviceFacts") -> bool:
        """Whether a plan built for `other` decides as one built for these facts (memory aside: it only sizes the
        probe, which every rank runs on its own GPU)."""
        return replace(self, memory_bytes=None) == replace(other, memory_bytes=None)


def _has_varlen() -> bool:
    """torch has its varlen attention kernel (torch >= 2.10: the module `torch.nn.attention.varlen`, `varlen_attn`'s
    home since it came), found without importing it: the import registers its custom ops, which loads torch's
    compiler stack, over a second of CPU at every `vlmctl train` and `bench` start on a machine that never uses it."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def has_torchao() -> bool:
    """torchao's optimizers can be imported (without importing them)."""
    return importlib.util.find_spec("torchao") is not None


# ------------------------------------------------------------------------------------ the single decisions


def resolve_strategy(strategy: str, cuda: bool, quantized: bool = False, *, single_bf16: bool = False) -> str:
    """`train.strategy: auto` -> fsdp on GPUs (FSDP2 keeps fp32 master weights sharded and computes on bf16 copies
    gathered per layer, even on one GPU), ddp on CPU, for QLoRA (`quantized`: its 4-bit base is small enough to
    replicate) and for one process storing its weights in bf16 (`single_bf16`, see `single_bf16`: bf16 master
    weights or LoRA; nothing to shard and no cast to do, so FSDP2 would only add a gathered copy of the weights).
    Other values unchanged."""
    if strategy != "auto":
        return strategy
    return "fsdp" if cuda and not quantized and not single_bf16 else "ddp"


def single_bf16(train, cuda: bool, processes: int, torchao: bool | None = None) -> bool:
    """True when a run of `processes` processes in all is one process that stores its large weights in the
    compute dtype: bf16 master weights (`resolve_master_weights` with `train.strategy: auto` taken as fsdp or ddp,
    which resolve alike) or LoRA (a frozen base in the compute dtype, small adapters): the case where strategy auto
    is ddp. (On one H100, LoRA of the 3B preset trained 4% faster under ddp than FSDP2, docs/benchmarks.md.)"""
    if processes != 1:
        return False
    strategy = "fsdp" if train.strategy == "auto" else train.strategy
    return train.lora is not None or resolve_master_weights(
        train.master_weights, cuda=cuda, precision=train.precision, strategy=strategy, lora=False,
        torchao=torchao) == "bf16"


def resolve_master_weights(master_weights: str, *, cuda: bool, precision: str, strategy: str, lora: bool,
                           torchao: bool | None = None) -> str:
    """`train.master_weights: auto` -> "bf16" (with stochastic rounding, see `resolve_stochastic_rounding`) on a
    GPU (`cuda`) computing in bf16 (`precision` auto or bf16) with a torch strategy (`strategy` resolved: ddp or
    fsdp) that trains full weights (not `lora`) when torchao is installed (`torchao`, default: looked up here);
    "fp32" otherwise. Other values unchanged. A GPU without bf16 resolves `precision: auto` to fp32 compute; the
    plan then keeps fp32 (`build_plan`)."""
    if master_weights != "auto":
        return master_weights
    torchao = has_torchao() if torchao is None else torchao
    if cuda and precision in ("auto", "bf16") and strategy in ("ddp", "fsdp") and not lora and torchao:
        return "bf16"
    return "fp32"


def resolve_compile(value: str, *, cuda: bool, strategy: str, quantized: bool) -> str:
    """`train.compile: auto` -> "on" on a GPU (`cuda`) with a torch strategy (`strategy` resolved: ddp or fsdp)
    unless the base is quantized (QLoRA), else "off". Other values unchanged."""
    if value != "auto":
        return value
    return "on" if cuda and strategy in ("ddp", "fsdp") and not quantized else "off"


def resolve_compile_vision(value: str, *, cuda: bool, compile: str) -> str:
    """`train.compile_vision: auto` -> "blocks" where the decoder layers are compiled (`compile` resolved "on"),
    "kernels" on other CUDA runs (with Triton), "off" on CPU. Other values unchanged."""
    if value != "auto":
        return value
    if compile == "on":
        return "blocks"
    return "kernels" if cuda else "off"


def resolve_stochastic_rounding(value: str, master_weights: str, torchao: bool | None = None) -> str:
    """`train.stochastic_rounding: auto` -> "on" with bf16 master weights when torchao is installed, else "off"."""
    if value != "auto":
        return value
    torchao = has_torchao() if torchao is None else torchao
    return "on" if master_weights == "bf16" and torchao else "off"


def resolve_precision(precision: str, facts: DeviceFacts) -> str:
    """The compute dtype's name: `auto` = bf16 on GPUs that support it, fp32 on CPU. Other values unchanged."""
    if precision != "auto":
        return precision
    return "bf16" if facts.cuda and facts.bf16 else "fp32"


def row_tokens(train, tokens: int | None = None) -> int:
    """Tokens of one packed row: `train.tokens_per_batch` per rank (resolved: an integer; `tokens` instead where
    given) x the `train.sequence_parallel` ranks that split the row (`vlmctl.distributed.sequence`). The one place
    it is computed."""
    size = train.tokens_per_batch if tokens is None else tokens
    return int(size) * int(getattr(train, "sequence_parallel", 1))


def prepared_row_tokens(prepared_dir) -> int | None:
    """The packed row length `vlmctl data prepare` suggested for the data in `prepared_dir` (manifest.json's
    `tokens.suggested_packing_length`: a power of two holding the longest sample and about 8 median ones), or None
    without a readable manifest that has it."""
    try:
        tokens = json.loads((Path(prepared_dir) / "manifest.json").read_text()).get("tokens") or {}
        value = int(tokens.get("suggested_packing_length") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return value if value > 0 else None


def sized(train, key: str) -> int:
    """`train.tokens_per_batch` or `train.micro_batch_size` as an integer: the decided value, or where it is still
    left to the start-up probe (a workload planned before the probe ran) the value without a probe
    (`DEFAULT_TOKENS`, `DEFAULT_MICRO_BATCH`)."""
    value = getattr(train, key)
    return {"tokens_per_batch": DEFAULT_TOKENS, "micro_batch_size": DEFAULT_MICRO_BATCH}[key] if pending(value) else int(value)


def visible_gpus() -> int:
    """The CUDA devices this process sees (CUDA_VISIBLE_DEVICES honoured by torch); 0 without a usable CUDA runtime."""
    try:
        import torch  # noqa: PLC0415 - torch only where the machine is asked

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA runtime means no GPU
        return 0


def decide_nproc(train, gpus: int) -> Decision:
    """`train.nproc_per_node`: as set; auto = the `gpus` visible here, else one CPU process; one process in this
    process for `launcher: none`. SLURM with auto cannot be decided here (the nodes' GPUs are not visible): the value
    is None, and `check_plan` refuses it."""
    value = train.nproc_per_node
    if train.launcher == "none":
        return Decision(1, "one process, in this process (launcher none)", value == "auto")
    if value != "auto":
        return Decision(int(value), "set in the config")
    if train.launcher == "slurm":
        return Decision(None, "the GPUs of the allocated nodes are not visible here", True)
    if gpus:
        return Decision(int(gpus), f"the {gpus} visible GPU{'s' if gpus != 1 else ''}", True)
    return Decision(1, "no GPU visible: one CPU process", True)


def nproc_per_node(train) -> int:
    """Processes per node of a run of `train` on this machine (`decide_nproc` with the GPUs visible here; 1 where
    SLURM's nodes would decide)."""
    return decide_nproc(train, visible_gpus()).value or 1


def run_processes(train, gpus: int | None = None) -> int:
    """The processes of a run in all: 1 in-process (`launcher: none`), else nodes x processes per node
    (`decide_nproc`, with `gpus` visible GPUs, default those visible here)."""
    if train.launcher == "none":
        return 1
    return train.nnodes * (decide_nproc(train, visible_gpus() if gpus is None else gpus).value or 1)


def resolve_prefetch(setting: int | str) -> int:
    """`train.fsdp_prefetch` as a number of layers: auto = `AUTO_PREFETCH` (1), off = 0 (FSDP2's implicit
    prefetch), an integer N >= 1 as given. Raises ConfigError for anything else."""
    if setting == "auto":
        return AUTO_PREFETCH
    if setting == "off" or setting is False:
        return 0
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    raise ConfigError(f"train.fsdp_prefetch = {setting!r} is not auto, off or a positive number of layers",
                      hint="set train.fsdp_prefetch to auto, off or e.g. 2")


def resolve_reshard(setting: bool | str, *, shard_ranks: int, gathered_bytes: float, memory_bytes: float) -> tuple[bool, str]:
    """`train.fsdp_reshard_after_forward` as (reshard, reason). true and false as given; auto = true on a one-rank
    shard group (one GPU: FSDP2 still gathers into a second buffer, and keeping it saves no collective); false when
    the shard group has 2 to `AUTO_MAX_SHARD_RANKS` (8) ranks and the gathered layers (`gathered_bytes`, in the
    compute dtype) take at most `AUTO_GATHERED_SHARE` (a quarter) of a rank's `memory_bytes`, else true.

    Why: keeping the layers gathered saves one all-gather per layer and micro-batch; on one node of 4 H200s it
    raised per-GPU efficiency from 75.0% to 82.7% (docs/benchmarks.md). It costs the whole gathered model on every
    rank, a cost that does not shrink with more ranks while the sharded state does: a shard group wider than one
    8-GPU node is full sharding across nodes, chosen for its memory, so it keeps resharding (hybrid sharding keeps
    the shard group inside a node and gets false). A quarter of the memory leaves the rest to the sharded state and
    the activations, whose batch size the start-up probe then fits (`train.tokens_per_batch: auto`).
    Raises ConfigError for any other value."""
    if isinstance(setting, bool):
        return setting, "as set"
    if setting != "auto":
        raise ConfigError(f"train.fsdp_reshard_after_forward = {setting!r} is not auto, true or false",
                          hint="set train.fsdp_reshard_after_forward to auto, true or false")
    gib = 2**30
    if shard_ranks <= 1:
        # one rank saves no collective by keeping layers gathered, but FSDP2 still gathers into a second buffer:
        # keeping it costs a whole unsharded copy of the model (12.9 GiB for the 7B preset, docs/benchmarks.md)
        return True, "auto: 1 shard rank (no all-gather to save; a kept copy would double the weights)"
    if shard_ranks > AUTO_MAX_SHARD_RANKS:
        return True, f"auto: {shard_ranks} shard ranks > {AUTO_MAX_SHARD_RANKS}"
    if gathered_bytes > AUTO_GATHERED_SHARE * memory_bytes:
        return True, f"auto: gathered layers {gathered_bytes / gib:.1f} GiB > 1/4 of {memory_bytes / gib:.1f} GiB"
    return False, (f"auto: {shard_ranks} shard rank{'s' * (shard_ranks > 1)} <= {AUTO_MAX_SHARD_RANKS}, gathered layers "
                   f"{gathered_bytes / gib:.1f} GiB <= 1/4 of {memory_bytes / gib:.1f} GiB")


def quantized(train) -> bool:
    """QLoRA: the frozen base is loaded in 4 or 8 bits (`train.lora.quantize`)."""
    return train.lora is not None and train.lora.quantize != "none"


def balancing(balance: str, dp_size: int) -> bool:
    """Whether `train.balance` asks for compute-balanced batches with `dp_size` data-parallel ranks (auto: more
    than one)."""
    return balance == "on" or (balance == "auto" and dp_size > 1)


# --------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Decision:
    """One resolved setting: its `value`, why (`reason`), and whether the config left it to `auto` (`auto`)."""

    value: Any
    reason: str
    auto: bool = False


@dataclass(frozen=True)
class RunPlan:
    """Every decision a run takes from the `train` section and the device (`device`), each a `Decision`.

    `strategy` (ddp, fsdp, zero2, zero3), `precision` (the compute dtype: bf16, fp16, fp32), `master_weights` (the
    stored dtype of trained weights, fp32 or bf16), `stored` (the dtype the loaded model is stored in: the master
    weights, or the compute dtype for QLoRA), `stochastic_rounding`, `compile`, `compile_vision`, `attention` (the
    backend asked of `vlmctl.train.kernels`: varlen, flash_attn, sdpa, flex or eager), `liger` (its fused loss),
    `liger_kernels` (its norm/SwiGLU/RoPE patches with it), `packing`, `balance` (compute-balanced batches),
    `tokens_per_batch` (per rank), `micro_batch_size`, `activation_checkpointing` (`PROBE` where the start-up probe
    settles them on each rank), `fp8` (the float8 recipe of the language model's linears: tensorwise, rowwise or
    off; `PROBE` where the start-up probe's float8 trial settles it), `nproc_per_node` (processes per node; None
    where SLURM's nodes decide), `fsdp_reshard_after_forward` (`RANK` where each rank settles it on the model it
    wraps: `settle_reshard`), `fsdp_prefetch` (layers; 0 = FSDP2's implicit prefetch), `fsdp_reduce_dtype` (fp32
    or bf16: the gradients' reduction; `distributed.fsdp.plan_fsdp` applies the same rule), `sequence_parallel`,
    `tensor_parallel`, `dp_size` (data-parallel ranks: processes / (sequence_parallel x tensor_parallel)).
    `row_tokens` is the one packed row budget: tokens_per_batch x sequence_parallel. `probe`: the probe's record
    once a rank settled it. `data_tokens`: the packed row length `vlmctl data prepare` suggested for the run's data
    (manifest.json), which `tokens_per_batch: auto` follows where no probe measures it."""

    device: DeviceFacts
    strategy: Decision
    precision: Decision
    master_weights: Decision
    stored: Decision
    stochastic_rounding: Decision
    compile: Decision
    compile_vision: Decision
    attention: Decision
    liger: Decision
    liger_kernels: Decision
    packing: Decision
    balance: Decision
    tokens_per_batch: Decision
    micro_batch_size: Decision
    activation_checkpointing: Decision
    nproc_per_node: Decision
    fsdp_reshard_after_forward: Decision
    fsdp_prefetch: Decision
    fp8: Decision = Decision("off", "not planned (a plan written before train.fp8 existed)")
    fsdp_reduce_dtype: Decision = Decision("fp32", "not planned (a plan written before train.fsdp_reduce_dtype existed)")
    sequence_parallel: int = 1
    dp_size: int = 1
    family: str | None = None
    tensor_parallel: int = 1
    probe: dict | None = None
    data_tokens: int | None = None

    @property
    def row_tokens(self) -> int | None:
        """Tokens of one packed row: tokens_per_batch per rank x the sequence-parallel ranks that split it; None
        while the probe has not settled tokens_per_batch."""
        size = self.tokens_per_batch.value
        return None if size == PROBE else row_tokens(SimpleNamespace(tokens_per_batch=size,
                                                                      sequence_parallel=self.sequence_parallel))

    @property
    def probing(self) -> set[str]:
        """The keys the start-up probe settles on each rank (its float8 trial: `fp8`)."""
        return {k for k in (*PROBED_KEYS, "fp8") if getattr(self, k).value == PROBE}

    def decisions(self) -> dict[str, Decision]:
        """The decisions by `train` key, in plan order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Decision)}

    def train_section(self, train):
        """A copy of `train` (a TrainSection) holding the decided values where the config said auto (a `PROBE`
        key keeps `auto` until `settle_probe`), for code that reads settings from the section. `train` itself is
        not changed."""
        update = {"strategy": self.strategy.value, "precision": self.precision.value,
                  "master_weights": self.master_weights.value, "stochastic_rounding": self.stochastic_rounding.value,
                  "compile": self.compile.value, "compile_vision": self.compile_vision.value,
                  "attn_implementation": self.attention.value, "liger": "on" if self.liger.value else "off",
                  "packing": self.packing.value, "balance": "on" if self.balance.value else "off",
                  "fsdp_prefetch": self.fsdp_prefetch.value or "off"}
        if self.nproc_per_node.value is not None:
            update["nproc_per_node"] = self.nproc_per_node.value
        # fsdp_reshard_after_forward stays as configured: `distributed.fsdp.plan_fsdp` applies this module's rule
        # (`resolve_reshard`, the same answer and reason where the plan could decide) and `settle_reshard` records it
        for key in (*PROBED_KEYS, "fp8"):
            value = getattr(self, key).value
            if value != PROBE:
                update[key] = value
        return train.model_copy(update=update, deep=True)

    def to_json(self) -> dict:
        """The plan as plain JSON: {"device": {...}, "decisions": {key: {value, reason, auto}}, "row_tokens", ...}."""
        return {"device": asdict(self.device), "family": self.family, "sequence_parallel": self.sequence_parallel,
                "tensor_parallel": self.tensor_parallel, "dp_size": self.dp_size, "row_tokens": self.row_tokens,
                "data_tokens": self.data_tokens,
                "decisions": {k: asdict(d) for k, d in self.decisions().items()}, "probe": self.probe}

    @classmethod
    def from_json(cls, data: dict) -> "RunPlan":
        """The plan `to_json` wrote."""
        decisions = {k: Decision(**v) for k, v in data["decisions"].items()}
        return cls(device=DeviceFacts(**data["device"]), sequence_parallel=int(data.get("sequence_parallel", 1)),
                   tensor_parallel=int(data.get("tensor_parallel", 1)), dp_size=int(data.get("dp_size", 1)),
                   family=data.get("family"), probe=data.get("probe"), data_tokens=data.get("data_tokens"), **decisions)


def build_plan(train, device: DeviceFacts, family=None, data_tokens: int | None = None) -> RunPlan:
    """Resolve every `auto` of `train` (a TrainSection, left unchanged) for a run on `device` (`DeviceFacts`: its
    kind, bf16 support, processes in all, packages). `family` (a FamilySpec, when the model is known) decides
    packing (families that cannot take packed rows train on padded micro-batches) and whether liger has a patch.
    `data_tokens` (`prepared_row_tokens`: the packed row length `vlmctl data prepare` suggested) sizes
    `tokens_per_batch: auto` where no probe runs on CPU.
    Raises nothing for settings the device refuses (`check_plan` does): the plan of a QLoRA config can be built
    for a GPU on a machine without one."""
    cuda, processes = device.cuda, device.processes
    sp = int(getattr(train, "sequence_parallel", 1))
    tp = int(getattr(train, "tensor_parallel", 1))
    qlora = quantized(train)

    def pick(key: str, value, why_auto: str, why_set: str = "set in the config") -> Decision:
        configured = getattr(train, key)
        return Decision(value, why_auto if configured == "auto" else why_set, configured == "auto")

    where = f"{device.kind}, {processes} process{'es' if processes != 1 else ''}"
    single = single_bf16(train, cuda, processes, torchao=device.torchao)
    strategy = resolve_strategy(train.strategy, cuda, qlora, single_bf16=single)
    strategy_why = ("ddp on CPU" if not cuda else "ddp for QLoRA (its 4-bit base is replicated)" if qlora
                    else "ddp: one process storing bf16 weights (nothing to shard or cast)" if single
                    else "fsdp on GPUs (FSDP2, fp32 master weights sharded)")
    precision = resolve_precision(train.precision, device)
    master = resolve_master_weights(train.master_weights, cuda=cuda, precision=train.precision, strategy=strategy,
                                    lora=train.lora is not None, torchao=device.torchao)
    master_why = ("bf16 on a GPU computing in bf16 with ddp/fsdp and torchao, full weights trained" if master == "bf16"
                  else "fp32: " + ("CPU" if not cuda else "LoRA keeps adapters in fp32" if train.lora is not None
                                   else "DeepSpeed keeps its own fp32 copy" if strategy in DEEPSPEED
                                   else "torchao is not installed" if not device.torchao else "compute is not bf16"))
    if train.master_weights == "auto" and master == "bf16" and precision != "bf16":  # a GPU without bf16
        master, master_why = "fp32", f"fp32: compute in {precision}"
    rounding = resolve_stochastic_rounding(train.stochastic_rounding, master, torchao=device.torchao)
    compile_ = resolve_compile(train.compile, cuda=cuda, strategy=strategy, quantized=qlora)
    compile_why = ("on: ddp/fsdp on a GPU" if compile_ == "on" else
                   "off: " + ("CPU" if not cuda else "QLoRA's 4/8-bit layers are not compiled" if qlora
                              else f"{strategy} is not a torch strategy"))
    # compile auto is on wherever float8 can run (`fp8_blocker`): a recipe needs no other compile decision
    fp8, fp8_why = _fp8(train, device, strategy=strategy, precision=precision, compile_=compile_, sp=sp, tp=tp)
    # the compiled kernels need Triton on a GPU; the compiled blocks follow the decoder layers
    vision = resolve_compile_vision(train.compile_vision, cuda=cuda and device.triton, compile=compile_)
    packing = bool(train.packing) and (family is None or family.supports_packing)
    packing_why = ("set in the config" if packing or not train.packing
                   else f"{family.name} models cannot take packed rows: padded micro-batches")
    attention, attention_why = _attention(train, device, precision, packing)
    liger, liger_why = _liger(train, device, strategy, family)
    kernels_on = liger and compile_ != "on" and vision != "blocks"
    dp_size = max(1, processes // (sp * tp))  # the tp ranks of a group read the same batch
    balance = balancing(train.balance, dp_size)
    sizes = _batch_sizes(train, device, strategy, packing, sp, data_tokens)
    fsdp = _fsdp(train, strategy, processes, master, precision)
    stored = precision if qlora else ("bf16" if master == "bf16" else "fp32")
    return RunPlan(
        device=device, family=None if family is None else family.name, sequence_parallel=sp, tensor_parallel=tp,
        dp_size=dp_size, data_tokens=data_tokens,
        strategy=pick("strategy", strategy, f"{strategy_why} ({where})"),
        precision=pick("precision", precision, "bf16 on a GPU with bf16" if precision == "bf16" else
                       "fp32 on CPU" if not cuda else "fp32: this GPU has no bf16"),
        master_weights=pick("master_weights", master, master_why),
        stored=Decision(stored, "the compute dtype: QLoRA's other weights" if qlora else "the master weights"),
        stochastic_rounding=pick("stochastic_rounding", rounding, "on with bf16 master weights" if rounding == "on"
                                 else "off: fp32 master weights" if master != "bf16" else "off: torchao missing"),
        compile=pick("compile", compile_, compile_why),
        compile_vision=pick("compile_vision", vision, "blocks: the decoder layers are compiled" if vision == "blocks"
                            else "kernels: a GPU with Triton" if vision == "kernels"
                            else "off: " + ("CPU" if not cuda else "Triton is not installed")),
        attention=pick("attn_implementation", attention, attention_why),
        liger=pick("liger", liger, liger_why),
        liger_kernels=Decision(kernels_on, "liger's norm/SwiGLU/RoPE patches with its loss" if kernels_on
                               else "off: liger is off" if not liger else "off: torch.compile fuses those modules"),
        packing=Decision(packing, packing_why),
        balance=pick("balance", balance, f"{'on' if balance else 'off'}: {dp_size} data-parallel rank"
                     f"{'s' if dp_size != 1 else ''}"),
        fp8=Decision(fp8, fp8_why, train.fp8 == "auto"), nproc_per_node=decide_nproc(train, device.gpus), **sizes, **fsdp)


def _fp8(train, device: DeviceFacts, *, strategy: str, precision: str, compile_: str, sp: int,
         tp: int) -> tuple[str, str]:
    """`train.fp8` and why. A recipe set in the config stays (`check_plan` refuses one this run cannot train with:
    `fp8_blocker`). auto = `PROBE` where float8 can run and the start-up probe runs (ddp/fsdp on a GPU without
    sequence or tensor parallelism): its float8 trial converts the language model's linears that are large enough for
    tensorwise float8 and keeps them in float8 only where it measured the run's rows faster than bf16
    (`vlmctl.train.autotune.float8_trial`); else off, with the first reason it cannot."""
    if train.fp8 != "auto":
        return train.fp8, "set in the config"
    why = fp8_blocker(train, device, strategy=strategy, precision=precision, compile_=compile_)
    if why is None and sp > 1:
        why = "no start-up probe to measure it with sequence parallelism"
    if why is None and tp > 1:
        why = ("the start-up probe's float8 trial does not run with train.tensor_parallel; set train.fp8=tensorwise "
               "for float8 linears split over the tensor-parallel ranks")
    if why is not None:
        return "off", f"off: {why}"
    return PROBE, ("the start-up probe: tensorwise float8 where the language model's linears are large enough and "
                   "it measured faster than bf16 on this run's rows")


def fp8_blocker(train, device: DeviceFacts, *, strategy: str, precision: str, compile_: str) -> str | None:
    """Why float8 training of the language model's linears cannot run (None when it can): a GPU without float8
    tensor cores (compute capability < `FLOAT8_CAPABILITY`) or no GPU, no torchao, DeepSpeed (its engine owns the
    weights and their casts; float8 runs under ddp and fsdp, with or without tensor parallelism), LoRA/QLoRA (adapters
    train beside a frozen base), a frozen language model, compute other than bf16, or decoder layers not compiled
    (float8's scaling and casts run unfused, slower than bf16: torchao's and torchtitan's recipes compile).
    `strategy`, `precision`, `compile_`: resolved."""
    if not device.cuda:
        return "float8 matmuls need a CUDA GPU (this run is on CPU)"
    if not device.float8:
        have = ".".join(map(str, device.capability)) if device.capability else "unknown"
        return (f"float8 matmuls need a GPU of compute capability >= {'.'.join(map(str, FLOAT8_CAPABILITY))} "
                f"(H100, H200, L40S, B200; this GPU: {have})")
    if not device.torchao:
        return "torchao is not installed (pip install 'vlmctl[gpu]')"
    if strategy in DEEPSPEED:
        return f"DeepSpeed ({strategy}) owns the weights and their casts; float8 runs under ddp and fsdp"
    if train.lora is not None:
        return "LoRA/QLoRA trains adapters beside a frozen base; float8 speeds up training the full weights"
    if not llm_trained(train):
        return "the language model is frozen (train.stage / train.freeze)"
    if precision != "bf16":
        return f"compute is {precision}; float8 training computes around bf16"
    if compile_ != "on":
        return "train.compile is off: float8's scaling and casts would run unfused, slower than bf16"
    return None


def llm_trained(train) -> bool:
    """Whether the language model's weights are trained: `train.freeze` when given, else the stage (align trains
    the projector only; `vlmctl.models.summary.STAGE_TRAINS`)."""
    return "llm" not in train.freeze if train.freeze is not None else train.stage != "align"


def resolve_reduce_dtype(setting: str, master_weights: str) -> tuple[str, str]:
    """(`fp32` or `bf16`, why) for `train.fsdp_reduce_dtype` = `setting` under `train.master_weights` =
    `master_weights` (resolved: fp32 or bf16; anything else counts as fp32): auto reduces in bf16 exactly where the
    gradient shards are stored in bf16 (see the setting's description). Raises ConfigError for another value."""
    if setting in ("fp32", "bf16"):
        return setting, "set"
    if setting != "auto":
        raise ConfigError(f"train.fsdp_reduce_dtype={setting!r} is not a setting", hint="use auto, fp32 or bf16")
    if master_weights == "bf16":
        return "bf16", "auto: bf16 master weights store bf16 gradient shards"
    return "fp32", "auto: fp32 master weights keep the fp32 sum"


def _fsdp(train, strategy: str, processes: int, master: str = "fp32", precision: str = "bf16") -> dict[str, Decision]:
    """FSDP2's `fsdp_prefetch` (layers), `fsdp_reduce_dtype` (`resolve_reduce_dtype` with the resolved `master`
    weights; fp32 whatever the setting where the compute `precision` is fp32, as `distributed.fsdp.plan_fsdp` decides:
    without mixed precision FSDP2 reduces the gradients in their own dtype) and `fsdp_reshard_after_forward`
    (`resolve_reshard`): decided here where the shard group alone decides it (one rank, more than one node's), else
    left to each rank (`RANK`), which weighs the gathered layers against its memory on the model it wraps
    (`settle_reshard`). Not used by other strategies."""
    prefetch_set, reshard_set = train.fsdp_prefetch, train.fsdp_reshard_after_forward
    layers = resolve_prefetch(prefetch_set)
    reduce_set = getattr(train, "fsdp_reduce_dtype", "fp32")
    if strategy != "fsdp":
        unused = f"not used: {strategy}"
        return {"fsdp_prefetch": Decision(layers, unused, prefetch_set == "auto"),
                "fsdp_reshard_after_forward": Decision(reshard_set if isinstance(reshard_set, bool) else True, unused,
                                                       reshard_set == "auto"),
                "fsdp_reduce_dtype": Decision(reduce_set if reduce_set != "auto" else "fp32", unused, reduce_set == "auto")}
    reduce, reduce_why = resolve_reduce_dtype(reduce_set, master)
    reduce_why = reduce_why.removeprefix("auto: ") if reduce_set == "auto" else "set in the config"
    if precision == "fp32":  # no mixed precision: FSDP2 casts nothing (`plan_fsdp`)
        reduce, reduce_why = "fp32", "fp32 compute: gradients reduce in their own dtype"
    reduce_decision = Decision(reduce, reduce_why, reduce_set == "auto")
    prefetch = Decision(layers, "one layer ahead: FSDP2's implicit prefetch, each all-gather issued earlier"
                        if prefetch_set == "auto" else "set in the config", prefetch_set == "auto")
    if isinstance(reshard_set, bool):
        return {"fsdp_prefetch": prefetch, "fsdp_reduce_dtype": reduce_decision,
                "fsdp_reshard_after_forward": Decision(reshard_set, "set in the config")}
    shard = processes // train.nnodes if train.fsdp_sharding == "hybrid" else processes
    if shard <= 1 or shard > AUTO_MAX_SHARD_RANKS:
        value, why = resolve_reshard(reshard_set, shard_ranks=shard, gathered_bytes=0, memory_bytes=0)
        return {"fsdp_prefetch": prefetch, "fsdp_reduce_dtype": reduce_decision,
                "fsdp_reshard_after_forward": Decision(value, why.removeprefix("auto: "), True)}
    return {"fsdp_prefetch": prefetch, "fsdp_reduce_dtype": reduce_decision, "fsdp_reshard_after_forward": Decision(
        RANK, f"each rank: false when the gathered layers take at most 1/4 of its memory ({shard} shard ranks)", True)}


def settle_reshard(plan: "RunPlan | None", reshard: bool, reason: str) -> "RunPlan | None":
    """The plan with the reshard-after-forward a rank decided on its model (`resolve_reshard` in
    `distributed.fsdp.plan_fsdp`) where the plan left it to the rank; the plan unchanged otherwise. Raises
    ConfigError where the rank's rule answered otherwise than the plan (the two would not be one decision)."""
    if plan is None:
        return plan
    if plan.fsdp_reshard_after_forward.value != RANK:
        if reshard != plan.fsdp_reshard_after_forward.value and plan.strategy.value == "fsdp":
            raise ConfigError(f"FSDP2's reshard after forward: the plan decided {plan.fsdp_reshard_after_forward.value}, "
                              f"the wrapped model got {reshard} ({reason})", hint="report this as a bug")
        return plan
    return replace(plan, fsdp_reshard_after_forward=Decision(reshard, reason.removeprefix("auto: "), True))


def _attention(train, device: DeviceFacts, precision: str, packing: bool) -> tuple[str, str]:
    """The attention backend asked for `train.attn_implementation` (varlen, flash_attn, sdpa, flex, eager) and why.
    Packed rows: auto = PyTorch's varlen kernel on CUDA in bf16/fp16, sdpa on CPU or in fp32 (block-diagonal mask
    from the per-sample position ids). Padded batches: auto = flash_attn where flash-attn is installed on CUDA, else
    sdpa. `check_plan` refuses a configured backend that cannot run."""
    requested = train.attn_implementation
    if requested != "auto":
        return requested, "set in the config"
    if device.cuda and precision == "fp32":
        return "sdpa", "sdpa: the flash kernels compute in bf16/fp16 only"
    if not packing:
        if device.cuda and device.flash_attn:
            return "flash_attn", "flash_attn: padded batches on CUDA with flash-attn installed"
        return "sdpa", "sdpa: padded batches"
    if device.cuda and device.varlen:
        return "varlen", "varlen: packed rows on CUDA"
    return "sdpa", "sdpa: packed rows " + ("on CPU" if not device.cuda else "without torch's varlen kernel")


def _liger(train, device: DeviceFacts, strategy: str, family) -> tuple[bool, str]:
    """Whether liger-kernel's fused linear cross-entropy is used, and why: it needs CUDA, the package and a liger
    patch for the family, and the head's weight gathered during the root forward (ZeRO-3 partitions it outside the
    head's own forward, so zero3 uses the plain loss; tensor parallelism splits it over the vocabulary and computes
    the vocabulary-parallel loss instead)."""
    if train.liger == "off":
        return False, "set in the config"
    why = _liger_blocker(device, strategy, family, tensor_parallel=int(getattr(train, "tensor_parallel", 1)))
    if why is None:
        return True, "set in the config" if train.liger == "on" else "on: CUDA, liger-kernel installed"
    return False, f"off: liger-kernel {why}"


def _liger_blocker(device: DeviceFacts, strategy: str, family, tensor_parallel: int = 1) -> str | None:
    if not (device.cuda and device.liger):
        return "needs a CUDA GPU and the liger-kernel package (pip install 'vlmctl[gpu]')"
    if family is not None and family.liger_patch is None:
        return f"has no patch for the {family.name} family"
    if strategy == "zero3":
        return "cannot read the head's weight while ZeRO-3 partitions it"
    if tensor_parallel > 1:
        return "reads the head's whole weight; tensor parallelism splits it over the vocabulary (its own loss)"
    return None


def _batch_sizes(train, device: DeviceFacts, strategy: str, packing: bool, sp: int,
                 data_tokens: int | None = None) -> dict[str, Decision]:
    """tokens_per_batch, micro_batch_size and activation_checkpointing. On a GPU with ddp/fsdp and no sequence
    parallelism the start-up probe settles the batching in use and checkpointing (`PROBE`); elsewhere auto means
    `DEFAULT_TOKENS` tokens per row (per rank), `DEFAULT_MICRO_BATCH` samples, and checkpointing off on CPU, full
    on a GPU (where nothing was measured, the mode that fits most). On CPU a row follows the data: `data_tokens`
    (what `vlmctl data prepare` suggested) when it is below `DEFAULT_TOKENS`; a CPU step's time grows with the
    row's length squared under sdpa's block-diagonal mask (8,192 tokens: 37 s per DPO step, 1,024: 1.5 s)."""
    can_probe = device.cuda and strategy in ("ddp", "fsdp") and sp == 1
    why = ("no probe on CPU" if not device.cuda else "no probe with sequence parallelism" if sp > 1
           else f"no probe with {strategy}")
    probed = {"tokens_per_batch" if packing else "micro_batch_size", "activation_checkpointing"} if can_probe else set()
    fixed = {"tokens_per_batch": DEFAULT_TOKENS, "micro_batch_size": DEFAULT_MICRO_BATCH,
             "activation_checkpointing": "full" if device.cuda else "off"}
    reasons = {}
    if not device.cuda and data_tokens and 0 < data_tokens < DEFAULT_TOKENS:
        fixed["tokens_per_batch"] = int(data_tokens)
        reasons["tokens_per_batch"] = (f"no probe on CPU: the packed row length `vlmctl data prepare` suggested for "
                                       f"this data (below {DEFAULT_TOKENS})")
    out = {}
    for key in PROBED_KEYS:
        configured = getattr(train, key)
        if configured != "auto":
            out[key] = Decision(configured, "set in the config")
        elif key in probed:
            out[key] = Decision(PROBE, "the start-up probe: fastest that fits in GPU memory", True)
        else:
            unused = can_probe and key != "activation_checkpointing"  # the batching not in use
            out[key] = Decision(fixed[key], f"not used: {'padded micro-batches' if packing else 'packed rows'}"
                                if unused else reasons.get(key, why), True)
    return out


def check_plan(plan: RunPlan, train) -> None:
    """Raise ConfigError for a plan this device cannot train with: tensor parallelism under DeepSpeed, fp16 without
    DeepSpeed's loss scaling, QLoRA off
    CUDA, bf16 master weights without bf16 compute or under DeepSpeed, stochastic rounding without torchao, an
    attention backend the device or batching cannot run, liger `on` where it cannot run, a float8 recipe
    (`train.fp8`) where float8 training cannot run (`fp8_blocker`)."""
    strategy, precision, master = plan.strategy.value, plan.precision.value, plan.master_weights.value
    if plan.tensor_parallel > 1 and strategy in DEEPSPEED:
        raise ConfigError(f"train.tensor_parallel needs train.strategy fsdp (or ddp on one tensor-parallel group), not {strategy}",
                          hint="set train.strategy=fsdp, or train.tensor_parallel=1")
    if precision == "fp16" and strategy in ("ddp", "fsdp"):
        raise ConfigError("train.precision=fp16 needs loss scaling, which only the DeepSpeed strategies provide here",
                          hint="use train.precision=bf16, or train.strategy=zero2/zero3")
    if quantized(train) and not plan.device.cuda:
        raise ConfigError("train.lora.quantize (QLoRA) needs bitsandbytes on a CUDA GPU",
                          hint="set train.lora.quantize=none, or run on a GPU machine with bitsandbytes installed")
    if master == "bf16" and not quantized(train):
        if precision != "bf16":
            raise ConfigError(f"train.master_weights=bf16 needs bf16 compute, but train.precision resolves to {precision}",
                              hint="set train.precision=bf16 (on a GPU with bf16), or train.master_weights=fp32")
        if strategy in DEEPSPEED:
            raise ConfigError("train.master_weights=bf16: DeepSpeed keeps its own fp32 master weights for zero2/zero3",
                              hint="use train.strategy=fsdp or ddp for pure bf16, or train.master_weights=fp32")
    if plan.stochastic_rounding.value == "on" and master == "bf16" and not plan.device.torchao:
        raise ConfigError("train.stochastic_rounding=on needs torchao, which is not installed here",
                          hint='pip install "vlmctl[gpu]" (or torchao), or set train.stochastic_rounding=off')
    attention = plan.attention.value
    if plan.device.cuda and precision == "fp32" and attention in ("varlen", "flash_attn"):
        raise ConfigError(f"train.attn_implementation={attention} computes in bf16/fp16, but train.precision resolves to fp32",
                          hint="set train.precision=bf16, or train.attn_implementation=sdpa")
    if not plan.packing.value and attention == "varlen":
        raise ConfigError("train.attn_implementation=varlen attends within packed rows; it needs train.packing=true",
                          hint="set train.packing=true, or use sdpa / flash_attn with padded batches")
    if attention == "varlen" and not (plan.device.cuda and plan.device.varlen):
        raise ConfigError("train.attn_implementation=varlen needs CUDA and torch >= 2.10; use sdpa or flex on CPU",
                          hint="set train.attn_implementation=auto (or sdpa)")
    if attention == "flash_attn" and not plan.device.flash_attn:
        raise ConfigError("train.attn_implementation=flash_attn needs the flash-attn package (pip install 'vlmctl[flash]'); varlen needs no extra package",
                          hint="set train.attn_implementation=auto (or sdpa)")
    if plan.nproc_per_node.value is None:
        raise ConfigError("train.launcher=slurm needs train.nproc_per_node: the GPUs of the allocated nodes are not visible here",
                          hint="pass --nproc-per-node <GPUs per node>")
    if train.liger == "on" and not plan.liger.value:
        raise ConfigError(f"train.liger=on, but {plan.liger.reason.removeprefix('off: ')}",
                          hint="set train.liger=auto or off")
    if plan.fp8.value in FLOAT8_RECIPES:
        why = fp8_blocker(train, plan.device, strategy=strategy, precision=precision, compile_=plan.compile.value)
        if why is not None:
            raise ConfigError(f"train.fp8={plan.fp8.value} cannot run: {why}",
                              hint="set train.fp8=auto (float8 where it runs and pays) or off")


# ------------------------------------------------------------------------------------------------ per rank


def pending(value) -> bool:
    """Whether a setting still holds the config's `auto`, not yet decided: a probed key of a run's resolved
    `train` copy (`RunPlan.train_section`) until the start-up probe settles it (`settle_probe`), or a key only a
    rank can decide (`nproc_per_node` of a SLURM job)."""
    return value == "auto"


def plan_for_rank(plan: RunPlan | None, train, device: DeviceFacts, family=None) -> RunPlan:
    """The plan a rank trains with: the launcher's `plan` (from plan.json) where it was built for facts that decide
    alike (`DeviceFacts.same_decisions`), else one built for this rank's `device` (SLURM, an in-process run without
    plan.json), with this rank's GPU memory recorded either way."""
    data_tokens = None if plan is None else plan.data_tokens
    if plan is not None and plan.device.same_decisions(device) and (family is None or plan.family in (None, family.name)):
        if family is not None and plan.family is None:
            return build_plan(train, device, family, data_tokens)
        return replace(plan, device=replace(plan.device, memory_bytes=device.memory_bytes))
    return build_plan(train, device, family, data_tokens)


def settle_probe(plan: RunPlan | None, train, choice) -> tuple[RunPlan | None, list[str]]:
    """Record the start-up probe's `choice` (an `autotune.Choice`: tokens_per_batch, micro_batch_size,
    activation_checkpointing, reason; fp8 and fp8_reason from its float8 trial) for the keys the plan left to it or
    left to the fixed defaults, and write those values into `train` (the run's resolved copy,
    `RunPlan.train_section`, never the project config).
    Returns (the plan with the choice, "key=value" for each key set)."""
    done, update = [], {}
    reasons = {"fp8": getattr(choice, "fp8_reason", "")}  # the float8 trial's own reason
    for key in (*PROBED_KEYS, "fp8"):
        value = getattr(choice, key, None)
        if value is not None and pending(getattr(train, key, None)):
            setattr(train, key, value)
            update[key] = Decision(value, reasons.get(key) or choice.reason or "the start-up probe", True)
            done.append(f"{key}={value}")
    if plan is None:  # a caller without a plan (a script's own probe): `train` alone
        return None, done
    record = {"reason": choice.reason, "budget_bytes": getattr(choice, "budget_bytes", None),
              "state_bytes": getattr(choice, "state_bytes", None), "applied": done}
    return replace(plan, probe=record, **update), done


# ----------------------------------------------------------------------------------------------- the record


def write_plan(run_dir: Path, plan: RunPlan) -> Path:
    """Write `plan` as `RUN_DIR/plan.json` (a temporary file, renamed: a reader never sees half of it)."""
    path = Path(run_dir) / PLAN_FILE
    tmp = path.with_name(f".{PLAN_FILE}.tmp")
    tmp.write_text(json.dumps(plan.to_json(), indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_plan(run_dir: Path) -> RunPlan | None:
    """The plan of a run folder, or None without plan.json. Raises ConfigError for one that is not a plan."""
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        return None
    try:
        return RunPlan.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a run plan: {exc}", hint="delete it; the launcher writes it again") from None


def plan_rows(plan: RunPlan) -> list[tuple[str, str, str]]:
    """(setting, value, reason) per decision, as `render_plan` shows them; values in words (True -> on)."""
    shown = lambda v: ("on" if v else "off") if isinstance(v, bool) else str(v)  # noqa: E731
    rows = [(key, shown(d.value), ("auto: " if d.auto else "") + d.reason) for key, d in plan.decisions().items()]
    rows.append(("row_tokens", "probe" if plan.row_tokens is None else str(plan.row_tokens),
                 f"tokens_per_batch x sequence_parallel ({plan.sequence_parallel})"))
    return rows


def render_plan(plan: RunPlan, title: str = "run plan"):
    """The plan as a rich Table (setting, value, reason), the one view `vlmctl train --dry-run`, `vlmctl bench` and
    a run's start-up print."""
    from rich.table import Table  # noqa: PLC0415 - rich only where a plan is shown
    from rich.text import Text  # noqa: PLC0415

    facts = plan.device
    memory = f", {facts.memory_bytes / 2**30:.0f} GiB" if facts.memory_bytes else ""
    table = Table(title=f"{title} ({facts.kind}{memory}, {facts.processes} process{'es' if facts.processes != 1 else ''})",
                  title_justify="left", show_edge=False)
    for name in ("setting", "value", "reason"):
        table.add_column(name)
    for row in plan_rows(plan):
        table.add_row(*(Text(cell) for cell in row))  # reasons hold brackets (pip extras), not markup
    return table


def plan_text(plan: RunPlan, title: str = "run plan") -> str:
    """`render_plan` as plain text (no colour), as the commands print it."""
    from rich.console import Console  # noqa: PLC0415 - rich only where a plan is shown

    # 100 columns: the reasons wrap within a terminal or a log viewer's width instead of running past it
    console = Console(width=100, color_system=None, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render_plan(plan, title))
    return console.export_text()
