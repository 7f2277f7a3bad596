"""Direct preference optimisation: the loss of a preference pair from sequence log-probabilities, and those
log-probabilities from packed rows.

    logps = token_logps(logits, batch["labels"])                        # [1, T], aligned with the labels
    sums, counts = segment_logps(logps, batch["labels"], batch["seq_lens"])   # [S], [S]: one per packed segment
    # or, without the logits: losses, positions = kernels.token_losses(model, batch)
    #                         sums, counts = segment_logps_at(-losses, positions, batch["seq_lens"])
    chosen, rejected = pair_segments(sums, num_pairs)                   # segments 2k (chosen) and 2k+1 (rejected)
    out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="sigmoid")
    out.loss.backward(); out.metrics   # rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies

The chosen and rejected sequence of one prompt are packed into the same row as two varlen segments (each the
prompt, its media, then the answer), chosen first; labels are -100 outside the answers, so a segment's log-prob is
the summed log-probability of its answer tokens given the prompt. The reference log-probs come from the same
computation on a frozen reference (or the adapter-disabled base), or are computed once before training.

Loss types (the margin is h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))):

- `sigmoid`: -log sigma(beta h) (DPO, Rafailov et al. 2023, arXiv 2305.18290, Eq. 7); with `label_smoothing` eps
  > 0 the conservative DPO of Mitchell 2023 ("A note on DPO with noisy preferences"): -(1 - eps) log sigma(beta h) -
  eps log sigma(-beta h), as TRL's `DPOTrainer` computed it before 1.0;
- `ipo`: (h_w / |y_w| - h_l / |y_l| - 1 / (2 beta))^2 (IPO, Azar et al. 2023, arXiv 2310.12036, Eq. 17) with each
  log-ratio divided by its answer's token count, TRL's length-normalised form (`DPOTrainer`, loss_type="ipo");
- `hinge`: max(0, 1 - beta h) (SLiC, Zhao et al. 2023, arXiv 2305.10425, as TRL's loss_type="hinge").

The loss is the mean over pairs. Rewards are beta x the log-ratios (detached), as TRL logs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from vlmctl.config.objective import DPOSection
from vlmctl.errors import VlmctlError
from vlmctl.train.objectives import MicroLoss, ObjectiveSpec, labelled_logps, token_logps

# The vlmctl modules that load the data pipeline or a model (collate, reference) are imported inside the functions
# that use them: the registry imports this module, and `vlmctl train`'s start-up must not pay for them.

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
IGNORE = -100


def segment_ids(seq_lens: Sequence[int], device: Any = None) -> torch.Tensor:
    """Segment index of every token of a packed row of segments of `seq_lens` tokens: int64 [sum(seq_lens)]."""
    lens = torch.as_tensor(list(seq_lens), dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)


def segment_logps(logps: torch.Tensor, labels: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities and label-token counts of each segment of one packed row.

    `logps`: per-token log-probs [1, T] aligned with the labels (`token_logps`), or logits [1, T, V] (then
    `token_logps` is applied); `labels`: [1, T] (-100 outside the answers; `pack_samples` sets each segment's first
    label to -100, so no token is scored across a segment boundary); `seq_lens`: the segments' lengths (the packed
    row's `seq_lens`, summing to T) or a segment id per token [T]. Returns (sums float32 [S], counts int64 [S]).
    Raises ValueError when the lengths do not cover the row.
    """
    if logps.dim() == 3:
        logps = token_logps(logps, labels)
    if logps.shape[0] != 1 or labels.shape != logps.shape:
        raise ValueError(f"segment_logps takes one packed row: logps {tuple(logps.shape)}, labels {tuple(labels.shape)}")
    if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1 and seq_lens.numel() == labels.shape[1]:
        seg = seq_lens.to(device=labels.device, dtype=torch.long)
    else:
        lens = [int(n) for n in seq_lens]
        if sum(lens) != labels.shape[1]:
            raise ValueError(f"segment lengths sum to {sum(lens)} tokens, the row has {labels.shape[1]}")
        seg = segment_ids(lens, labels.device)
    n = int(seg.max()) + 1 if seg.numel() else 0
    mask = labels[0] != IGNORE
    mask[0] = False  # nothing predicts the row's first token
    sums = torch.zeros(n, dtype=torch.float32, device=logps.device).index_add(0, seg, logps[0].float() * mask)
    counts = torch.zeros(n, dtype=torch.long, device=logps.device).index_add(0, seg, mask.long())
    return sums, counts


