"""Training objectives: what a batch must hold, the loss of one micro-batch, the objective's own metrics, and the
spec that tells every other module what an objective needs.

The step loop (`train.loop.Trainer`) knows an objective only through the `Objective` protocol:

- `batch_keys`: the keys every collated micro-batch must hold (`check_batch` raises a DataError naming the missing
  ones);
- `label_tokens(batch)`: the tokens the micro-batch's loss is summed over; the loop sums them over the whole global
  batch first and scales each micro-batch's summed loss by `dp_size x sp / global tokens` before backward, so the
  step's loss is a mean over the global batch's tokens whatever the split over ranks and micro-batches;
- `loss(engine, batch)` -> `MicroLoss`: the summed loss (fp32 scalar tensor) and token count of one micro-batch,
  computed through `engine.model` (the root module, wrapper included, so its hooks run) with `engine.inputs(batch)`
  (the model inputs as the engine feeds them); the engine calls it under its precision context
  (`distributed.engine.Engine.forward`). `metrics` holds extra summed values (tensors or floats) the loop sums over
  the window and the data-parallel ranks;
- `metrics(sums, label_tokens)`: the logged form of those sums for one step (the loop adds them to its rows);
- `models`: frozen models the objective holds (a reference model), which the worker passes through
  `distributed.parallelize.parallelize(..., trainable=False)` like the trained one;
- `spec`: its `ObjectiveSpec`, whose `hooks` declare the optional methods it has (`HOOKS`): the loop, the worker
  and the checkpoints call a hook only where it is declared (`has_hook`), never by looking the method up.

An objective is one module (this one for SFT; the others are listed in `registry.BUILT_IN`) that defines its class
and its `SPEC`, and one entry in `vlmctl.train.registry`: the registry answers what the data pipeline, the worker, the launcher, `vlmctl
bench`, the autotune probe, the step line and loss.png ask of it (`ObjectiveSpec`). Its settings are a section of
the train config (`vlmctl.config.objective`), which also refuses the settings it cannot train with, when the
config is read (before any process starts).

Supervised fine-tuning (`SFTObjective`) is the next-token cross-entropy over the labelled (assistant) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

from vlmctl.data.collate import IGNORE_INDEX, is_packed, model_inputs
from vlmctl.errors import DataError, VlmctlError

# torch, DeepSpeed and the modules built on them are imported inside the functions that use them: importing
# vlmctl (the CLI's start-up) must not pay for them.


@dataclass
class MicroLoss:
    """One micro-batch's summed loss (fp32 scalar tensor, nats), the tokens it is summed over, and extra summed
    metrics (name -> tensor or float) for `Objective.metrics`."""

    loss: Any
    tokens: int
    metrics: dict[str, Any] = field(default_factory=dict)


HOOKS = {
    "prepare_window": ("prepare_window",),
    "reuses_window": ("reuses_window",),
    "state": ("state_dict", "load_state_dict"),
    "before_training": ("stand_in_for_probe", "before_training"),
}
"""The optional capabilities an objective may declare (`ObjectiveSpec.hooks`) and the methods each one brings:

- `prepare_window(engine, window, step)`: called first in each step with the window's collated micro-batches (the
  loader's, before any token count), it returns the micro-batches the step trains on (GRPO: prompts in, rows of
  scored rollouts out); `window` None on a step `reuses_window` claims;
