"""What a built model means for training: which parts a stage trains and a memory estimate per device.

Memory counts the bytes that stay resident for the whole run: weights, gradients and AdamW state (two moments), per
parameter, for the configured strategy, precision and master weights (`ParamBytes`, `param_bytes`):

- DDP / FSDP with fp32 master weights (compute in bf16 through autocast or FSDP's mixed-precision policy, or fp32):
  4 bytes of fp32 weights + 4 of fp32 gradients + 8 of fp32 AdamW moments = 16 per trained parameter; a frozen
  one is stored in the compute dtype (2 bytes in bf16, 4 in fp32). With `train.master_weights: bf16` (pure bf16): 2 + 2 + 4 = 8 per trained parameter, 2 per frozen one.
- DeepSpeed ZeRO-2/3 in bf16 or fp16: 2 bytes of half-precision weights + 2 of gradients + 12 of optimizer state
  (fp32 master copy and the two moments) = 16, as in the mixed-precision Adam accounting of the ZeRO paper
  (Rajbhandari et al. 2020, https://arxiv.org/abs/1910.02054, section 3.1); 2 per frozen parameter. In fp32:
  4 + 4 + 8, and 4 per frozen parameter.
- `train.optimizer_in_backward` frees each gradient as soon as its parameter is stepped: no resident gradients.
- QLoRA (`train.lora.quantize`) stores the frozen language model in 4 or 8 bits (0.5 or 1 byte per parameter).

DDP replicates everything, ZeRO-2 shards gradients and optimizer state, FSDP (FULL_SHARD) and ZeRO-3 shard all of
it across the processes. Activations, the transient gathered layers of FSDP and ZeRO-3, and communication buffers
are not included (they depend on batch tokens, checkpointing and bucket sizes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vlmctl.config.plan import DeviceFacts, build_plan, has_torchao
from vlmctl.config.train import TrainSection
from vlmctl.distributed.engine import strategy_of
from vlmctl.errors import ModelError
from vlmctl.families import PARTS, get_family

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

STAGE_TRAINS = {"align": ("projector",), "finetune": ("projector", "llm"), "full": ("vision", "projector", "llm")}
"""Parts each `train.stage` trains by default (LLaVA-1.5's two stages, plus full training); training itself reads
it through `trained_parts` (`vlmctl.train.setup.trainable_parts`)."""

BYTES_WEIGHT, BYTES_GRAD, BYTES_OPTIM = 2, 2, 12
QUANTIZED_BYTES = {"4bit": 0.5, "8bit": 1.0}
PART_LABELS = {"vision": "vision tower", "projector": "projector", "llm": "language model"}
"""What the parameter table calls each part (`vlmctl.families.PARTS`); see `part_labels` for audio models."""


def part_labels(family: str) -> dict[str, str]:
    """{part: label} of the parameter table for a family (a `vlmctl.families` name): the encoder in front of the
    projector (the `vision` part) is the "audio tower" of a family whose `modalities` take audio and no images
    (Qwen2-Audio), the "vision tower" otherwise, and of an unknown family."""
    try:
        modalities = get_family(family).modalities
    except ModelError:
        return dict(PART_LABELS)
    audio = "audio" in modalities and "image" not in modalities
    return {**PART_LABELS, "vision": "audio tower"} if audio else dict(PART_LABELS)


@dataclass(frozen=True)
class ParamBytes:
    """Resident bytes per parameter: `weight`, `grad` and `optim` (AdamW state) of a trained parameter, `frozen`
    (the stored weight) of a frozen one."""

    weight: float
    grad: float
    optim: float
    frozen: float

    @property
    def trained(self) -> float:
        return self.weight + self.grad + self.optim


ZERO_MIXED = ParamBytes(BYTES_WEIGHT, BYTES_GRAD, BYTES_OPTIM, BYTES_WEIGHT)
"""The ZeRO paper's mixed-precision Adam accounting (16 bytes per trained parameter, 2 per frozen one)."""


def trained_parts(stage: str, freeze: list[str] | None = None) -> dict[str, bool]:
    """{part: trained?} for `stage`; `freeze` (train.freeze) overrides the stage's default when given."""
    if freeze is not None:
        return {p: p not in freeze for p in PARTS}
    return {p: p in STAGE_TRAINS[stage] for p in PARTS}


def training_device(launcher: str) -> str:
    """Where a run of this project trains, "cuda" or "cpu": the nodes of a SLURM launch get GPUs (the sbatch script
    asks for them); other launchers run here, on the GPUs when torch sees one, else on CPU."""
    if launcher == "slurm":
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def param_bytes(strategy: str, precision: str, master_weights: str = "fp32", *,
                optimizer_in_backward: bool = False) -> ParamBytes:
    """Bytes per parameter for a strategy ("ddp", "fsdp", "zero2", "zero3"), a resolved compute precision ("bf16",
    "fp16", "fp32") and `train.master_weights` ("fp32", "bf16"); see the module docstring for the sources."""
    if strategy_of(strategy).deepspeed:
        out = ZERO_MIXED if precision in ("bf16", "fp16") else ParamBytes(4, 4, 8, 4)
    elif master_weights == "bf16":
        out = ParamBytes(2, 2, 4, 2)
    else:  # frozen weights are stored in the compute dtype (`vlmctl.train.setup.store_frozen`)
        out = ParamBytes(4, 4, 8, 2 if precision in ("bf16", "fp16") else 4)
    if optimizer_in_backward:
        out = ParamBytes(out.weight, 0, out.optim, out.frozen)
    return out


def memory_per_gpu(parameters: dict[str, int], trained: dict[str, bool], *, strategy: str, num_gpus: int,
                   bytes_per_param: ParamBytes = ZERO_MIXED, quantized_llm: str | None = None,
                   tensor_parallel: int = 1) -> dict[str, int]:
    """Bytes per device (GPU, or process on CPU) for weights, gradients and optimizer state, and their total.

    `bytes_per_param` from `param_bytes` (default: the ZeRO paper's mixed-precision accounting); `quantized_llm`
    ("4bit" / "8bit") stores a frozen language model quantized (QLoRA); `tensor_parallel` (`train.tensor_parallel`)
    splits the language model over that many ranks, which FSDP2 / ZeRO then shard over the data-parallel ranks
    (num_gpus / tensor_parallel) only: the vision tower and projector are replicated over the tp ranks. See the
    module docstring.
    """
    n = max(1, int(num_gpus))
    tp = max(1, int(tensor_parallel))
    b = bytes_per_param
    weights = grads = optim = 0.0
    for p in PARTS:
        per = b.weight if trained[p] else b.frozen
        if p == "llm" and quantized_llm in QUANTIZED_BYTES and not trained[p]:
            per = QUANTIZED_BYTES[quantized_llm]
        share = parameters[p] / (tp if p == "llm" else 1)
        weights += per * share
        if trained[p]:
            grads += b.grad * share
            optim += b.optim * share
    sharding = strategy_of(strategy)
    dp = max(1, n // tp)
    if sharding.zero_stage == 2:  # gradients and optimizer state partitioned, weights replicated
        grads, optim = grads / dp, optim / dp
    elif sharding.fsdp or sharding.zero_stage == 3:
        weights, grads, optim = weights / dp, grads / dp, optim / dp
    out = {"weights": int(weights), "gradients": int(grads), "optimizer": int(optim)}
    out["total"] = sum(out.values())
    return out


def precision_label(strategy: str, precision: str, master_weights: str) -> str:
    """How the estimate stores the run, in words: e.g. "bf16 compute, fp32 master weights + AdamW"."""
    if strategy_of(strategy).deepspeed and precision in ("bf16", "fp16"):
        return f"{precision} weights, fp32 master copy + AdamW"
    if precision == "fp32":
        return "fp32 + AdamW"
    if master_weights == "bf16":
        return "bf16 weights + AdamW (stochastic rounding by default)"
    return f"{precision} compute, fp32 master weights + AdamW"


def training_summary(info: dict[str, Any], *, stage: str, strategy: str, num_gpus: int, freeze: list[str] | None = None,
                     lora: bool = False, device: str = "cuda", precision: str = "auto", master_weights: str = "auto",
                     optimizer_in_backward: bool = False, quantize: str | None = None,
                     tensor_parallel: int = 1) -> dict[str, Any]:
    """Summary of a build (`vlmctl_model.json` content) under the configured training settings.

    `num_gpus`: the processes of the run (all nodes); `device`: "cuda" or "cpu", where they run; `precision`:
    `train.precision` ("auto" resolves for `device`, as does `master_weights`); `master_weights`, `optimizer_in_backward`, `quantize`: the
    `train` keys of the same names (`quantize`: `train.lora.quantize`; `tensor_parallel`: `train.tensor_parallel`, the
    ranks that split the language model). With `lora`, the language model's weights stay
    frozen and only adapters (not counted) are trained on it.

    Returns a dict with "parameters", "part_labels" (`part_labels`: what to call each part), "trained", "trainable_parameters", "device", "num_processes", "precision",
    "bytes_per_parameter" and "memory_per_gpu_bytes" (bytes per device: per GPU, or per process on CPU), among others.
    """
    # the run plan's strategy and master weights for these settings (`vlmctl.config.plan.build_plan`)
    adapters = {"r": 8, "quantize": quantize if quantize not in (None, "none") else "none"} if lora else None
    plan = build_plan(TrainSection(strategy=strategy, precision=precision, master_weights=master_weights, lora=adapters),
                      DeviceFacts(kind=device, processes=num_gpus, torchao=has_torchao()))
    strategy, master_weights = plan.strategy.value, plan.master_weights.value
    trained = trained_parts(stage, freeze)
    if lora:
        trained["llm"] = False
    params = info["parameters"]
    resolved = plan.precision.value  # the run plan's one precision rule
    quantized = quantize if lora and quantize not in (None, "none") else None
    per = param_bytes(strategy, resolved, master_weights, optimizer_in_backward=optimizer_in_backward)
    storage = precision_label(strategy, resolved, master_weights)
    if quantized:  # QLoRA stores every other weight in the compute dtype (`vlmctl.train.setup.setup_run`)
        size = 4 if resolved == "fp32" else 2
        per = ParamBytes(size, size if per.grad else 0, 2 * size, size)
        storage = f"{resolved} + AdamW, language model in {quantized}"
    return {
        "family": info["family"],
        "parameters": params,
        "part_labels": part_labels(info["family"]),
        "trained": trained,
        "lora_on_llm": lora,
        "trainable_parameters": sum(params[p] for p in PARTS if trained[p]),
        "visual_tokens_per_image": info.get("visual_tokens_per_image"),
        "image_size": info.get("image_size"),
        "stage": stage,
        "strategy": strategy,
        "device": device,
        "num_processes": num_gpus,
        "num_gpus": num_gpus if device == "cuda" else 0,
        "precision": resolved,
        "master_weights": master_weights,
        "storage": storage,
        "bytes_per_parameter": asdict(per),
        "tensor_parallel": tensor_parallel,
        "memory_per_gpu_bytes": memory_per_gpu(params, trained, strategy=strategy, num_gpus=num_gpus, bytes_per_param=per,
                                               quantized_llm=quantized, tensor_parallel=tensor_parallel),
    }