def segment_logps_at(logps: torch.Tensor, positions: torch.Tensor, seq_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`segment_logps` from the log-probs of the labelled tokens only: `logps` [n] at row positions `positions` [n]
    (e.g. minus the losses of `vlmctl.train.kernels.token_losses`, which never builds the [T, V] logits, and its
    positions); `seq_lens`: the packed row's segment lengths. Returns (sums float32 [S], counts int64 [S])."""
    seg = segment_ids(seq_lens, positions.device)[positions]
    n = len(list(seq_lens))
    sums = torch.zeros(n, dtype=torch.float32, device=logps.device).index_add(0, seg, logps.float())
    counts = torch.zeros(n, dtype=torch.long, device=logps.device).index_add(0, seg, torch.ones_like(seg))
    return sums, counts


def pair_segments(values: torch.Tensor, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) of a row whose first 2 x `num_pairs` segments are pairs, chosen first: segments 0, 2, 4...
    and 1, 3, 5... (segments after them, e.g. the collator's dummy-image row, are left out). Raises ValueError when
    the row has fewer segments."""
    if values.shape[0] < 2 * num_pairs:
        raise ValueError(f"{num_pairs} pairs need {2 * num_pairs} segments, the row has {values.shape[0]}")
    return values[0:2 * num_pairs:2], values[1:2 * num_pairs:2]


@dataclass
class DPOOutput:
    """`loss`: scalar (mean over pairs, with grad); `losses`: [P] per pair; `chosen_rewards` / `rejected_rewards`:
    [P] beta x log-ratio (detached); `metrics`: floats for the step line and trackers (TRL's names)."""

    loss: torch.Tensor
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def metrics(self) -> dict[str, float]:
        margins = self.chosen_rewards - self.rejected_rewards
        return {
            "rewards/chosen": float(self.chosen_rewards.mean()),
            "rewards/rejected": float(self.rejected_rewards.mean()),
            "rewards/margins": float(margins.mean()),
            "rewards/accuracies": float((self.chosen_rewards > self.rejected_rewards).float().mean()),
        }


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> DPOOutput:
    """The DPO-family loss of P pairs from their summed answer log-probs (each [P], nats) under the policy and the
    reference (see the module docstring for the formulas and sources).

    `chosen_tokens` / `rejected_tokens`: answer token counts [P], needed by `ipo` (clamped to >= 1).
    `label_smoothing` (`sigmoid` only): the assumed probability that a pair's labels are flipped, in [0, 0.5).
    Raises ValueError for an unknown loss type, a missing token count, or settings out of range.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies to the sigmoid loss, not {loss_type}")
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    margin = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    else:
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs the answers' token counts (chosen_tokens, rejected_tokens)")
        normalised = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (normalised - 1 / (2 * beta)) ** 2
    return DPOOutput(losses.mean(), losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def packed_dpo_loss(
    logits: torch.Tensor,
    ref: torch.Tensor,
    labels: torch.Tensor,
    seq_lens: Sequence[int],
    num_pairs: int,
    **settings: Any,
) -> DPOOutput:
    """`dpo_loss` of one packed row of `num_pairs` pairs (segments chosen, rejected, chosen, rejected, ...).

    `logits`: the policy's [1, T, V] (or its token log-probs [1, T]); `ref`: the reference's logits [1, T, V], token
    log-probs [1, T], or its precomputed per-segment sums [S] or per-pair [2, P] (chosen row, rejected row);
    `labels`, `seq_lens`: the packed row's; `settings`: `dpo_loss`'s keywords (beta, loss_type, label_smoothing).
    """
    sums, counts = segment_logps(logits, labels, seq_lens)
    chosen, rejected = pair_segments(sums, num_pairs)
    n_chosen, n_rejected = pair_segments(counts, num_pairs)
    if ref.dim() == 3 or tuple(ref.shape) == tuple(labels.shape):  # logits, or token log-probs of the same row
        ref_chosen, ref_rejected = pair_segments(segment_logps(ref, labels, seq_lens)[0], num_pairs)
    elif ref.dim() == 2:  # per pair: [chosen row, rejected row]
        ref_chosen, ref_rejected = ref[0], ref[1]
    else:  # per segment
        ref_chosen, ref_rejected = pair_segments(ref, num_pairs)
    return dpo_loss(chosen, rejected, ref_chosen.detach(), ref_rejected.detach(), chosen_tokens=n_chosen,
                    rejected_tokens=n_rejected, **settings)


# ----------------------------------------------------------------------------------------------------- objective


@dataclass
class DPOObjective:
    """Direct preference optimisation over pairs: each pair's chosen and rejected sequences are two consecutive
    varlen segments of one packed row (`data.collate.PairCollator`) or two consecutive rows of a padded micro-batch
    (`data.collate.PaddedPairCollator`); the formulas, loss types and their sources are in the module docstring.

    Each sequence's log-probability is the sum of its answer tokens' log-probs, from the labelled positions only
    (`objectives.labelled_logps`: packed rows through the LM head's chunked cross-entropy, no [T, V] logits). The
    reference's are computed the same way without gradients, from `reference` (a frozen model wrapped by
    `parallelize(..., trainable=False)`) or, with `reference` None, from the trained model with its peft adapters
    switched off (`disable_adapter`, the LoRA base: no second copy of the weights). The loss over a micro-batch is
    the sum of its pairs' losses and the loop divides by the global batch's pairs (`label_tokens` counts pairs), so
    a step's loss is the mean over pairs, as TRL's `DPOTrainer` takes it. Metrics (TRL's names): rewards/chosen,
    rewards/rejected, rewards/margins (means of beta x log-ratio) and rewards/accuracies (share of pairs whose chosen
    reward is higher); nll_loss with `rpo_alpha`.

    With `precomputed` (sample id -> (chosen, rejected) reference log-probs, `train.reference.precompute_reference`,
    the `before_training` hook) the reference is read from it by the row's `pair_ids` and no reference forward runs.

    `settings`: the `train.dpo` section (`config.objective.DPOSection`: beta, loss_type, label_smoothing, rpo_alpha,
    reference). Sequence parallelism is refused by the section (a pair's segments would be summed over ranks)."""

    settings: Any
    reference: Any = None
    precomputed: dict[str, tuple[float, float]] | None = None
    name: str = "dpo"
    batch_keys: tuple[str, ...] = ("input_ids", "labels", "num_pairs")
    models: dict[str, Any] = field(default_factory=dict)

    METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "nll_loss")

    def __post_init__(self):
        if self.reference is not None:
            self.models = {"reference": self.reference}

    def label_tokens(self, batch: dict[str, Any]) -> int:
        return batch["num_pairs"]

    def sequence_logps(self, model, inputs: dict[str, Any], batch: dict[str, Any]):
        """(sums float32 [S], counts int64 [S]): each sequence's (packed segment's or padded row's) summed answer
        log-probs under `model`."""
        values, positions, seq_lens = labelled_logps(model, inputs, batch)
        return segment_logps_at(values, positions, seq_lens)

    def reference_logps(self, engine, inputs: dict[str, Any], batch: dict[str, Any]):
        """`sequence_logps` under the reference, without gradients."""
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
        pairs = batch["num_pairs"]
        inputs = engine.inputs(batch)
        sums, counts = self.sequence_logps(engine.model, inputs, batch)
        ref_sums, _ = self.reference_logps(engine, inputs, batch)
        alpha = self.settings.rpo_alpha
        if pairs == 0:  # a row of dummies only: keep every parameter in the graph, add nothing
            names = self.METRICS if alpha else self.METRICS[:-1]
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
        if alpha:  # RPO: the chosen answer's mean token NLL, per pair
            nll = -chosen / n_chosen.clamp(min=1).to(chosen.dtype)
            losses = losses + alpha * nll
            metrics["nll_loss"] = nll.detach().sum()
        return MicroLoss(loss=losses.sum(), tokens=pairs, metrics=metrics)

    def metrics(self, sums: dict[str, float], label_tokens: float) -> dict[str, float]:
        """Means over the step's pairs of the summed rewards, margins and accuracies."""
        return {key: sums[key] / label_tokens for key in self.METRICS if key in sums and label_tokens}

    # ---- the before_training hook: `train.dpo.reference: precomputed`

    def stand_in_for_probe(self) -> None:
        """Placeholder reference log-probs while the start-up probe measures a precomputed-reference run."""
        if self.settings.reference == "precomputed":
            from vlmctl.train.reference import probe_stand_ins

            probe_stand_ins(self)

    def before_training(self, cfg, ctx, tm, engine, dataset, collate, run_dir, resume_from) -> None:
        """`train.dpo.reference: precomputed`: the reference log-probs of every pair, scored once by the starting
        weights (`reference.reference_pass`), or read back on resume."""
        if self.settings.reference == "precomputed":
            from vlmctl.train.reference import reference_pass

            reference_pass(cfg, ctx, tm, engine, self, dataset, collate, run_dir, resume_from)


def build_dpo(tm, train, ctx, cfg=None, run_dir=None, reference_model=None) -> DPOObjective:
    """DPO of a run against `train.dpo.reference`: a frozen copy (`reference_model`, else loaded from `cfg`, the
    project config: `reference.load_reference`), the LoRA base, or precomputed log-probs (`before_training`).
    Raises VlmctlError when a frozen copy must be loaded and `cfg` is None."""
    reference = reference_model
    if train.dpo.reference == "frozen" and reference is None:
        from vlmctl.train.reference import load_reference

        if cfg is None:
            raise VlmctlError("the dpo objective's frozen reference needs the project config (its model source)")
        reference = load_reference(cfg, train, ctx)
    return DPOObjective(settings=train.dpo, reference=reference)


def pair_collator(processor, family, *, packed: bool, tokens_per_batch: int | None = None,
                  max_length: int | None = None, grouped: bool = False):
    """Pairs -> packed rows of pairs (`PairCollator`) or padded micro-batches of pairs (`PaddedPairCollator`)."""
    from vlmctl.data.collate import PaddedPairCollator, PairCollator

    if packed:
        return PairCollator(processor, family, max_length=max_length, tokens_per_batch=tokens_per_batch, grouped=grouped)
    return PaddedPairCollator(processor, family, max_length=max_length, grouped=grouped)


def frozen_reference(section) -> Callable[[Any], tuple[str, ...]]:
    """`ObjectiveSpec.frozen` of a preference objective whose `train.<key>` section names a reference: a frozen
    copy is held when it is "frozen"."""
    return lambda train: ("reference",) if getattr(train, section).reference == "frozen" else ()


PAIR_STEP_LINE = (("rewards/margins", "margin {:.3f}"), ("rewards/accuracies", "acc {:.2f}"),
                  ("rewards/chosen", "chosen {:+.3f}"), ("rewards/rejected", "rejected {:+.3f}"))
"""The step line's pair metrics (TRL's names): margin, accuracy, chosen and rejected rewards."""

SPEC = DPOObjective.spec = ObjectiveSpec(
    name="dpo", objective=DPOObjective, build=build_dpo, collator=pair_collator, data="preference", workload="pairs",
    frozen=frozen_reference("dpo"), hooks=frozenset({"before_training"}), section=DPOSection,
    step_line=(*PAIR_STEP_LINE, ("nll_loss", "nll {:.3f}")),
    curves=("rewards/margins", "rewards/accuracies", ("rewards/chosen", "rewards/rejected")))
