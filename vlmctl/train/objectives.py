"""Training objectives: what a batch must hold, the loss of one micro-batch, and the objective's own metrics.

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
  `distributed.parallelize.parallelize(..., trainable=False)` like the trained one.
- optional `prepare_window(engine, window, step)`: called first in each step with the window's collated
  micro-batches (the loader's, before any token count), it returns the micro-batches the step trains on, as many
  (GRPO: prompts in, packed rows of scored rollouts out).

Supervised fine-tuning (`SFTObjective`) is the next-token cross-entropy over the labelled (assistant) tokens. A
preference objective (DPO: the chosen and rejected segments of one packed row scored against a frozen reference
model's log-probabilities) or GRPO (rollouts and their advantages) is another class with its own batch keys,
models and metrics; the loop does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class Objective(Protocol):
    """A training objective (see the module docstring)."""

    name: str
    batch_keys: tuple[str, ...]
    models: dict[str, Any]

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
    """Summed next-token cross-entropy: logits [B, T, V], labels [B, T] (-100 = ignored) -> scalar (fp32)."""
    import torch.nn.functional as F

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


@dataclass
class DPOObjective:
    """Direct preference optimisation over packed rows of pairs (`data.collate.PairCollator`: each pair's chosen
    and rejected sequences are two consecutive varlen segments of one row); the formulas, loss types and their
    sources are in `vlmctl.train.dpo`.

    Each sequence's log-probability is the sum of its answer tokens' log-probs, from the labelled positions only
    (`kernels.token_losses`: the LM head's chunked cross-entropy, no [T, V] logits). The reference's are computed
    the same way without gradients, from `reference` (a frozen model wrapped by `parallelize(..., trainable=False)`)
    or, with `reference` None, from the trained model with its peft adapters switched off (`disable_adapter`, the
    LoRA base: no second copy of the weights). The loss over a micro-batch is the sum of its pairs' losses and the
    loop divides by the global batch's pairs (`label_tokens` counts pairs), so a step's loss is the mean over pairs,
    as TRL's `DPOTrainer` takes it. Metrics (TRL's names): rewards/chosen, rewards/rejected, rewards/margins (means of
    beta x log-ratio) and rewards/accuracies (share of pairs whose chosen reward is higher).

    With `precomputed` (sample id -> (chosen, rejected) reference log-probs, `precompute_reference`) the reference
    is read from it by the row's `pair_ids` and no reference forward runs.

    `settings`: the `train.dpo` section (`config.objective.DPOSection`: beta, loss_type, label_smoothing).
    Sequence parallelism is not supported (a pair's segments would be summed over ranks: not yet done)."""

    settings: Any
    reference: Any = None
    precomputed: dict[str, tuple[float, float]] | None = None
    name: str = "dpo"
    batch_keys: tuple[str, ...] = ("input_ids", "labels", "seq_lens", "num_pairs")
    models: dict[str, Any] = field(default_factory=dict)

    METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "nll_loss")

    def __post_init__(self):
        if self.reference is not None:
            self.models = {"reference": self.reference}

    def label_tokens(self, batch: dict[str, Any]) -> int:
        return batch["num_pairs"]

    def sequence_logps(self, model, inputs: dict[str, Any], batch: dict[str, Any]):
        """(sums float32 [S], counts int64 [S]): each packed segment's summed answer log-probs under `model`."""
        from vlmctl.train.dpo import segment_logps_at
        from vlmctl.train.kernels import token_losses

        losses, positions = token_losses(model, {**inputs, "labels": batch["labels"]})
        return segment_logps_at(-losses, positions, batch["seq_lens"])

    def reference_logps(self, engine, inputs: dict[str, Any], batch: dict[str, Any]):
        """`sequence_logps` under the reference, without gradients."""
        import torch

        if self.precomputed is not None:
            try:
                values = [v for pid in batch["pair_ids"] for v in self.precomputed[pid]]
            except KeyError as exc:
                raise VlmctlError(f"pair {exc.args[0]!r} has no precomputed reference log-probabilities",
                                  hint="the prepared data changed after they were computed: start a new run") from None
            return torch.tensor(values, dtype=torch.float32, device=batch["input_ids"].device), None
        with torch.no_grad():
            if "reference" in self.models:  # the frozen copy as the worker parallelized it
                return self.sequence_logps(self.models["reference"], inputs, batch)
            module = engine.module
            if not hasattr(module, "disable_adapter"):
                raise VlmctlError("the DPO reference is the model with its adapter switched off, but the trained model "
                                  "has no peft adapter", hint="set train.dpo.reference: frozen, or train with train.lora")
            with module.disable_adapter():
                return self.sequence_logps(engine.model, inputs, batch)

    def loss(self, engine, batch: dict[str, Any]) -> MicroLoss:
        import torch

        from vlmctl.train.dpo import dpo_loss, pair_segments

        pairs = batch["num_pairs"]
        inputs = engine.inputs(batch)
        sums, counts = self.sequence_logps(engine.model, inputs, batch)
        ref_sums, _ = self.reference_logps(engine, inputs, batch)
        if pairs == 0:  # a row of dummies only: keep every parameter in the graph, add nothing
            names = self.METRICS if getattr(self.settings, "rpo_alpha", 0.0) else self.METRICS[:-1]
            return MicroLoss(loss=sums.sum() * 0.0, tokens=0, metrics={k: 0.0 for k in names})
        chosen, rejected = pair_segments(sums, pairs)
        ref_chosen, ref_rejected = pair_segments(ref_sums, pairs)
        n_chosen, n_rejected = pair_segments(counts, pairs)
        out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=self.settings.beta,
                       loss_type=self.settings.loss_type, label_smoothing=self.settings.label_smoothing,
                       chosen_tokens=n_chosen, rejected_tokens=n_rejected)
        margins = out.chosen_rewards - out.rejected_rewards
        metrics = {"rewards/chosen": out.chosen_rewards.sum(), "rewards/rejected": out.rejected_rewards.sum(),
                   "rewards/margins": margins.sum(), "rewards/accuracies": (margins > 0).to(torch.float32).sum()}
        losses = out.losses
        alpha = getattr(self.settings, "rpo_alpha", 0.0)
        if alpha:  # RPO: the chosen answer's mean token NLL, per pair
            nll = -chosen / n_chosen.clamp(min=1).to(chosen.dtype)
            losses = losses + alpha * nll
            metrics["nll_loss"] = nll.detach().sum()
        return MicroLoss(loss=losses.sum(), tokens=pairs, metrics=metrics)

    def metrics(self, sums: dict[str, float], label_tokens: float) -> dict[str, float]:
        """Means over the step's pairs of the summed rewards, margins and accuracies."""
        return {key: sums[key] / label_tokens for key in self.METRICS if key in sums and label_tokens}
