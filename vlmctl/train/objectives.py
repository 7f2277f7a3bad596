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
