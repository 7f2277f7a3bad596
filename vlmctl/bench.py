"""Training-throughput benchmark: tokens/s, MFU (vision tower included), step time, peak memory; for GRPO also
rollouts/s and the generation share of the step.

The measured step is the trainer's own (`vlmctl.train.loop.Trainer.train_step`) on the model, kernels, stage, LoRA /
QLoRA adapters, strategy (none/ddp/fsdp/zero2/zero3) and optimizer that `vlmctl train` would use for the same config;
only the data is synthetic. Multi-GPU runs start one process per GPU through torchrun (`python -m vlmctl.bench
WORKDIR`); every rank builds its own micro-batches and the figures are summed over ranks. Everything that can be
checked without weights (flags, the model, the device, precision, kernels, the workload) is checked by `prepare`
before any process starts: a usage error is one panel and exit code 2.

The model (`choose_model`), as `vlmctl train` gets it: the folder `vlmctl model build` wrote (`model.output_dir`)
when it was built from the `model` section as it stands; else, with `model.init: random`, the section's model (a
preset or a compose spec) built in memory as `model build` builds it, its tokenizer trained on synthetic text where
it has none; else `model.base`. QLoRA (`train.lora.quantize`, CUDA + bitsandbytes) loads the frozen base through
`vlmctl.train.setup.load_quantized`, which reads a folder: a random-init model is saved to a temporary one first.

Workloads (`WorkloadSpec.kind`, `--workload`):

- chat: every sample is a user turn holding `--images-per-sample` square RGB noise images (each side drawn from
  `--image-sizes`; one image by default) and an assistant turn of `--text-tokens` random tokens (single-token words
  of the model's tokenizer), every answer token labelled. With `--video-frames MIN,MAX` the user turn holds one
  video instead: an even number of square random RGB frames in that range (frames come in temporal patches of 2),
  a side from `--video-sizes`, encoded at `VIDEO_FPS` as `data prepare` stores clips
  (`vlmctl.data.modalities.video.encode_clip`), so that the frames are decoded and go through the family's video
  processor as training data does (families that take video: `FamilySpec.modalities`, Qwen2-VL, Qwen2.5-VL and
  Qwen3-VL).
  The samples go through the trainer's own data path: the model's processor and chat template
  (`vlmctl.data.collate.encode_sample`) and its collator, packed rows of `train.tokens_per_batch` tokens
  (`PackedCollator`, with `train.packing`) or padded micro-batches of `train.micro_batch_size` samples (`Collator`).
  Families that cannot take packed rows (`FamilySpec.supports_packing`) get padded batches, as in training.
- baseline: the plain-transformers baseline's Qwen-VL samples (one square image of 224/336/448/560 px by default,
  i.e. 64..400 merged visual tokens between vision start/end tokens, then 64..1536 uniformly random text tokens, no
  chat template, every text token labelled), packed by the trainer's collator: the workload of the Qwen-VL figures
  in docs/benchmarks.md, so vlmctl and that baseline can be measured on the same GPU. The chat workload cannot
  reproduce its token counts (the chat template adds its own tokens, and only the answer is labelled).
  `--images-per-sample` puts that many images, each between its own vision start/end tokens, before the text.
  It has no video samples.
- auto (the default): baseline for Qwen-VL families (mRoPE) with packed rows and image sides that are multiples of
  patch x merge (28 px), chat otherwise (and for video).

Micro-batches: every rank draws the same samples. Packed rows are planned by first-fit decreasing and taken fullest
first (the partial rows at the tail of a finite sample set would understate throughput), every dp_size-th to each
rank; padded micro-batches are the trainer's `DistributedBatchSampler`'s (length grouping as
`train.group_by_length`). All are collated before the timed steps (training collates in DataLoader workers, in the
background of the steps); pixel values stay as the processor returns them (float32), as in training.

Objectives (`train.objective`): sft trains the samples; dpo trains preference pairs of the chat workload (each
sample with a rejected answer as long as its chosen one, both packed into one row by `PairCollator`); grpo trains on
rollouts of the chat workload's samples taken as prompts: the messages before the answer (the images or clip, no
text) are the prompt and the answer of `--text-tokens` random tokens is the reference the rewards score against.
The objective is the worker's (`train.worker.build_objective`: the rewards of `train.grpo.rewards`, user functions
included, the family's packed-row hook; with `train.grpo.beta` > 0 a frozen copy of the model as the reference), and
each step is the trainer's: micro-batches of `train.micro_batch_size` prompts (training's `DistributedBatchSampler`)
go through the objective's `prepare_window` (generation of `train.grpo.group_size` answers per prompt of at most
`train.grpo.max_new_tokens` tokens, rewards, advantages, one packed row of rollouts per micro-batch), then forward,
backward and the optimizer step. Random answers earn equal rewards in every group (0 on a random-weight model), so
the advantages are 0; the step trains on every rollout all the same (its loss 0, its cost a real step's), and
`train.grpo.drop_zero_variance_groups` is switched off in the bench, since it would leave no rollout to train on.
A grpo result adds (`BenchResult`): `rollouts_per_step`, `rollouts_per_s` (completions per second of generation,
all ranks; `rollouts_per_s_per_gpu`), `generated_tokens_per_s` (completion tokens per second of generation),
`rollout_s` (seconds of the step's generation, rewards and packing: the objective's `time/rollout_s`, the mean over
ranks), `train_s` (the rest of the step: step_time_s - rollout_s), `generation_share` (rollout_s / step_time_s) and
`train_tokens_per_s` (the rollout rows' tokens per second of train_s). Its `tokens_per_s` and `samples_per_s` count
the rollout rows' tokens and the rollouts per second of the whole step, and its MFU the training FLOPs only (as the
step line of a grpo run); generation's FLOPs are not counted.

Scaling (`scaling`, `--scaling 1,2,4`): the same bench at each process count of this node, one after the other,
every count checked before the first process starts; each process runs the same workload whatever the count (weak
scaling), so the tokens/s per GPU of a count over those of the fewest processes is its efficiency.

FLOPs: each micro-batch's training FLOPs come from `vlmctl.train.flops.CostModel.batch_flops` (built by
`vlmctl.train.setup.prepare_model` with `lora=` set for adapters: a frozen base counts its forward and activation
gradient, not its weight gradient; images and video clips through the vision tower from their patch grids,
`image_grid_thw` / `video_grid_thw`), summed by the trainer's own step over the data-parallel ranks, exactly as
`vlmctl train` sums them for its MFU column; so bench and train report the same MFU for the same batch.
MFU = FLOPs / step time / (peak x GPUs) (PaLM, Chowdhery et al. 2022, appendix B), with the device's data-sheet peak
(`vlmctl.train.metrics.peak_flops`), else 989 TFLOP/s (H100/H200 SXM dense bf16).
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from vlmctl.config.plan import (FLOAT8_RECIPES, DeviceFacts, build_plan, check_plan, pending, row_tokens, sized,
                                visible_gpus)
from vlmctl.train import autotune

# numpy and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not
# pay for them.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

DEFAULT_PEAK = 989e12  # H100/H200 SXM dense bf16: the reference for devices without a data-sheet figure (CPUs)
WORKLOADS = ("auto", "chat", "baseline")
VIDEO_FPS = 2.0  # frames per second of the synthetic clips: Qwen-VL's sampling rate, 1 s per temporal patch of 2
RARE_FIT = 0.01  # when fewer than this fraction of the drawn chat samples fit a packed row, stop drawing (usage error)


def token_budget(train) -> int:
    """Tokens of one packed row per device (`train.tokens_per_batch`), as an integer: the one place bench reads the
    budget (`config.plan.sized`: training's value without a probe until a probe settled it)."""
    return sized(train, "tokens_per_batch")


def row_budget(train) -> int:
    """Tokens of one packed row: `token_budget` per device x `train.sequence_parallel` (`config.plan.row_tokens`)."""
    return row_tokens(train, token_budget(train))


def micro_batch(train) -> int:
    """Samples of one padded micro-batch per device (`train.micro_batch_size`), as an integer (`config.plan.sized`)."""
    return sized(train, "micro_batch_size")


@dataclass
class WorkloadSpec:
    """The synthetic workload: image sides in px (one drawn per image), the [min, max] range of images per sample,
    the [min, max] range of text tokens per sample (answer tokens in the chat workload), the workload kind
    (`WORKLOADS`, see the module docstring), the [min, max] range of video frames per sample (None: image samples)
    and the video frame sides in px (one drawn per clip), and the Qwen-VL patch geometry the baseline workload
    builds its visual tokens with."""

    image_sizes: tuple[int, ...] = (224, 336, 448, 560)
    text_tokens: tuple[int, int] = (64, 1536)
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    kind: str = "auto"
    images_per_sample: tuple[int, int] = (1, 1)
    video_frames: tuple[int, int] | None = None  # None: no video, image samples
    video_sizes: tuple[int, ...] = (224, 336, 448)

    @classmethod
    def from_flags(cls, image_sizes: str, text_tokens: str, workload: str = "auto", *, images_per_sample: str = "1,1",
                   video_frames: str | None = None, video_sizes: str = "224,336,448") -> "WorkloadSpec":
        """The spec of the CLI flags `--image-sizes 224,336` (px), `--text-tokens MIN,MAX`, `--workload`,
        `--images-per-sample MIN,MAX`, `--video-frames MIN,MAX` (None: off) and `--video-sizes 224,448` (px).
        Raises UsageError naming the flag that does not parse or is out of range."""
        from vlmctl.errors import UsageError

        def ints(text: str, flag: str, example: str) -> tuple[int, ...]:
            try:
                return tuple(int(x) for x in text.split(",") if x.strip())
            except ValueError:
                raise UsageError(f"{flag} {text!r} is not a comma-separated list of integers", hint=f"e.g. {flag} {example}") from None

        spec = cls(image_sizes=ints(image_sizes, "--image-sizes", "224,336,448,560"), kind=workload,
                   text_tokens=ints(text_tokens, "--text-tokens", "64,1536"),
                   images_per_sample=ints(images_per_sample, "--images-per-sample", "2,4"),
                   video_frames=None if video_frames is None else ints(video_frames, "--video-frames", "16,64"),
                   video_sizes=ints(video_sizes, "--video-sizes", "224,336,448"))
        spec.check()
        return spec

    def check(self) -> None:
        """Raise UsageError for image sides, images per sample, text lengths, video frames or frame sides that make
        no sample, an unknown workload kind, or video samples with several images or the baseline workload."""
        from vlmctl.data.modalities.video import FRAME_MULTIPLE
        from vlmctl.errors import UsageError

        def sides(values: tuple[int, ...], flag: str, example: str) -> None:
            if not values or any(s < 1 for s in values):
                raise UsageError(f"{flag} {','.join(map(str, values)) or '(none)'}: give one or more positive sides in px",
                                 hint=f"e.g. {flag} {example}")

        def span(values: tuple[int, ...], flag: str, example: str) -> None:
            if len(values) != 2 or not 1 <= values[0] <= values[1]:
                raise UsageError(f"{flag} {','.join(map(str, values))} is not MIN,MAX with 1 <= MIN <= MAX", hint=f"e.g. {flag} {example}")

        sides(self.image_sizes, "--image-sizes", "224,336,448,560")
        span(self.text_tokens, "--text-tokens", "64,1536")
        span(self.images_per_sample, "--images-per-sample", "2,4")
        if self.kind not in WORKLOADS:
            raise UsageError(f"--workload {self.kind!r} is not one of {', '.join(WORKLOADS)}", hint="e.g. --workload chat")
        if self.video_frames is None:
            return
        span(self.video_frames, "--video-frames", "16,64")
        low, high = self.video_frames
        if high - high % FRAME_MULTIPLE < low:
            raise UsageError(f"--video-frames {low},{high} holds no multiple of {FRAME_MULTIPLE}: clips have frames in "
                             f"temporal patches of {FRAME_MULTIPLE}, as `vlmctl data prepare` stores them", hint="e.g. --video-frames 16,64")
        sides(self.video_sizes, "--video-sizes", "224,336,448")
        if self.images_per_sample != (1, 1):
            raise UsageError("--images-per-sample with --video-frames: a video sample holds one video and no image",
                             hint="give one of them")
        if self.kind == "baseline":
            raise UsageError("--workload baseline has no video samples",
                             hint="use --workload chat (or auto): video samples go through the model's processor")

    def media(self) -> str:
        """What a sample holds besides its text, in words: "1 image (224-560 px)", "2-3 images (224-560 px)" or
        "1 video of 16-64 frames (224-448 px)"."""
        def span(values) -> str:
            return f"{min(values)}-{max(values)}" if min(values) != max(values) else str(values[0])

        if self.video_frames is not None:
            return f"1 video of {span(self.video_frames)} frames ({span(self.video_sizes)} px)"
        plural = "s" if max(self.images_per_sample) > 1 else ""
        return f"{span(self.images_per_sample)} image{plural} ({span(self.image_sizes)} px)"

    def baseline_sides(self) -> bool:
        """Whether every image side is a multiple of patch x merge, as the baseline workload's samples need."""
        return all(side % (self.patch_size * self.merge_size) == 0 for side in self.image_sizes)

    def size_flags(self) -> str:
        """The flags that set a sample's length, for hints."""
        media = "--video-frames / --video-sizes" if self.video_frames is not None else "--image-sizes / --images-per-sample"
        return f"--text-tokens / {media}"


@dataclass
class BenchResult:
    """The figures of the measured steps, all ranks together: tokens (text + visual) and samples per second, the
    mean step time in seconds, MFU as a fraction of the peak, the largest rank's peak GPU memory in GiB (0 on CPU),
    tokens per step and training FLOPs per token (the cost model's); and what was measured (`name` of the model,
    `workload` and the `media` of its samples, `packing`, `adapter`, `stage`, `strategy`, `world_size` processes,
    `objective`). Visual tokens are the image and video placeholder tokens the collator counted. A grpo result's
    rollout fields (None for the other objectives) are described in the module docstring."""

    name: str
    steps: int
    world_size: int
    strategy: str
    tokens_per_s: float
    text_tokens_per_s: float
    visual_tokens_per_s: float
    samples_per_s: float
    step_time_s: float
    mfu: float
    peak_memory_gib: float  # the largest over ranks
    tokens_per_step: float  # all ranks together
    flops_per_token: float = 0.0  # training FLOPs per token of the measured steps (the cost model's)
    workload: str = "baseline"  # chat | baseline
    media: str = ""  # what a sample holds besides its text (`WorkloadSpec.media`), e.g. "1 video of 16-64 frames (224-448 px)"
    packing: bool = True  # packed rows, else padded micro-batches
    adapter: str = "none"  # none | lora | qlora-4bit | qlora-8bit
    stage: str = ""
    settings: str = ""  # strategy, batch size, activation checkpointing, master weights (and what auto chose)
    balance: float | None = None  # mean / max rank forward+backward time (1.0 on one rank)
    balance_flops: float | None = None  # the same ratio of the ranks' training FLOPs
    data_wait: float | None = None  # the largest rank's share of the time spent waiting for batches
    auto: dict | None = None  # the start-up probe's trials and per-mode rates when `auto` was settled by it
    on_gpu: bool = True  # measured on GPUs; on CPUs MFU (against DEFAULT_PEAK) and peak memory are not figures of the run
    objective: str = "sft"  # train.objective: sft | dpo | grpo
    # grpo only (None otherwise), means over the measured steps, all ranks together:
    rollouts_per_step: float | None = None  # completions generated per step (prompts x group_size x ranks)
    rollouts_per_s: float | None = None  # completions per second of generation (the step's `time/rollout_s`)
    generated_tokens_per_s: float | None = None  # completion tokens per second of generation
    rollout_s: float | None = None  # seconds per step of generation, rewards and packing (mean over ranks)
    train_s: float | None = None  # seconds per step of the rest: forward, backward, optimizer step (step_time_s - rollout_s)
    generation_share: float | None = None  # rollout_s / step_time_s
    train_tokens_per_s: float | None = None  # tokens of the trained rollout rows per second of train_s
    # each measured step's wall seconds on its slowest rank, in order: an outlier (a compilation or autotuning for a
    # new shape, an allocator retry) shows here while the mean step_time_s only grows
    step_times_s: list[float] | None = None
    # each measured step's seconds in the interpreter's garbage collector on this rank (`serve.heap.GCPauses`), and the
    # full collections among them: a full one walks every object alive (a pause of a few hundred ms once torch,
    # transformers and compiled layers are loaded), which a step time alone cannot tell from the GPU's work
    step_gc_s: list[float] | None = None
    gc_full: int | None = None
    # graphs torch.compile (Dynamo) compiled in each measured step on this rank, recompilations included: a layer
    # recompiled for a new shape stops the step for seconds, which the step time alone cannot tell from other pauses
    step_compiles: list[int] | None = None
    # objects the trainer froze out of the collector's reach after `train.gc_freeze_step` steps (0: none frozen)
    gc_frozen: int | None = None

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size

    @property
    def rollouts_per_s_per_gpu(self) -> float | None:
        return None if self.rollouts_per_s is None else self.rollouts_per_s / self.world_size

    def as_dict(self) -> dict[str, Any]:
        extra = {} if self.rollouts_per_s is None else {"rollouts_per_s_per_gpu": self.rollouts_per_s_per_gpu}
        return {**asdict(self), "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, **extra}


# --------------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class ModelChoice:
    """Where the benchmarked model comes from (see `choose_model`), resolved without loading weights.

    `kind`: "folder" (a `model build` folder), "base" (`model.base`) or "random" (built in memory from `plan`);
    `source`: the folder or base reference (None for random); `processor`: the model's processor; `config`: its
    transformers config; `note`: why a built folder was passed over, or ""."""

    kind: str
    name: str
    family: Any
    processor: Any
    config: Any
    source: str | None = None
    plan: Any = None
    note: str = ""


def choose_model(model_section) -> ModelChoice:
    """The model `vlmctl train` would train for `model_section`, without its weights: the built folder
    (`model.output_dir`) unless it was built from other settings, else a random-init build plan (`model.init:
    random`), else `model.base` (as `vlmctl.train.setup.model_source`).

    Raises UsageError when the section names pretrained weights that are not built (compose mode) or a built folder
    that no longer matches it; ConfigError / ModelError from `vlmctl.models.build.plan_build` and from loading a
    processor (an unknown preset, a Hub id that cannot be reached, ...).
    """
    from vlmctl.errors import UsageError
    from vlmctl.models.build import is_preset
    from vlmctl.models.load import quiet_transformers
    from vlmctl.train.setup import BUILT_MODEL_FILES

    folder = Path(model_section.output_dir)
    built = any((folder / name).is_file() for name in BUILT_MODEL_FILES)
    stale = built and _built_from_other_settings(folder, model_section)
    with quiet_transformers():
        if built and not stale:
            return _loaded_choice("folder", str(folder), model_section)
        if model_section.init == "random":
            choice = _random_choice(model_section)
            if stale:
                choice.note = f"{folder} was built from other model settings: benchmarking a random-init model of the configured ones"
            return choice
        if stale:
            raise UsageError(f"{folder} holds a model built from other settings than the model section",
                             hint="rebuild it with `vlmctl model build --force`, or set model.output_dir to another folder")
        if model_section.base is not None and not (is_preset(model_section.base)):
            return _loaded_choice("base", str(model_section.base), model_section)
    raise UsageError(f"no built model in {folder}, and model.init is pretrained: vlmctl bench has no weights to load",
                     hint="run `vlmctl model build` first, or set model.init=random to measure random weights of the same architecture")


def _built_from_other_settings(folder: Path, section) -> bool:
    """True when `folder`'s `vlmctl_model.json` records a preset, vision encoder + LLM, or base other than the ones
    `section` names (a folder without that record is taken as it is, as training takes it)."""
    from vlmctl.models.build import is_preset
    from vlmctl.models.load import read_build_info

    info = read_build_info(folder)
    if not info:
        return False
    built = info.get("built_from") or {}
    preset = section.preset or (section.base if section.init == "random" and is_preset(section.base) else None)
    if preset is not None:
        return built.get("preset") != preset
    if section.vision is not None or section.llm is not None:
        return (built.get("vision"), built.get("llm")) != (section.vision, section.llm)
    if section.base is not None:
        base = str(section.base)
        local = Path(base).expanduser()
        return built.get("base") not in (base, str(local.resolve()) if local.exists() else base)
    return False


def _loaded_choice(kind: str, source: str, section) -> ModelChoice:
    """A folder or base model: its processor and config (no weights), its family as `load_model` detects it."""
    from vlmctl.families import detect_family, get_family
    from vlmctl.models.load import load_or_explain, load_processor, read_build_info, transformers_class

    info = (read_build_info(source) if Path(source).is_dir() else None) or {}
    ref = info.get("source", source) if info.get("mode") == "base" else source
    config = load_or_explain("model", ref, lambda: transformers_class("AutoConfig").from_pretrained(
        ref, trust_remote_code=section.trust_remote_code))
    family = get_family(section.family or info.get("family") or detect_family(config))
    processor = load_processor(source, trust_remote_code=section.trust_remote_code)
    built = info.get("built_from") or {}
    what = built.get("preset") or built.get("base") or (f"{built['vision']} + {built['llm']}" if built.get("vision") else family.name)
    name = f"{what} ({source})" if kind == "folder" else source
    return ModelChoice(kind=kind, name=name, family=family, processor=processor, config=config, source=source)


def _random_choice(section) -> ModelChoice:
    """A random-init model of the section: its build plan, and the processor `model build` would make (a tokenizer
    trained on synthetic text where the plan has none, `vlmctl.data.synthetic.word_texts`)."""
    from vlmctl.data.synthetic import word_texts
    from vlmctl.models.build import make_config, make_processor, plan_build

    plan = plan_build(section)
    processor = make_processor(plan, tokenizer_texts=word_texts())
    name = plan.preset or (f"{section.vision} + {section.llm}" if section.vision else str(section.base))
    return ModelChoice(kind="random", name=name, family=plan.family, processor=processor,
                       config=make_config(plan, processor.tokenizer), plan=plan)


def random_model(plan, processor, *, device, dtype):
    """A random-init model of `plan` on `device` in `dtype` (a torch dtype), initialized as `model build`'s
    random-init path does (`vlmctl.models.build.make_model`: the family's `init_random`, the projector's own init),
    allocated on the device directly (no CPU copy). Token ids and the vocabulary size come from `processor`'s
    tokenizer."""
    import torch

    from vlmctl.models.build import instantiate

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    model = instantiate(plan, processor.tokenizer, device=str(device), dtype=names[dtype])
    plan.family.init_random(model)
    if plan.projector is not None and plan.projector.init is not None:
        plan.projector.init(model.get_submodule(plan.family.projector[0]))
    return model


# --------------------------------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleMedia:
    """The media of one synthetic sample: the sides in px of its square images, in order, or one video clip of
    `video` = (frames, side in px) square frames."""

    images: tuple[int, ...] = ()
    video: tuple[int, int] | None = None


def draw_media(spec: WorkloadSpec, rng: random.Random) -> SampleMedia:
    """One sample's media drawn from `spec` with `rng`: a clip of an even frame count in `spec.video_frames` (each
    count equally likely) and a side of `spec.video_sizes`, else `spec.images_per_sample` images, a side of
    `spec.image_sizes` each."""
    from vlmctl.data.modalities.video import FRAME_MULTIPLE

    if spec.video_frames is not None:
        low, high = spec.video_frames
        frames = rng.randrange(low + -low % FRAME_MULTIPLE, high - high % FRAME_MULTIPLE + 1, FRAME_MULTIPLE)
        return SampleMedia(video=(frames, rng.choice(spec.video_sizes)))
    low, high = spec.images_per_sample
    count = low if low == high else rng.randint(low, high)  # no draw for a fixed count: one-image samples stay as they were
    return SampleMedia(images=tuple(rng.choice(spec.image_sizes) for _ in range(count)))


def smallest_media(spec: WorkloadSpec) -> SampleMedia:
    """The media of `spec`'s shortest sample: the fewest frames or images, at the smallest side."""
    from vlmctl.data.modalities.video import FRAME_MULTIPLE

    if spec.video_frames is not None:
        low = spec.video_frames[0]
        return SampleMedia(video=(low + -low % FRAME_MULTIPLE, min(spec.video_sizes)))
    return SampleMedia(images=(min(spec.image_sizes),) * spec.images_per_sample[0])


def describe_media(media: SampleMedia) -> str:
    """`media` in words, for messages: "a 224 px image", "2 images of 224, 336 px", "a video of 16 frames of 224 px"."""
    if media.video is not None:
        return f"a video of {media.video[0]} frames of {media.video[1]} px"
    if len(media.images) == 1:
        return f"a {media.images[0]} px image"
    return f"{len(media.images)} images of {', '.join(map(str, media.images))} px"


def chat_sample(sample_id: str, answer: str, *, images: Sequence[bytes] = (), video: bytes | None = None):
    """One user turn holding `images` (encoded, in order) or one stored `video` clip, and one assistant turn
    answering with `answer` (the tokens the trainer's collator labels): the shape of every chat sample `vlmctl
    bench` trains on (`vlmctl.data.synthetic.image_chat` with several images, or a video)."""
    from vlmctl.data.sample import Sample

    parts = [{"type": "video", "index": 0}] if video is not None else [{"type": "image", "index": k} for k in range(len(images))]
    return Sample(id=sample_id, source="synthetic", images=list(images), videos=None if video is None else [video],
                  messages=[{"role": "user", "content": parts},
                            {"role": "assistant", "content": [{"type": "text", "text": answer}]}])


def random_clip(frames: int, side: int, seed: int | tuple[int, ...]) -> bytes:
    """A stored clip (`vlmctl.data.modalities.video.encode_clip`: Motion JPEG in Matroska, what `data prepare`
    stores) of `frames` frames of `side` x `side` px uniform random RGB pixels at `VIDEO_FPS`, deterministic for
    `seed`. Returns the encoded bytes. Raises VideoError without PyAV."""
    import numpy as np

    from vlmctl.data.modalities.video import Clip, encode_clip

    pixels = np.random.default_rng(seed).integers(0, 256, size=(frames, side, side, 3), dtype=np.uint8)
    return encode_clip(Clip(pixels, VIDEO_FPS))


def qwen_vl_samples(n: int, cfg, spec: WorkloadSpec = WorkloadSpec(), seed: int = 0, *, pixels: bool = True) -> list[dict[str, Any]]:
    """`n` encoded samples shaped like the baseline's: dicts with input_ids/labels (L,), mm_token_type_ids (L,),
    pixel_values (patches, 3 * t * patch^2) float32 (None with `pixels=False`; `baseline_row` draws them) and
    image_grid_thw (images, 3), plus `n_patches`, `n_visual`, `n_text` counts (tokens; the vision start/end tokens
    count as text) and `n_images`. Each image (`spec.images_per_sample` of them, `draw_media`) is its visual tokens
    between vision start/end tokens, the text follows them. `cfg` is a Qwen2/2.5-VL config (token ids, vocabulary
    size)."""
    import torch

    rng = random.Random(seed)
    vocab = cfg.text_config.vocab_size
    special = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    out = []
    for _ in range(n):
        grids = [(side // spec.patch_size,) * 2 for side in draw_media(spec, rng).images]
        n_text = rng.randint(*spec.text_tokens)
        ids = []
        for gh, gw in grids:
            ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (gh * gw // spec.merge_size**2) + [cfg.vision_end_token_id]
        prefix = len(ids)
        ids += [t if t not in special else t + len(special) + 1 for t in (rng.randrange(0, vocab - len(special) - 1) for _ in range(n_text))]
        ids_t = torch.tensor(ids)
        labels = ids_t.clone()
        labels[:prefix] = -100
        patches = sum(gh * gw for gh, gw in grids)
        out.append({
            "input_ids": ids_t,
            "labels": labels,
            "mm_token_type_ids": (ids_t == cfg.image_token_id).long(),
            "pixel_values": torch.randn(patches, 3 * spec.temporal_patch_size * spec.patch_size**2) if pixels else None,
            "image_grid_thw": torch.tensor([[1, gh, gw] for gh, gw in grids]),
            "n_patches": patches,
            "n_visual": prefix - 2 * len(grids),
            "n_text": n_text + 2 * len(grids),
            "n_images": len(grids),
        })
    return out


def baseline_row(sample: dict[str, Any], spec: WorkloadSpec):
    """One `qwen_vl_samples` sample as the collator's `Encoded` row (random pixel values drawn where it has none)."""
    import torch

    from vlmctl.data.collate import Encoded

    pixels = sample["pixel_values"]
    if pixels is None:
        pixels = torch.randn(sample["n_patches"], 3 * spec.temporal_patch_size * spec.patch_size**2)
    return Encoded(sample["input_ids"], sample["labels"], {"image": {"pixel_values": pixels, "image_grid_thw": sample["image_grid_thw"]}},
                   {"image": int(sample["image_grid_thw"].shape[0])}, num_visual_tokens=sample["n_visual"],
                   token_inputs={"mm_token_type_ids": sample["mm_token_type_ids"]})


class Workload:
    """The synthetic samples of one bench: `lengths` (tokens per sample, list of ints) and `batch(indices, collator)`,
    one micro-batch collated by the trainer's collator. Deterministic for its seed: every rank draws the same."""

    kind = ""

    def batch(self, indices: list[int], collator) -> dict[str, Any]:
        raise NotImplementedError

    def costs(self, cost_model):
        """Estimated training FLOPs per sample (float64 [N], `CostModel.sample_costs`), or None when unknown."""
        return None


class ChatWorkload(Workload):
    """Random chat samples (`chat_sample`: images, or one video clip) for `processor`: at least `min_samples` of them,
    and with `budget` (packed rows of that many tokens) at least `min_tokens` tokens of samples that fit a row.
    Their lengths are counted without media (`vlmctl.data.tokens.TokenCounter`, exactly what the processor makes;
    a clip's tokens by the family's video-token rule, `FamilySpec.num_video_tokens`); images and clips are drawn
    only for the samples a rank collates. Raises UsageError when (almost) no sample fits a row."""

    kind = "chat"

    def __init__(self, processor, family, spec: WorkloadSpec, *, seed: int, min_samples: int, min_tokens: int = 0,
                 budget: int | None = None, pairs: bool = False):
        from vlmctl.data.synthetic import single_token_words, word_texts
        from vlmctl.data.tokens import TokenCounter
        from vlmctl.errors import UsageError

        self.spec, self.seed, self.family, self.pairs = spec, seed, family, pairs
        self.rejected: list[str] = []  # pairs: each sample's rejected answer, as long as its chosen one
        self.counter = TokenCounter(processor, family.name, None)
        tokenizer = getattr(processor, "tokenizer", processor)
        # where the vocabulary has no single-token words, pseudo-words keep the text random (its length in tokens
        # then only approximates --text-tokens; the counted lengths stay exact)
        self.words = single_token_words(tokenizer) or [" " + w for w in " ".join(word_texts(num_texts=4)).split()]
        self._per_side: dict[int, int] = {}
        if spec.video_frames is not None:
            # a sample's text is counted around a 2-frame stand-in clip whose tokens are then taken out again
            self._stand_in = random_clip(2, 28, 0)
            self._stand_in_tokens = self.counter.video_tokens(self._stand_in)
        if budget is not None:
            smallest = smallest_media(spec)
            shortest = self._count(self._answer(random.Random(seed), spec.text_tokens[0]), smallest)
            if shortest > budget:
                raise UsageError(f"the shortest synthetic sample ({shortest} tokens: {describe_media(smallest)} and "
                                 f"{spec.text_tokens[0]} answer tokens) does not fit a packed row of train.tokens_per_batch={budget} tokens",
                                 hint=f"raise train.tokens_per_batch, or lower {spec.size_flags()}")
        rng = random.Random(seed)
        self.media: list[SampleMedia] = []
        self.answers: list[str] = []
        self.lengths: list[int] = []
        fitting = fits = 0
        while len(self.lengths) < min_samples or fitting < min_tokens:
            if len(self.lengths) >= 4096 and fits < RARE_FIT * len(self.lengths):
                raise UsageError(f"only {fits} of {len(self.lengths)} synthetic samples fit a packed row of "
                                 f"train.tokens_per_batch={budget} tokens", hint=f"raise train.tokens_per_batch, or lower {spec.size_flags()}")
            media, n_text = draw_media(spec, rng), rng.randint(*spec.text_tokens)
            answer = self._answer(rng, n_text)
            n = self._count(answer, media)
            if pairs:  # a preference pair packs its prompt and media twice (`data.checks.count_tokens`)
                self.rejected.append(self._answer(rng, n_text))
                n += self._count(self.rejected[-1], media)
            self.media.append(media)
            self.answers.append(answer)
            self.lengths.append(n)
            if budget is None or n <= budget:
                fitting, fits = fitting + n, fits + 1

    def _answer(self, rng: random.Random, n_text: int) -> str:
        from vlmctl.data.synthetic import random_text

        return random_text(self.words, n_text, rng)

    def _count(self, answer: str, media: SampleMedia) -> int:
        """Tokens of a sample answering `answer` with `media`, as the processor makes them."""
        if media.video is None:
            return self.counter.count(chat_sample("count", answer, images=[b""] * len(media.images)),
                                      [(side, side) for side in media.images])
        text = self.counter.count(chat_sample("count", answer, video=self._stand_in), []) - self._stand_in_tokens
        return text + self.visual_tokens(media)

    def visual_tokens(self, media: SampleMedia) -> int:
        """Visual (placeholder) tokens of a sample's images or video under the family's rules (a Qwen3-VL clip's
        include the timestamp text and vision start / end tokens its processor writes per temporal patch)."""
        if media.video is not None:
            frames, side = media.video
            return int(self.family.num_video_tokens(frames, side, side, self.counter.processor, fps=VIDEO_FPS))
        for side in set(media.images) - set(self._per_side):
            self._per_side[side] = self.counter.visual_tokens(side, side)
        return sum(self._per_side[side] for side in media.images)

    def vision_frames(self, media: SampleMedia) -> int:
        """Frames the vision tower attends over one by one: one per image; a clip's temporal patches (frames /
        the video processor's temporal patch size, rounded up)."""
        if media.video is None:
            return len(media.images)
        temporal = int(getattr(getattr(self.counter.processor, "video_processor", None), "temporal_patch_size", None) or 2)
        return -(-media.video[0] // temporal)

    def costs(self, cost_model):
        """Training FLOPs per sample: its images' or clip's visual tokens (a clip as its temporal patches, each an
        image of the frame's patches), the rest text, all of it labelled (an upper bound: the chat template's
        tokens are not)."""
        import numpy as np

        tokens = np.asarray(self.lengths)
        copies = 2 if self.pairs else 1  # a pair's media are encoded once per answer
        visual = copies * np.asarray([self.visual_tokens(m) for m in self.media])
        frames = copies * np.asarray([self.vision_frames(m) for m in self.media])
        return cost_model.sample_costs(tokens, visual, np.maximum(tokens - visual, 0), frames)

    def sample(self, i: int):
        """Sample `i` with its images or clip (deterministic for the workload's seed and `i`)."""
        from vlmctl.data.synthetic import random_image

        media = self.media[i]
        if media.video is not None:
            sample = chat_sample(f"synthetic-{i}", self.answers[i], video=random_clip(*media.video, (self.seed, i)))
        else:
            images = [random_image(side, (self.seed, i, k)) for k, side in enumerate(media.images)]
            sample = chat_sample(f"synthetic-{i}", self.answers[i], images=images)
        if self.pairs:
            sample.rejected = {"role": "assistant", "content": [{"type": "text", "text": self.rejected[i]}]}
        return sample

    def batch(self, indices: list[int], collator) -> dict[str, Any]:
        """The trainer's collator over samples `indices`: encode (processor, chat template, labels) then pack (one
        row: `input_ids` [1, T]) or pad (`input_ids` [len(indices), T_max]), with the media tensors and counters of
        `vlmctl.data.collate`."""
        return collator([self.sample(i) for i in indices])


class BaselineWorkload(Workload):
    """The baseline's Qwen-VL samples (`qwen_vl_samples`), as many as today's formula draws for `rows` packed rows of
    `budget` tokens; packed by the trainer's collator (`PackedCollator.pack`). Raises UsageError for image sides that
    are not multiples of patch x merge, or samples that cannot fit a row."""

    kind = "baseline"

    def __init__(self, config, spec: WorkloadSpec, *, seed: int, rows: int, budget: int):
        from vlmctl.errors import UsageError

        unit = spec.patch_size * spec.merge_size
        odd = [s for s in spec.image_sizes if s % unit]
        if odd:
            raise UsageError(f"--image-sizes {','.join(map(str, odd))}: the baseline workload needs sides that are multiples of "
                             f"{unit} px (patch {spec.patch_size} x merge {spec.merge_size})",
                             hint=f"use multiples of {unit}, e.g. 224,336,448,560, or --workload chat (the processor resizes)")
        least = spec.images_per_sample[0]
        shortest = spec.text_tokens[0] + least * (2 + min(spec.image_sizes) ** 2 // unit**2)
        if shortest > budget:
            raise UsageError(f"the shortest baseline sample ({shortest} tokens) does not fit a packed row of "
                             f"train.tokens_per_batch={budget} tokens", hint=f"raise train.tokens_per_batch, or lower {spec.size_flags()}")
        self.spec = spec
        per_image = sum((s // spec.patch_size) ** 2 / spec.merge_size**2 for s in spec.image_sizes) / len(spec.image_sizes)
        mean_tokens = sum(spec.text_tokens) / 2 + per_image * sum(spec.images_per_sample) / 2
        n = int((rows + 2) * budget / mean_tokens * 1.3) + 8
        self.samples = qwen_vl_samples(n, config, spec, seed=seed, pixels=False)
        self.lengths = [int(s["input_ids"].numel()) for s in self.samples]

    def costs(self, cost_model):
        """Training FLOPs per sample from its counts (`n_visual` visual tokens of `n_images` images, `n_text`
        labelled)."""
        import numpy as np

        tokens = np.asarray(self.lengths)
        visual = np.asarray([s["n_visual"] for s in self.samples])
        labelled = np.asarray([s["n_text"] for s in self.samples])
        return cost_model.sample_costs(tokens, visual, labelled, np.asarray([s["n_images"] for s in self.samples]))

    def batch(self, indices: list[int], collator) -> dict[str, Any]:
        """One packed row ([1, T]) of samples `indices` by the trainer's `PackedCollator.pack`."""
        return collator.pack([baseline_row(self.samples[i], self.spec) for i in indices])


def rank_batches(lengths: list[int], *, packing: bool, budget: int, micro_batch_size: int, rows: int, dp_rank: int,
                 dp_size: int, seed: int = 0, group_by_length: bool = True, costs=None,
                 step_batches: int = 1) -> list[list[int]]:
    """This data-parallel rank's `rows` micro-batches (sample indices) of samples of `lengths` tokens.

    Packed: first-fit decreasing bins of at most `budget` tokens (`vlmctl.data.packing.first_fit_decreasing`;
    longer samples are left out, as the trainer's packed sampler leaves them), fullest first, every dp_size-th to
    this rank. Padded: the trainer's `DistributedBatchSampler` (`micro_batch_size` samples, length grouping as
    `group_by_length`). With `costs` (per-sample training FLOPs, float [N]; pass them when training would balance,
    `train.balance`) each optimizer step's `step_batches x dp_size` micro-batches are split again by cost as the
    trainer's samplers split them (`vlmctl.data.samplers.balance_step`), so every rank gets the work it would get
    in training. Raises UsageError when the samples make too few micro-batches.
    """
    import itertools

    import numpy as np

    from vlmctl.data.packing import first_fit_decreasing
    from vlmctl.data.samplers import DistributedBatchSampler, balance_step, integer_costs
    from vlmctl.errors import DataError, UsageError

    balancing = costs is not None and step_batches * dp_size > 1
    if packing:
        fitting = ((i, n) for i, n in enumerate(lengths) if n <= budget)
        bins = list(first_fit_decreasing(fitting, budget, lookahead=512))
        bins.sort(key=lambda b: -sum(lengths[k] for k in b))
        if len(bins) < rows * dp_size:
            raise UsageError(f"{len(lengths)} synthetic samples make only {len(bins)} packed rows; {rows * dp_size} are needed",
                             hint="raise train.tokens_per_batch or lower --steps")
        if not balancing:
            return bins[dp_rank:rows * dp_size:dp_size]
        per_step, mine = step_batches * dp_size, []
        tokens, scaled = np.asarray(lengths, dtype=np.int64), integer_costs(costs, len(lengths))
        for start in range(0, rows * dp_size, per_step):  # rows is a whole number of optimizer steps
            step = balance_step(bins[start:start + per_step], tokens, scaled, world_size=dp_size, budget=budget)
            mine.extend(global_batch[dp_rank] for global_batch in step)
        return mine
    try:
        sampler = DistributedBatchSampler(np.asarray(lengths), micro_batch_size=micro_batch_size, world_size=dp_size,
                                          rank=dp_rank, seed=seed, group_by_length=group_by_length,
                                          costs=costs if balancing else None, step_batches=step_batches)
    except DataError as exc:
        raise UsageError(exc.message, hint="lower train.micro_batch_size or --nproc-per-node") from None
    return list(itertools.islice(iter(sampler), rows))


# --------------------------------------------------------------------------------------------------------------------
# What a bench measures, checked before any process starts
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class BenchPlan:
    """A bench resolved without weights: the model, whether rows are packed, the workload and its samples, the
    micro-batches per rank (`rows`) and the data-parallel size they were planned for."""

    model: ModelChoice
    packing: bool
    spec: WorkloadSpec
    workload: Workload
    rows: int
    dp_size: int
    adapter: str = "none"
    run: Any = None  # config.plan.RunPlan: the decisions training would take for these settings here
    prompts: bool = False  # grpo: micro-batches of `train.micro_batch_size` prompts, whose rollouts are packed later


def adapter_name(train) -> str:
    """none, lora, qlora-4bit or qlora-8bit for `train.lora`."""
    if train.lora is None:
        return "none"
    return "lora" if train.lora.quantize == "none" else f"qlora-{train.lora.quantize}"


def prepare(model_section, train, spec: WorkloadSpec = WorkloadSpec(), *, steps: int = 20, warmup: int = 3,
            dp_size: int = 1, check_device: bool = True, log=None) -> BenchPlan:
    """Resolve and check a bench of `steps + warmup` optimizer steps on `dp_size` data-parallel processes, loading no
    weights: the flags (`spec`, steps), the model (`choose_model`), packing (off for families without it), video
    samples on a family that takes them (`check_video`), the workload and its micro-batches, and with
    `check_device` what this machine's device must allow (QLoRA on CUDA, no more processes than visible GPUs,
    precision, attention and liger settings, `optimizer_in_backward`).

    Raises UsageError (exit code 2) for bad flags and settings bench cannot run, ConfigError for settings training
    refuses too, ModelError for a model that cannot be loaded.
    """
    from vlmctl.errors import UsageError

    log = log or (lambda msg: None)
    if steps < 1 or warmup < 0:
        raise UsageError(f"--steps {steps} / --warmup {warmup}: bench needs at least one measured step and no negative warm-up",
                         hint="e.g. --steps 20 --warmup 3")
    spec.check()
    model = choose_model(model_section)
    if model.note:
        log(model.note)
    # one process runs in this process, as `vlmctl train --launcher none`
    processes = dp_size * train.sequence_parallel * train.tensor_parallel
    planned = train.model_copy(update={"launcher": "none"}) if processes == 1 else train
    run = build_plan(planned, DeviceFacts.here(processes), family=model.family)
    packing = run.packing.value
    if check_device:
        check_device_settings(train, run, nproc=dp_size)
    if spec.video_frames is not None:
        check_video(model)
    from vlmctl.train.registry import get_objective

    kind = spec.kind
    objective = get_objective(train.objective)
    pairs, prompts = objective.workload == "pairs", objective.workload == "prompts"
    if kind == "auto":
        kind = "baseline" if model.family.mrope and packing and spec.video_frames is None and not (pairs or prompts) else "chat"
        if kind == "baseline" and not spec.baseline_sides():  # e.g. a tiny project's 32 px pictures
            unit = spec.patch_size * spec.merge_size
            log(f"workload chat: the image sides ({', '.join(map(str, spec.image_sizes))} px) are not multiples of the "
                f"{unit} px the baseline workload builds its samples from; the model's processor resizes them")
            kind = "chat"
    if (pairs or prompts) and kind != "chat":
        what = "preference pairs" if pairs else "prompts (the answers are their references)"
        raise UsageError(f"train.objective {train.objective} benches {what} of the chat workload", hint="use --workload chat (or auto)")
    if kind == "baseline" and not (model.family.mrope and packing):
        why = "packed rows" if model.family.mrope else "Qwen-VL families"
        raise UsageError(f"--workload baseline is the Qwen-VL baseline's packed workload; this bench has no {why}",
                         hint="use --workload chat (or auto)" + ("" if model.family.mrope else f"; model family {model.family.name!r}"))
    rows = (steps + warmup) * train.gradient_accumulation_steps
    budget = row_budget(train)
    if kind == "baseline":
        workload: Workload = BaselineWorkload(model.config, spec, seed=train.seed, rows=rows * dp_size, budget=budget)
    else:
        rowed = packing and objective.packs_samples  # else micro-batches (grpo's prompts), as training's sampler deals them
        min_samples = 0 if rowed else rows * dp_size * micro_batch(train)
        workload = ChatWorkload(model.processor, model.family, spec, seed=train.seed, min_samples=min_samples,
                                min_tokens=int((rows * dp_size + 2) * budget * 1.3) if rowed else 0,
                                budget=budget if rowed else None, pairs=pairs)
    plan = BenchPlan(model=model, packing=packing, spec=replace(spec, kind=kind), workload=workload, rows=rows,
                     dp_size=dp_size, adapter=adapter_name(train), run=run, prompts=prompts)
    plan_batches(plan, train, dp_rank=0)  # raises UsageError when the samples make too few micro-batches
    return plan


def check_video(model: ModelChoice) -> None:
    """Raise UsageError when `--video-frames` cannot run on `model`: its family takes no video
    (`FamilySpec.modalities`) or has no video-token rule in vlmctl (`FamilySpec.num_video_tokens`),
    its processor has no video processor, or PyAV (the `video` extra, which writes and reads the clips) is missing."""
    from vlmctl.errors import ModelError, UsageError
    from vlmctl.train.launch import require_package

    family = model.family
    hint = "measure video on a family that takes it (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), or drop --video-frames"
    if "video" not in family.modalities:
        raise UsageError(f"--video-frames: model family {family.name} takes no video (it takes {', '.join(family.modalities)})", hint=hint)
    try:
        family.num_video_tokens(2, 56, 56, model.processor, fps=VIDEO_FPS)
    except ModelError as exc:
        raise UsageError(f"--video-frames: {exc.message}", hint=hint) from None
    if getattr(model.processor, "video_processor", None) is None:
        raise UsageError(f"--video-frames: the processor of {model.name} has no video processor (transformers' "
                         f"{family.video_processor_class} needs torchvision)", hint="install torchvision, or drop --video-frames")
    require_package("av", "--video-frames", package="av", extra="video", error=UsageError)


def plan_batches(plan: BenchPlan, train, *, dp_rank: int, costs=None) -> list[list[int]]:
    """`rank_batches` of `plan` for data-parallel rank `dp_rank` (lists of sample indices; a grpo plan's are padded
    micro-batches of prompts, whatever `train.packing`), split by `costs` (the workload's per-sample FLOPs,
    `Workload.costs`) when the run's plan balances (`train.balance`). Raises UsageError when the samples make too
    few micro-batches."""
    balance = plan.run is not None and plan.run.balance.value
    return rank_batches(plan.workload.lengths, packing=plan.packing and not plan.prompts, budget=row_budget(train),
                        micro_batch_size=micro_batch(train), rows=plan.rows, dp_rank=dp_rank, dp_size=plan.dp_size,
                        seed=train.seed, group_by_length=train.group_by_length,
                        costs=costs if balance else None, step_batches=train.gradient_accumulation_steps)


def check_device_settings(train, run, *, nproc: int) -> None:
    """Check on this machine what the ranks would refuse: more processes than visible GPUs (CPU processes are
    allowed where no GPU is visible), QLoRA without CUDA, and what the run plan `run` (`config.plan.check_plan`:
    precision, master weights, attention, liger) and `optimizer_in_backward` refuse. Raises UsageError or
    ConfigError."""
    from vlmctl.errors import UsageError
    from vlmctl.train import setup

    gpus = visible_gpus()  # the run plan's count (`config.plan.visible_gpus`)
    if nproc < 1:
        raise UsageError(f"--nproc-per-node {nproc}: at least one process is needed", hint="e.g. --nproc-per-node 1")
    if gpus and nproc > gpus:
        raise UsageError(f"--nproc-per-node {nproc} (train.nproc_per_node) is more than the {gpus} visible GPU(s)",
                         hint=f"use --nproc-per-node {gpus} (or auto), or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    if setup.quantized(train) and not run.device.cuda:
        raise UsageError(f"train.lora.quantize={train.lora.quantize} (QLoRA) needs a CUDA GPU and bitsandbytes; no GPU is visible here",
                         hint="set train.lora.quantize=none to measure LoRA here, or run on a GPU machine")
    check_plan(run, train)
    checked = run.train_section(train)
    if checked.optimizer_in_backward:
        setup.check_optimizer_in_backward(checked, nproc)


# --------------------------------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------------------------------


def run_bench(model_section, train_section, *, steps: int = 20, warmup: int = 3, spec: WorkloadSpec = WorkloadSpec(),
              log=print, setup=None, plan: BenchPlan | None = None, scratch: Path | None = None,
              profile: Path | None = None) -> BenchResult:
    """`vlmctl bench` on this rank: the model of `model_section` (see `choose_model`) trained for `warmup + steps`
    optimizer steps on the synthetic workload `spec` with the settings of `train_section` (strategy, precision,
    master_weights, tokens_per_batch or micro_batch_size, packing, attn_implementation, liger, checkpointing, compile,
    stage, lora, ...). Call it in every process of a torchrun launch, or alone (one process). `setup(model)`, when
    given, is applied to the model before wrapping (benchmark scripts use it to try kernels that have no config key
    yet). `plan`: the `prepare`d bench, when the caller has it (one process); `scratch`: a folder all ranks see,
    where rank 0 saves a random-init model for QLoRA (default: a temporary folder); `profile`: a folder all ranks
    see, where each rank writes the profile of its last warm-up step (`profile_step`). Returns the figures of the
    last `steps` steps, summed over ranks.

    Raises UsageError / ConfigError / ModelError as `prepare` does (and ConfigError from `vlmctl.train.setup` for
    settings only the loaded model shows, e.g. LoRA target modules that match no layer).
    """
    import torch.distributed as dist

    from vlmctl.train.setup import setup_run

    log = log or (lambda msg: None)
    if plan is None:  # a launched rank (its launcher checked the device and logged the notes) or a script
        world = _world_size()
        plan = prepare(model_section, train_section, spec, steps=steps, warmup=warmup, check_device=False,
                       dp_size=world // (train_section.sequence_parallel * train_section.tensor_parallel),
                       log=log if world == 1 else None)
    from vlmctl.train.report import filter_known_warnings

    filter_known_warnings()  # as a training rank
    try:
        ctx = setup_run(train_section, plan.run)
        train_section = ctx.plan.train_section(train_section)  # every decision of the plan, as training reads them
        with tempfile.TemporaryDirectory(prefix="vlmctl-bench-model-") as tmp:
            return _run_bench(plan, model_section, train_section, ctx, steps=steps, warmup=warmup, log=log,
                              setup=setup, scratch=Path(scratch or tmp), profile=profile)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def load_model(plan: BenchPlan, model_section, train, ctx, scratch: Path, log) -> Any:
    """The benchmarked model on this rank, prepared for training (`vlmctl.train.setup.prepare_model`): loaded as
    `vlmctl.train.worker.load_model_for_training` loads it (`load_source`, or `load_quantized` for QLoRA), or a
    random-init one (`random_model`, on the device). For QLoRA of a random-init model, rank 0 saves it to
    `scratch` first and every rank loads the quantized base from there. Returns the `TrainingModel`.

    Raises ModelError for weights that cannot be loaded, ConfigError for LoRA target modules that match no layer."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from vlmctl.models.build import save_model
    from vlmctl.models.load import quiet_transformers
    from vlmctl.train.registry import get_objective
    from vlmctl.train.setup import load_quantized, load_source, prepare_model

    choice, env = plan.model, ctx.env
    cfg = SimpleNamespace(model=model_section, train=train)  # what the loaders read of a project config
    quantized = train.lora is not None and train.lora.quantize != "none"
    source = choice.source
    with quiet_transformers():
        if choice.kind == "random" and quantized:
            source = str(scratch / "model")
            if env.is_main:
                log(f"saving the random-init model to {source} for QLoRA's quantized load")
                # initialized on the device: a 3B model's random init takes tens of seconds on CPU cores
                save_model(random_model(choice.plan, choice.processor, device=env.device, dtype=ctx.stored), Path(source))
                choice.processor.save_pretrained(source)
                if env.device.type == "cuda":
                    import torch

                    torch.cuda.empty_cache()
            dist.barrier()
        if choice.kind == "random" and not quantized:
            model, processor, family = random_model(choice.plan, choice.processor, device=env.device, dtype=ctx.stored), choice.processor, choice.family
        else:
            model, processor, family = (load_quantized if quantized else load_source)(source, cfg, dtype=ctx.stored)
    tm = prepare_model(model, family, train, env.device, compute_dtype=ctx.dtype, plan=ctx.plan,  # as the worker prepares it
                       fused_loss=get_objective(train.objective).fused_loss)
    tm.processor, tm.source = processor, source
    return tm


def _run_bench(plan: BenchPlan, model_section, train, ctx, *, steps, warmup, log, setup, scratch, profile=None) -> BenchResult:
    from vlmctl.distributed.fsdp import fsdp_plan_of
    from vlmctl.train.registry import get_objective
    from vlmctl.train.loop import Trainer, TrainState, prefetch
    from vlmctl.train.worker import wrap_model

    env, dims, total_steps = ctx.env, ctx.dims, steps + warmup
    tm = load_model(plan, model_section, train, ctx, scratch, log)
    if env.is_main:
        log(f"{plan.model.name}: {plan.spec.kind} workload ({plan.spec.media()}), "
            f"{'packed rows' if plan.packing else 'padded micro-batches'}, "
            f"attention {tm.attn}, liger {'on' if tm.liger else 'off'}" + "".join(f", vision {k}" for k in tm.vision_kernels)
            + (f", {plan.adapter}" if plan.adapter != "none" else ""))
    if setup is not None:
        setup(tm.model)
    if dims.dp_size != plan.dp_size:  # planned for another world size (a caller's own plan): plan again
        plan = replace(plan, dp_size=dims.dp_size)
    spec = get_objective(train.objective)
    if spec.bench_settings is not None:  # what the objective changes for the bench's synthetic data
        train, note = spec.bench_settings(train)
        if note and env.is_main:
            log(note)
    reference = frozen_copy(tm.model, ctx.dtype) if spec.frozen(train) else None
    engine = wrap_model(tm, train, ctx, total_steps)
    objective = bench_objective(tm, train, ctx, reference, model_section=model_section)  # as the worker builds it
    choice = None
    if autotune.wants(ctx.plan):  # as `vlmctl train` does on a GPU: probe, then plan the workload at the chosen size
        choice = probe_auto(plan, tm, train, ctx, engine, objective, log)
        plan = prepare(model_section, train, plan.spec, steps=steps, warmup=warmup, check_device=False,
                       dp_size=dims.dp_size)
    collator = spec.collate(tm.processor, tm.family, packed=plan.packing,
                            tokens_per_batch=row_budget(train) if plan.packing else None)
    # None when the workload cannot estimate them, or its samples are prompts (their rollouts are the rows)
    costs = plan.workload.costs(tm.cost_model) if not plan.prompts else None
    batches = [plan.workload.batch(indices, collator)
               for indices in plan_batches(plan, train, dp_rank=dims.dp_rank, costs=costs)]
    trainer = Trainer(engine=engine, objective=objective, batches=prefetch(iter(batches), tm.prepare, device=env.device), env=env, state=TrainState(),
                      total_steps=total_steps, grad_accum=train.gradient_accumulation_steps, batches_per_epoch=len(batches),
                      save_steps=1 << 30, logging_steps=1 << 30, max_bad_steps=total_steps, save=None, log=None,
                      progress=None, flops_of=tm.cost_model.batch_flops, dp_group=dims.dp_group, sp_group=dims.sp_group,
                      gc_freeze_step=train.gc_freeze_step)
    labels = {"name": plan.model.name, "workload": plan.spec.kind, "media": plan.spec.media(), "packing": plan.packing,
              "adapter": plan.adapter, "stage": train.stage, "objective": train.objective}
    result = _measure(trainer, labels, train, ctx, steps=steps, warmup=warmup, log=log, profile=profile)
    result.settings = settings_line(train, choice, fsdp_plan_of(engine.model))
    if choice is not None and choice.trials:
        result.auto = {"reason": choice.reason, "rates": choice.rates, "step_seconds": round(choice.step_seconds, 4),
                       "fp8": choice.fp8, "fp8_reason": choice.fp8_reason,
                       "trials": [[str(t.mode), t.size, round(t.peak_bytes / 2**30, 1), round(t.seconds, 3), t.oom]
                                  for t in choice.trials]}
    return result


def frozen_copy(model, dtype):
    """A frozen copy of the prepared model in the compute `dtype` (the bench's stand-in for a DPO run's reference:
    the same weights)."""
    import copy

    from vlmctl.train.setup import store_frozen

    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    store_frozen(reference, dtype)
    return reference


def bench_objective(tm, train, ctx, reference_model=None, *, model_section=None):
    """The objective a run of `train` builds (`train.worker.build_objective`), over the bench's synthetic model: for
    dpo the frozen `reference_model` copy, the LoRA base, or placeholder reference log-probs (`reference.
    probe_stand_ins`: the step does not depend on their values); for grpo its rewards (user functions imported as
    a run imports them), the family's packed-row hook (taken from `tm`) and, with beta > 0, the frozen
    `reference_model` copy; no rollouts.html. `model_section`: the project's, for grpo's project config."""
    from types import SimpleNamespace

    from vlmctl.train.objectives import has_hook
    from vlmctl.train.worker import build_objective

    # what an objective reads of a project config: generation samples videos as data.video's defaults
    cfg = SimpleNamespace(model=model_section, train=train, data=SimpleNamespace(video=None))
    objective = build_objective(tm, train, ctx, cfg, reference_model=reference_model)
    if has_hook(objective, "before_training"):  # e.g. DPO's precomputed reference: placeholders, never computed
        objective.stand_in_for_probe()
    return objective


def probe_auto(plan: BenchPlan, tm, train, ctx, engine, objective, log):
    """Settle `auto` batch size and activation checkpointing by training's own probe
    (`vlmctl.train.autotune.probe_and_apply`) on rows of the bench's workload (its heaviest samples per token
    first, as training's). Returns the Choice, applied to `train`."""
    return autotune.probe_and_apply(train, ctx, tm, engine, objective, plan.workload.lengths, plan.workload.batch,
                                    packing=plan.packing, costs=plan.workload.costs(tm.cost_model), log=log)


def settings_line(train, choice, fsdp=None) -> str:
    """What was measured, in one line: strategy, batch size, activation checkpointing, master weights, float8 (and
    why, when `auto` chose them), and with `fsdp` (the `vlmctl.distributed.fsdp.FsdpPlan` of the wrapped model) FSDP2's
    reshard-after-forward and prefetch."""
    from vlmctl.distributed.checkpointing import describe, describe_memory_helpers
    from vlmctl.train.registry import get_objective

    spec = get_objective(train.objective)
    size = f"{token_budget(train)} tokens per row" if train.packing and spec.packs_samples else f"micro-batch {micro_batch(train)}"
    if train.packing and train.sequence_parallel > 1:
        size = f"{row_budget(train)} tokens per row over {train.sequence_parallel} sequence-parallel ranks (Ulysses)"
    if train.tensor_parallel > 1:
        size += f", language model over {train.tensor_parallel} tensor-parallel ranks"
    why = f" [auto: {choice.reason}]" if choice is not None else ""
    fp8 = f", float8 {train.fp8} linears" if train.fp8 in FLOAT8_RECIPES else ""
    fp8 += " (fast accumulation in backward)" if fp8 and train.fp8_fast_accum == "all" else ""
    if choice is not None and choice.fp8 is not None:
        why = f" [auto: {choice.reason}; fp8 {choice.fp8_reason}]"
    ac = train.activation_checkpointing
    overlap = f"; FSDP2 {fsdp.describe()}" if fsdp is not None else ""
    extra = describe_memory_helpers(train)
    rounding = " (stochastic rounding)" if train.master_weights == "bf16" and train.stochastic_rounding == "on" else ""
    words = spec.describe(train)
    objective = f"; {words}" if words else ""
    return (f"{train.strategy}, {size}, activation checkpointing {describe('off' if pending(ac) else ac)}{extra}, "
            f"{train.master_weights} master weights{rounding}{fp8}{why}{overlap}{objective}")


def _compiled_graphs() -> int:
    """Graphs torch.compile's Dynamo has compiled in this process so far (its `counters`, recompilations included);
    0 where Dynamo was never imported (nothing compiled), without importing it: its import alone changes what the
    steps run."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def _measure(trainer, labels: dict[str, Any], train, ctx, *, steps: int, warmup: int, log, profile: Path | None = None) -> BenchResult:
    """`warmup + steps` trainer steps; the figures of the last `steps`. Tokens, samples and FLOPs are the steps'
    own data-parallel sums; the time is the slowest rank's, the memory the largest. The measured steps run back to
    back as in training (the device synchronized before the first and after the last): a step's seconds run from
    the last step's return to its own, so a step whose host work overlaps the last one's update is timed as it
    runs. `labels`: the result's name, workload, media, packing, adapter and stage. `profile`: profile the last warm-up step on every rank into that
    folder (`vlmctl.profiling.profile_step`; a warm-up step, so the profiler's cost stays out of the figures)."""
    import torch
    import torch.distributed as dist

    from vlmctl.profiling import profile_step
    from vlmctl.serve.heap import GCPauses
    from vlmctl.train import flops as cost
    from vlmctl.train.metrics import peak_flops, straggler_stats

    env = ctx.env
    cuda = env.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    totals = torch.zeros(4, dtype=torch.float64)  # flops, text, visual, samples
    seconds = torch.zeros(1, dtype=torch.float64)
    measured = []  # the measured steps' results: per-rank compute and data-wait figures
    times = []  # the measured steps' wall seconds on this rank
    rollouts = {"rollouts": 0.0, "seconds": 0.0, "tokens": 0.0}  # grpo: the steps' rollout figures (all ranks)
    generations = 0  # measured steps with rollout figures
    pauses, gc_times, gc_full = GCPauses().install(), [], 0  # the collector's pauses in each measured step
    compiles = []  # Dynamo's graphs compiled in each measured step (`_compiled_graphs`)
    frozen = 0
    try:
        for i in range(steps + warmup):
            # The warm-up steps and the first measured one start from an idle device; the measured steps then run
            # back to back as in training, where the host queues a step's forward while the device still runs the
            # last update, and the last one's time includes its update (the sync after it).
            if i <= warmup:
                sync()
            collected, full = sum(pauses.seconds), pauses.collections[2]
            graphs = _compiled_graphs()
            t0 = time.perf_counter()
            if profile is not None and i == warmup - 1:  # not measured: the profiler and writing its trace cost time
                result, summary = profile_step(trainer.train_step, Path(profile) / f"rank{env.rank}", sync)
                if env.is_main:
                    log(summary)
            else:
                result = trainer.train_step()  # returns once its gradient norm and stats are read
            if i == steps + warmup - 1:
                sync()
            dt = time.perf_counter() - t0
            generated = _rollout_figures(result)
            if i >= warmup:
                gc_times.append(sum(pauses.seconds) - collected)
                gc_full += pauses.collections[2] - full
                compiles.append(_compiled_graphs() - graphs)
                totals += torch.tensor([result.flops, result.text_tokens, result.visual_tokens, result.samples], dtype=torch.float64)
                seconds += dt
                times.append(dt)
                measured.append(result)
                if generated is not None:
                    generations += 1
                    for key, value in generated.items():
                        rollouts[key] += value
            if env.is_main:
                loss = "skipped" if result.loss is None else f"{result.loss:.3f}"
                part = "" if generated is None else (f", {generated['rollouts']:.0f} rollouts of {generated['tokens']:.0f} "
                                                     f"generated tokens in {generated['seconds'] * 1000:.0f} ms")
                log(f"step {i}{' (warm-up)' if i < warmup else ''}: loss {loss}, {dt * 1000:.0f} ms, "
                    f"{result.text_tokens + result.visual_tokens} tokens, {result.samples} samples{part}")
    finally:
        pauses.remove()
        frozen = trainer.frozen_objects
        trainer.release_heap()
    peak = torch.tensor([torch.cuda.max_memory_allocated(env.device) / 2**30 if cuda else 0.0], dtype=torch.float64)
    per_step = torch.tensor(times, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        peak, seconds, per_step = peak.to(env.device), seconds.to(env.device), per_step.to(env.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    flops, text, visual, n_samples = (float(x) for x in totals)
    total, world, toks = float(seconds.cpu()[0]), env.world_size, text + visual
    mfu = cost.mfu(flops, total, peak_flops(env.device) or DEFAULT_PEAK, world)
    stragglers = straggler_stats(measured, total)
    grpo = {}
    if generations:  # the objective generates (grpo): its rollout figures
        gen = rollouts["seconds"]
        grpo = {"rollouts_per_step": rollouts["rollouts"] / steps, "rollouts_per_s": rollouts["rollouts"] / gen if gen else 0.0,
                "generated_tokens_per_s": rollouts["tokens"] / gen if gen else 0.0, "rollout_s": gen / steps,
                "train_s": (total - gen) / steps, "generation_share": gen / total,
                "train_tokens_per_s": toks / (total - gen) if total > gen else 0.0}
    return BenchResult(
        name=labels["name"], steps=steps, world_size=world, strategy=train.strategy,
        tokens_per_s=toks / total, text_tokens_per_s=text / total, visual_tokens_per_s=visual / total,
        samples_per_s=n_samples / total, step_time_s=total / steps, mfu=mfu or 0.0,
        peak_memory_gib=float(peak.cpu()[0]), tokens_per_step=toks / steps, flops_per_token=flops / max(toks, 1.0), on_gpu=cuda,
        workload=labels["workload"], media=labels["media"], packing=labels["packing"], adapter=labels["adapter"],
        stage=labels["stage"], objective=labels.get("objective", "sft"),
        balance=stragglers.get("balance"), balance_flops=stragglers.get("balance_flops"),
        data_wait=stragglers.get("data_wait"), step_times_s=per_step.cpu().tolist(), step_gc_s=gc_times, gc_full=gc_full, step_compiles=compiles,
        gc_frozen=frozen,
        **grpo,
    )


def _rollout_figures(result) -> dict[str, float] | None:
    """A grpo step's rollouts, generated tokens and generation seconds from its metrics (`GRPOObjective.metrics`:
    `rollouts` and `completions/mean_length` summed over the data-parallel ranks, `time/rollout_s` their mean);
    None for a step without them (another objective, or a skipped step)."""
    metrics = result.metrics
    if "time/rollout_s" not in metrics:
        return None
    return {"rollouts": metrics["rollouts"], "seconds": metrics["time/rollout_s"],
            "tokens": metrics["completions/mean_length"] * metrics["rollouts"]}


# --------------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------------


def benchmark(cfg, *, steps: int = 20, warmup: int = 3, spec: WorkloadSpec = WorkloadSpec(), log=print,
              show_plan=None, profile: Path | None = None) -> BenchResult:
    """`vlmctl bench` for a project config: checked first (`check_bench`, before any process starts), then run
    (`run_processes`) in this process for one process per node, else one process per GPU through torchrun
    (`train.nproc_per_node`, auto = the visible GPUs; CPU processes where no GPU is visible). `show_plan(run_plan)`,
    when given, gets the run plan (`config.plan.RunPlan`) once it is checked. Raises what `check_bench` and
    `run_processes` raise. `profile`: each rank's last warm-up step profiled into `profile/rank<N>/`
    (`profile_step`)."""
    from vlmctl.config.plan import nproc_per_node

    nproc = nproc_per_node(cfg.train)
    plan = check_bench(cfg, nproc, steps=steps, warmup=warmup, spec=spec, log=log)
    if show_plan is not None:
        show_plan(plan.run)
    return run_processes(cfg, plan, nproc, steps=steps, warmup=warmup, spec=spec, log=log, profile=profile)


def check_bench(cfg, nproc: int, *, steps: int, warmup: int, spec: WorkloadSpec, log=None) -> BenchPlan:
    """Everything a bench on `nproc` processes of this node checks before a process starts: one node, the optional
    packages the config needs, and `prepare` (flags, model, device, workload). Returns the plan. Raises UsageError
    for more than one node and what `prepare` raises, ConfigError for a missing optional package
    (`train.launch.check_packages`) and a sequence-parallel size that does not divide `nproc`
    (`distributed.mesh.check_sequence_split`) or tensor-parallel size that does not divide `nproc`."""
    from vlmctl.distributed.mesh import check_sequence_split
    from vlmctl.errors import UsageError
    from vlmctl.train.launch import check_packages

    if cfg.train.nnodes > 1:
        raise UsageError("vlmctl bench runs on one node", hint="set train.nnodes=1 (tokens/s per GPU carry over to more nodes only approximately)")
    check_packages(cfg.train)  # before any process starts (ConfigError)
    sp, tp = cfg.train.sequence_parallel, cfg.train.tensor_parallel
    check_sequence_split(nproc, sp, nproc)  # the mesh's own check: one node of `nproc` processes
    if nproc % tp:  # the ranks check the rest with the resolved strategy (`mesh.check_tensor_split`)
        raise UsageError(f"train.tensor_parallel={tp} does not divide the {nproc} processes",
                         hint=f"run a multiple of {tp} processes (--nproc-per-node), or lower train.tensor_parallel")
    return prepare(cfg.model, cfg.train, spec, steps=steps, warmup=warmup, dp_size=nproc // (sp * tp), log=log)


def run_processes(cfg, plan: BenchPlan, nproc: int, *, steps: int, warmup: int, spec: WorkloadSpec, log=print,
                  launch_one: bool = False, profile: Path | None = None) -> BenchResult:
    """Run a `check_bench`ed bench on `nproc` processes: in this process for one (unless `launch_one`), else
    through torchrun on this node (whatever `train.launcher` says, on a free port: a training run may hold
    `master_port`; with the ranks' environment of `vlmctl train`, `train.launch.launch_env`), rank 0 handing the
    figures back through a temporary folder. Raises VlmctlError when the ranks fail."""
    import json

    from vlmctl.config import dump_config
    from vlmctl.distributed.env import free_port
    from vlmctl.errors import VlmctlError
    from vlmctl.train.launch import clear_rank_env, launch_command, launch_env, spawn

    train = cfg.train
    if nproc == 1 and not launch_one:
        clear_rank_env()
        return run_bench(cfg.model, train, steps=steps, warmup=warmup, spec=spec, log=log, plan=plan, profile=profile)
    local = train.model_copy(update={"launcher": "torchrun", "master_addr": "127.0.0.1", "master_port": free_port(),
                                     "node_rank": 0, "nproc_per_node": nproc})
    with tempfile.TemporaryDirectory(prefix="vlmctl-bench-") as tmp:
        work = Path(tmp)
        (work / "config.yaml").write_text(dump_config(cfg.model_copy(update={"train": train.model_copy(update={"nproc_per_node": nproc})})))
        (work / "args.json").write_text(json.dumps({"steps": steps, "warmup": warmup, "image_sizes": list(spec.image_sizes),
                                                    "text_tokens": list(spec.text_tokens), "workload": spec.kind,
                                                    "images_per_sample": list(spec.images_per_sample),
                                                    "video_frames": spec.video_frames and list(spec.video_frames),
                                                    "video_sizes": list(spec.video_sizes), "verbose": log is not None,
                                                    "profile": str(Path(profile).resolve()) if profile else None}))
        # ranks have nothing to save: a stop signal that they cannot act on (blocked in CUDA) ends them after 10 s
        code, _ = spawn(launch_command(local, work, module="vlmctl.bench").command, env=launch_env(train), grace_s=10.0)
        result = work / "result.json"
        if code != 0 or not result.is_file():
            raise VlmctlError(f"the bench processes failed (exit code {code})", hint="see the rank output above")
        data = json.loads(result.read_text())
    data.pop("tokens_per_s_per_gpu", None)
    data.pop("rollouts_per_s_per_gpu", None)
    return BenchResult(**data)


# --------------------------------------------------------------------------------------------------------------------
# Scaling: the same bench at several process counts
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class ScalingResult:
    """The bench at each process count (`results`, fewest processes first). Every process runs the same per-process
    workload (its own packed rows of `train.tokens_per_batch`, or micro-batches of `train.micro_batch_size`), so a
    perfect scale-out keeps the tokens/s per GPU: `efficiency` is a count's tokens/s per GPU over the fewest
    processes' (1.0 there)."""

    results: list[BenchResult]

    @property
    def baseline(self) -> BenchResult:
        return self.results[0]

    def efficiency(self, result: BenchResult) -> float:
        """`result`'s tokens/s per GPU as a fraction of the baseline's (the fewest processes)."""
        return result.tokens_per_s_per_gpu / self.baseline.tokens_per_s_per_gpu

    def as_dict(self) -> dict[str, Any]:
        return {"baseline_processes": self.baseline.world_size,
                "rows": [{**r.as_dict(), "efficiency": self.efficiency(r)} for r in self.results]}


def parse_counts(text: str) -> tuple[int, ...]:
    """The process counts of `--scaling 1,2,4`, fewest first. Raises UsageError for an empty list, a word that is
    not an integer, a count below 1 or a count given twice."""
    from vlmctl.errors import UsageError

    hint = "e.g. --scaling 1,2,4 (process counts, one process per GPU)"
    words = [w.strip() for w in text.split(",")]
    try:
        counts = [int(w) for w in words]
    except ValueError:
        raise UsageError(f"--scaling {text!r} is not a comma-separated list of process counts", hint=hint) from None
    if not counts or any(n < 1 for n in counts):
        raise UsageError(f"--scaling {text!r}: every process count must be at least 1", hint=hint)
    twice = sorted({n for n in counts if counts.count(n) > 1})
    if twice:
        raise UsageError(f"--scaling {text!r} lists {', '.join(map(str, twice))} more than once", hint=hint)
    return tuple(sorted(counts))


def check_counts(counts: tuple[int, ...]) -> None:
    """Raise UsageError when a count is more than the visible GPUs (CPU processes are allowed where none is
    visible)."""
    from vlmctl.errors import UsageError

    gpus = visible_gpus()  # the run plan's count (`config.plan.visible_gpus`)
    if gpus and max(counts) > gpus:
        raise UsageError(f"--scaling {','.join(map(str, counts))}: {max(counts)} processes is more than the {gpus} visible GPU(s)",
                         hint=f"list counts of at most {gpus}, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")


def scaling(cfg, counts: str | tuple[int, ...], *, steps: int = 20, warmup: int = 3, spec: WorkloadSpec = WorkloadSpec(),
            log=print) -> ScalingResult:
    """`vlmctl bench --scaling 1,2,4`: the bench of `cfg` at each process count (`parse_counts`; one process per
    GPU, CPU processes where no GPU is visible), each from the config as given (an `auto` batch size or
    checkpointing is settled per count, as `vlmctl train` would on that many GPUs) and each through torchrun, one
    process included, so that every count runs in the ranks' environment (one CPU thread per rank on CPU: the
    threads of one process in this one would compete with the machine's other work). Every count is checked
    (`check_counts`, `check_bench`) before the first process starts. Returns the ScalingResult.

    Raises UsageError for a bad list, counts beyond the visible GPUs and what `check_bench` raises; VlmctlError
    when the ranks of a count fail."""
    say = log or (lambda msg: None)
    counts = parse_counts(counts) if isinstance(counts, str) else tuple(sorted(counts))
    check_counts(counts)
    plans = {n: check_bench(cfg, n, steps=steps, warmup=warmup, spec=spec, log=log if n == counts[0] else None)
             for n in counts}
    results = []
    for n in counts:
        say(f"scaling: {n} process{'es' * (n > 1)}")
        own = cfg.model_copy(update={"train": cfg.train.model_copy(deep=True)})  # a run settles auto values in place
        results.append(run_processes(own, plans[n], n, steps=steps, warmup=warmup, spec=spec, log=log, launch_one=True))
    return ScalingResult(results)


def main(argv: list[str] | None = None) -> None:
    """One rank of a multi-process bench: `python -m vlmctl.bench WORKDIR` (torchrun sets the rank). WORKDIR holds
    `config.yaml` and `args.json` (steps, warmup, image_sizes, text_tokens, workload, images_per_sample,
    video_frames, video_sizes); rank 0 writes `result.json`.
    A random-init model for QLoRA is saved under WORKDIR/model."""
    import json
    import os
    import sys

    from vlmctl.config import load_config
    from vlmctl.distributed.process import exit_on_stop_signals, report_error, tie_to_launcher
    from vlmctl.errors import VlmctlError

    tie_to_launcher()  # no rank outlives `vlmctl bench`
    exit_on_stop_signals()  # nothing to save: SIGTERM/SIGINT end a rank at once, quietly
    work = Path((sys.argv[1:] if argv is None else argv)[0])
    args = json.loads((work / "args.json").read_text())
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(work / "config.yaml")
        frames = args.get("video_frames")
        spec = WorkloadSpec(image_sizes=tuple(args["image_sizes"]), text_tokens=tuple(args["text_tokens"]),
                            kind=args.get("workload", "auto"), images_per_sample=tuple(args.get("images_per_sample", (1, 1))),
                            video_frames=tuple(frames) if frames else None,
                            video_sizes=tuple(args.get("video_sizes", WorkloadSpec.video_sizes)))
        result = run_bench(cfg.model, cfg.train, steps=args["steps"], warmup=args["warmup"], spec=spec, scratch=work,
                           profile=Path(args["profile"]) if args.get("profile") else None,
                           log=(lambda msg: print(msg, file=sys.stderr, flush=True)) if args.get("verbose", True) else (lambda msg: None))
    except VlmctlError as exc:
        sys.exit(report_error(exc))
    if rank == 0:
        tmp = work / "result.json.tmp"
        tmp.write_text(json.dumps(result.as_dict()))
        os.replace(tmp, work / "result.json")


if __name__ == "__main__":
    main()