- `reuses_window(step)`: whether `step` trains again on the rows `prepare_window` kept, drawing no new batches;
- `state_dict()` / `load_state_dict(state)`: per-rank state a checkpoint keeps (objective-<rank>.pt);
- `stand_in_for_probe()` and `before_training(cfg, ctx, tm, engine, dataset, collate, run_dir, resume_from)`: work
  on the wrapped model before the first step (DPO's precomputed reference log-probs), with placeholders while the
  start-up probe runs before it."""


@dataclass(frozen=True)
class ObjectiveSpec:
    """Everything the modules outside an objective ask of it, declared once (`vlmctl.train.registry`).

    `name`: the `train.objective` value; `objective`: its class (`Objective`); `build(tm, train, ctx, cfg=None,
    run_dir=None, reference_model=None)`: the objective of a run (`train`: the resolved train section; `cfg`: the
    project config, for objectives that load a model or read data settings; `reference_model`: a frozen model to use
    instead of loading one), its frozen models not yet parallelized; `collator(processor, family, *, packed,
    tokens_per_batch, max_length, grouped)`: the training collator, packed rows of `tokens_per_batch` tokens or
    padded micro-batches; `probe_collator`: the same for the start-up probe's rows (default `collator`).
    `data`: what the training shards hold, "conversations" or "preference" (pairs: `launch.preflight` and
    `train.data.load_data` refuse shards without rejected answers); `packs_samples`: the sampler packs samples into
    rows when `train.packing` is on (False: it deals `micro_batch_size` samples, which the objective turns into rows
    itself, as GRPO's prompts); `workload`: what `vlmctl bench` synthesizes ("samples", "pairs", "prompts");
    `frozen(train) -> tuple[str, ...]`: the frozen models a run of `train` holds (("reference",) or ());
    `hooks`: the declared capabilities (`HOOKS`); `section`: its config section class (`train.<name>`, whose
    `refuse(train)` is the objective's constraint on the rest of the train section; None without one).
    What the run shows: `step_line` ((metrics key, `str.format` template) of the step line), `curves` (metrics drawn on
    loss.png beside the loss, one panel each; a tuple of metrics shares a panel), `plots_loss` (False where the loss
    says nothing of progress: GRPO's is ~0 by construction); `named_by_stage`: run folders are named `<project>-<stage>-<time>` (else `<project>-<name>-<time>`);
    `describe(train) -> str`: its settings in words for `vlmctl bench`'s settings line ("" for none);
    `fused_loss`: its loss comes from the model's forward given labels, which is liger-kernel's fused linear
    cross-entropy where liger is on (SFT), so training compiles that kernel before the first step
    (`kernels.warm_fused_loss`); objectives that compute token log-probs themselves (`kernels.token_losses`) leave it;
    `preflight(cfg)`: checks the launcher runs before any process starts (GRPO imports the user's reward
    functions), raising typed errors; `bench_settings(train) -> (train, note)`: the settings `vlmctl bench` trains
    its synthetic data with, and a line saying what changed (None when nothing did)."""

    name: str
    objective: type
    build: Callable[..., Any]
    collator: Callable[..., Any]
    probe_collator: Callable[..., Any] | None = None
    data: str = "conversations"
    packs_samples: bool = True
    workload: str = "samples"
    frozen: Callable[[Any], tuple[str, ...]] = lambda train: ()
    hooks: frozenset[str] = frozenset()
    section: type | None = None
    step_line: tuple[tuple[str, str], ...] = ()
    curves: tuple[str | tuple[str, ...], ...] = ()
    plots_loss: bool = True
    named_by_stage: bool = False
    describe: Callable[[Any], str] = lambda train: ""
    fused_loss: bool = False
    preflight: Callable[[Any], None] | None = None
    bench_settings: Callable[[Any], tuple[Any, str | None]] | None = None

    def run_word(self, train) -> str:
        """The word of a default run folder name after the project's: the stage, or the objective's name."""
        return train.stage if self.named_by_stage else self.name

    def collate(self, processor, family, *, packed: bool, tokens_per_batch: int | None = None,
                max_length: int | None = None, grouped: bool = False, probe: bool = False):
        """The collator of `collator` (`probe`: `probe_collator`) with these settings."""
        make = self.probe_collator if probe and self.probe_collator is not None else self.collator
        return make(processor, family, packed=packed, tokens_per_batch=tokens_per_batch, max_length=max_length,
                    grouped=grouped)


def has_hook(objective, hook: str) -> bool:
    """Whether `objective` (an Objective, or None) declares the capability `hook` (`HOOKS`) in its spec."""
    return objective is not None and hook in objective.spec.hooks


@runtime_checkable
class Objective(Protocol):
    """A training objective (see the module docstring)."""

    name: str
    batch_keys: tuple[str, ...]
    models: dict[str, Any]
    spec: ClassVar[ObjectiveSpec]

    def label_tokens(self, batch: dict[str, Any]) -> int: ...

    def loss(self, engine, batch: dict[str, Any]) -> MicroLoss: ...

    def metrics(self, sums: dict[str, float], label_tokens: float) -> dict[str, float]: ...


def check_batch(objective: Objective, batch: dict[str, Any]) -> None:
    """Raise DataError when `batch` lacks a key `objective` reads."""
    missing = [key for key in objective.batch_keys if key not in batch]
    if missing:
        raise DataError(f"the {objective.name} objective needs batches with {', '.join(missing)}; the collated batch "
                        f"holds {', '.join(sorted(batch))}",
                        hint="prepare the data for this objective (`vlmctl data prepare`) or pick the objective the data was prepared for")


def token_loss_sum(logits, labels):
    """Summed next-token cross-entropy: logits [B, T, V], labels [B, T] (-100 = ignored) -> scalar (fp32). Logits
    split over the vocabulary (tensor parallelism) are reduced without gathering them."""
    import torch.nn.functional as F

    from vlmctl.distributed.tensor_parallel import is_vocab_parallel, vocab_parallel_cross_entropy

    if is_vocab_parallel(logits):
        return vocab_parallel_cross_entropy(logits[:, :-1, :], labels[:, 1:].to(logits.device)).sum()

    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    return F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def loss_sum(model, batch: dict[str, Any], *, liger: bool = False, inputs: dict[str, Any] | None = None, shard=None):
    """Summed next-token cross-entropy (fp32 scalar, nats) over the labelled tokens of one micro-batch.

    `model` is the root module (DDP/FSDP2/DeepSpeed wrapper included, so its hooks run); `inputs` overrides the
    model inputs taken from `batch` (e.g. cast pixel values). Without liger: for packed rows the labelled positions'
    loss in chunks of logits (`kernels.token_losses`), else the padded batch's full logits. With `liger` the model
    was patched by `kernels.apply_liger`: given labels, its forward returns the fused linear cross-entropy, summed
    because `num_items_in_batch=1` (transformers' and liger's convention: sum / num_items_in_batch). With a
    sequence-parallel `shard` the loss is this rank's part of the row's: liger's fused loss given the next-token
    labels of the rank's slice (`sequence.local_shift_labels`), else `kernels.token_losses` over the slice.
    Raises VlmctlError where the patched forward returns no loss (a liger version without `shift_labels`).
    """
    from vlmctl.train.kernels import token_losses

    inputs = model_inputs(batch) if inputs is None else inputs
    if shard is not None and liger:
        from vlmctl.distributed.sequence import local_shift_labels

        out = model(**inputs, shift_labels=local_shift_labels(batch["labels"], shard), num_items_in_batch=1, use_cache=False)
        if out.loss is None:
            raise VlmctlError("liger-kernel's forward for this family takes no shift_labels, which sequence parallelism needs",
                              hint="upgrade liger-kernel (pip install -U liger-kernel), or set train.liger=off")
        return out.loss.float()
    if shard is not None:
        losses, _ = token_losses(model, {**inputs, "labels": batch["labels"], "use_cache": False}, shard=shard)
        return losses.sum()
    if liger:
        return model(**inputs, labels=batch["labels"], num_items_in_batch=1, use_cache=False).loss.float()
    if is_packed(batch):
        losses, _ = token_losses(model, {**inputs, "labels": batch["labels"], "use_cache": False})
        return losses.sum()
    out = model(**inputs, use_cache=False)
    return token_loss_sum(out.logits, batch["labels"])


@dataclass
class SFTObjective:
    """Supervised fine-tuning: next-token cross-entropy over the labelled (assistant) tokens (`loss_sum`).

    `liger`: the model's forward was patched with liger-kernel's fused loss (`setup.apply_kernels`); `shard`: this
    rank's `distributed.sequence.SequenceShard` under sequence parallelism (None without)."""

    liger: bool = False
    shard: Any = None
    name: str = "sft"
    batch_keys: tuple[str, ...] = ("input_ids", "labels", "num_label_tokens")
    models: dict[str, Any] = field(default_factory=dict)

    def label_tokens(self, batch: dict[str, Any]) -> int:
        return batch["num_label_tokens"]

    def loss(self, engine, batch: dict[str, Any]) -> MicroLoss:
        loss = loss_sum(engine.model, batch, liger=self.liger, inputs=engine.inputs(batch), shard=self.shard)
        return MicroLoss(loss=loss, tokens=batch["num_label_tokens"])

    def metrics(self, sums: dict[str, float], label_tokens: float) -> dict[str, float]:
        """None beyond the loop's own loss."""
        return {}


def token_logps(logits, labels, *, temperature: float = 1.0):
    """Per-token log-probabilities of the labels, aligned with them: out[b, t] = log softmax(logits[b, t - 1] /
    temperature)[labels[b, t]], and 0 where labels[b, t] is -100 and at t = 0 (nothing predicts it).

    `logits`: [B, T, V] (any float dtype; computed in float32); `labels`: [B, T] int64, unshifted (the model's own
    labels: label t is the token at t). Returns float32 [B, T]. Raises ValueError when the shapes disagree.
    """
    import torch

    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, T]")
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    scaled = logits[:, :-1].float() / temperature
    picked = scaled.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    out = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    out[:, 1:] = picked * mask
    return out


def labelled_logps(model, inputs: dict[str, Any], batch: dict[str, Any]):
    """The log-probs of a micro-batch's labelled tokens under `model`: (values float32 [n], positions int64 [n],
    segment lengths). A packed row ([1, T], `is_packed`): the LM head's chunked cross-entropy at the labelled positions
    (`kernels.token_losses`, no [T, V] logits) and the row's `seq_lens`. A padded batch ([B, T]): the full logits'
    `token_logps`, the positions counted over the flattened batch and each row one segment of T tokens (TRL's
    padded layout). Either way segment s's tokens are those `dpo.segment_logps_at` and `grpo.unpack_segments` group
    under s."""
    import torch

    from vlmctl.train.kernels import token_losses

    if is_packed(batch):
        losses, positions = token_losses(model, {**inputs, "labels": batch["labels"]})
        return -losses, positions, batch["seq_lens"]
    labels = batch["labels"]
    logps = token_logps(model(**inputs, use_cache=False).logits, labels)  # [B, T], 0 off the labels
    mask = labels != IGNORE_INDEX
    mask[:, 0] = False  # nothing predicts a row's first token
    positions = torch.nonzero(mask.reshape(-1), as_tuple=False).squeeze(1)
    return logps.reshape(-1)[positions], positions, [labels.shape[1]] * labels.shape[0]


def build_sft(tm, train, ctx, cfg=None, run_dir=None, reference_model=None) -> SFTObjective:
    """SFT of a run: liger's fused loss where the model was patched, this rank's slice under sequence parallelism."""
    from vlmctl.distributed.parallelize import sequence_shard

    return SFTObjective(liger=tm.liger, shard=sequence_shard(ctx.dims))


def sample_collator(processor, family, *, packed: bool, tokens_per_batch: int | None = None,
                    max_length: int | None = None, grouped: bool = False):
    """Samples -> packed rows of `tokens_per_batch` tokens (`PackedCollator`) or padded micro-batches (`Collator`)."""
    from vlmctl.data.collate import Collator, PackedCollator

    if packed:
        return PackedCollator(processor, family, max_length=max_length, tokens_per_batch=tokens_per_batch, grouped=grouped)
    return Collator(processor, family, max_length=max_length, grouped=grouped)


SPEC = SFTObjective.spec = ObjectiveSpec(name="sft", objective=SFTObjective, build=build_sft, collator=sample_collator,
                                         named_by_stage=True, fused_loss=True)
