"""Validation during training (`train.eval_steps`), the best checkpoint (`train.save_best`) and early stopping
(`train.early_stopping_patience`).

The validation loss is the training loss's definition on the prepared val split (`data.prepared_dir/val`): summed
next-token cross-entropy over the assistant tokens of every val sample (the run's objective through its engine's
forward, `Engine.forward`: FSDP2, DeepSpeed, sequence parallelism and LoRA as in training) divided by their label tokens, both
summed over the data-parallel group (a sequence-parallel group's slices summed first), so the figure does not
depend on the number of ranks. The val samples are batched as training batches them (packed rows of
`tokens_per_batch x sequence_parallel` tokens, or padded micro-batches of `micro_batch_size`) by the training
collator, in a fixed order, and dealt round-robin to the data-parallel ranks; a rank with one micro-batch fewer
runs a copy of one of its own (or the first) again and does not count it, so every rank makes the same forward
passes (FSDP2 and ZeRO-3 gather weights collectively inside them). Val samples longer than the packed row are left
out, as training leaves them out. No gradient is computed; dropout is off while validating.

Best and patience (`Best`): the metric (`val_loss`, lower is better) of each evaluation is compared with the best
so far; an improvement of the best resets the count of evaluations without one, and after
`early_stopping_patience` evaluations without one the run stops (and exports, as a finished run does). The best
so far is recorded in every checkpoint's trainer_state.json (`best`), so a resumed run continues from it, and the
checkpoint of the best step is kept past `train.save_total_limit` (`checkpoint.prune`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# So are the vlmctl modules that load numpy when imported.
# rich is imported inside the functions that print: using vlmctl as a library does not load it.
# Light vlmctl modules are imported next to their use as well.

METRICS = {"val_loss": "min"}
"""The metrics `train.save_best` can name, with whether lower (min) or higher (max) is better."""


@dataclass
class Best:
    """The best value of `metric` so far, its step, and evaluations since (recorded in trainer_state.json);
    `save_best`: the best step has a checkpoint, kept past save_total_limit."""

    metric: str = "val_loss"
    value: float | None = None
    step: int | None = None
    evals_since: int = 0
    save_best: bool = False

    @classmethod
    def from_state(cls, saved: dict[str, Any] | None, metric: str, save_best: bool) -> "Best":
        """The `best` entry of a trainer_state.json (a fresh one when absent or of another metric)."""
        if not saved or saved.get("metric") != metric:
            return cls(metric=metric, save_best=save_best)
        return cls(metric=metric, value=saved.get("value"), step=saved.get("step"),
                   evals_since=int(saved.get("evals_since", 0)), save_best=save_best)

    def update(self, value: float, step: int) -> bool:
        """Take the metric `value` of `step`; returns whether it is a new best (NaN never is)."""
        better = math.isfinite(value) and (self.value is None or
                                           (value < self.value if METRICS[self.metric] == "min" else value > self.value))
        if better:
            self.value, self.step, self.evals_since = value, step, 0
        else:
            self.evals_since += 1
        return better

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def val_batches(lengths, *, packing: bool, budget: int, micro_batch_size: int, dp_size: int, dp_rank: int):
    """This data-parallel rank's val micro-batches: [(sample indices, counted)], the same count on every rank.

    `lengths`: tokens per val sample [N]. Packed: first-fit-decreasing bins of at most `budget` tokens over the
    samples in index order (longer samples left out); padded: consecutive groups of `micro_batch_size`. Batch g
    goes to rank g % dp_size; a rank short of one repeats its first batch (or the first batch), not counted.
    """
    from vlmctl.data.packing import first_fit_decreasing

    if packing:
        items = ((i, int(n)) for i, n in enumerate(lengths) if n <= budget)
        batches = [list(b) for b in first_fit_decreasing(items, budget)]
    else:
        batches = [list(range(s, min(s + micro_batch_size, len(lengths)))) for s in range(0, len(lengths), micro_batch_size)]
    if not batches:
        return []
    mine = [(b, True) for b in batches[dp_rank::dp_size]]
    rounds = -(-len(batches) // dp_size)
    filler = mine[0][0] if mine else batches[0]
    return mine + [(filler, False)] * (rounds - len(mine))


@dataclass
class Validator:
    """Runs the validation of a `loop.Trainer` (`evaluate`) and keeps its `Best`.

    `engine`, `objective`: the loop's (`Engine.forward(objective, batch)` is the training forward and loss); `batches`: this
    rank's `val_batches`; `load(indices)` -> a collated, prepared CPU micro-batch; `dp_group`/`sp_group` as in the
    loop. `save_best`: whether the best step gets a checkpoint; `patience`: evaluations without a new best before
    the run stops (None = never).
    """

    engine: Any
    objective: Any
    batches: list
    load: Any
    device: Any
    eval_steps: int
    best: Best
    save_best: bool = False
    patience: int | None = None
    dp_group: Any = None
    sp_group: Any = None
    stopping: bool = False  # the last evaluation ran out of patience
    checkpoint_reason: str | None = None  # the last evaluation asks for a checkpoint ("best", "early_stop")

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.eval_steps == 0 or step == total_steps

    def loss(self) -> tuple[float, int, dict[str, float]]:
        """(mean validation loss in nats per label token, label tokens, the objective's metrics of the val split:
        `Objective.metrics` of its summed extra metrics, e.g. DPO's rewards) over every rank; every rank calls
        this."""
        import torch
        import torch.distributed as dist

        from vlmctl.train.loop import to_device

        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0.0
        extra: dict[str, float] = {}  # every rank holds the same names: each runs the objective on a batch
        model = self.engine.model
        model.eval()
        try:
            with torch.no_grad():
                for indices, counted in self.batches:
                    batch = self.load(indices)
                    out = self.engine.forward(self.objective, to_device(batch, self.device))
                    for name, value in out.metrics.items():
                        extra[name] = extra.get(name, 0.0) + (float(value) if counted else 0.0)
                    if counted:
                        total += out.loss.detach().double()
                        tokens += float(self.objective.label_tokens(batch))
        finally:
            model.train()
        if self.sp_group is not None:  # each sequence rank holds part of its row's loss
            dist.all_reduce(total, group=self.sp_group)
        names = sorted(extra)
        sums = torch.tensor([float(total), tokens, *(extra[n] for n in names)], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=self.dp_group)
        label_tokens = float(sums[1])
        metrics = self.objective.metrics({n: float(sums[2 + i]) for i, n in enumerate(names)}, label_tokens)
        return float(sums[0]) / max(label_tokens, 1.0), int(label_tokens), metrics

    def evaluate(self, step: int) -> dict[str, Any]:
        """Validate at `step` and update the best: the metrics row's fields (`val_loss`, `val_label_tokens`,
        `best_val_loss`, `best_step`, and the objective's metrics as `val_<name>`, e.g. `val_rewards/margins`);
        `checkpoint_reason` and `stopping` then tell the loop what to do."""
        value, tokens, metrics = self.loss()
        improved = self.best.update(value, step)
        self.stopping = self.patience is not None and self.best.evals_since >= self.patience
        self.checkpoint_reason = "early_stop" if self.stopping else ("best" if improved and self.save_best else None)
        return {"val_loss": value, "val_label_tokens": tokens, **{f"val_{k}": v for k, v in metrics.items()},
                "best_val_loss": self.best.value, "best_step": self.best.step}

    def stop_message(self) -> str:
        best = "none" if self.best.value is None else f"{self.best.value:.4f} at step {self.best.step}"
        return (f"early stopping: no better {self.best.metric} in {self.patience} evaluations "
                f"(train.early_stopping_patience); the best was {best}")


def build_validator(cfg, ctx, tm, engine, objective, saved_best: dict[str, Any] | None):
    """The run's `Validator` (None without `train.eval_steps`): the val split's shards and token counts, this
    rank's `val_batches`, the training collator and batch hook, and the best so far from `saved_best` (a resumed
    checkpoint's `best`). Raises DataError when the val split has no shards or no sample that fits a row."""
    from vlmctl.config.plan import row_tokens
    from vlmctl.data.loader import ShardDataset
    from vlmctl.train.data import build_collator

    train = cfg.train
    if not train.eval_steps:
        return None
    dataset = ShardDataset.from_dir(Path(cfg.data.prepared_dir) / "val")
    lengths = dataset.lengths
    if train.packing and not dataset.exact_lengths:
        lengths = dataset.count_tokens(tm.processor, tm.family.name)
    if cfg.data.max_length:
        lengths = lengths.clip(max=cfg.data.max_length)  # encode_sample truncates text beyond max_length
    budget = row_tokens(train) if train.packing else 0  # the run's row: tokens_per_batch x sequence_parallel
    batches = val_batches(lengths, packing=train.packing, budget=budget,
                          micro_batch_size=train.micro_batch_size, dp_size=ctx.dims.dp_size, dp_rank=ctx.dims.dp_rank)
    if not batches:
        from vlmctl.errors import DataError

        raise DataError(f"train.eval_steps: no val sample fits a packed row of {budget} tokens",
                        hint="raise train.tokens_per_batch, or re-run `vlmctl data prepare` with data.max_length at most that")
    collate = build_collator(cfg, ctx, tm)

    def load(indices):
        batch = collate([dataset[i] for i in indices])
        return tm.prepare(batch) if tm.prepare is not None else batch

    metric = train.save_best or "val_loss"
    return Validator(engine=engine, objective=objective, batches=batches, load=load, device=ctx.env.device, eval_steps=train.eval_steps,
                     best=Best.from_state(saved_best, metric, train.save_best is not None), save_best=train.save_best is not None,
                     patience=train.early_stopping_patience, dp_group=ctx.dims.dp_group, sp_group=ctx.dims.sp_group)


def name_best(run_dir: Path, validator, notify) -> None:
    """After the export: write `final/best_checkpoint.json` ({metric, value, step, checkpoint: the checkpoint's
    folder relative to the run folder, so the run can be moved or copied}) and say which checkpoint holds the best
    step (rank 0; nothing without `train.save_best` or before a first evaluation)."""
    if validator is None or not validator.save_best or validator.best.step is None:
        return
    from vlmctl.train.checkpoint import checkpoints_dir

    best = validator.best
    checkpoint = checkpoints_dir(run_dir) / f"checkpoint-{best.step}"
    final = Path(run_dir) / "final"
    if final.is_dir() and int(os.environ.get("RANK", "0")) == 0:
        record = {"metric": best.metric, "value": best.value, "step": best.step,
                  "checkpoint": checkpoint.relative_to(run_dir).as_posix()}
        tmp = final / ".best_checkpoint.json.tmp"
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, final / "best_checkpoint.json")
    from rich.markup import escape

    notify(escape(f"best checkpoint: {checkpoint} ({best.metric} {best.value:.4f} at step {best.step}); "
                  f"`vlmctl convert {checkpoint}` exports it"))


__all__ = ["METRICS", "Best", "Validator", "build_validator", "name_best", "val_batches"]
