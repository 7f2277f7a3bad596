"""The reference of a DPO run (`train.dpo.reference`, `train.objectives.DPOObjective`): a frozen copy of the
starting model (`load_reference`, parallelized by the worker with `trainable=False`), or its log-probs of every
pair computed once before the first step (`reference_pass`: `precompute_reference`, stored in the run folder as
`reference_logps.json`, which a resumed run reads back with `read_reference`).

The frozen copy is the run's source weights also when the run resumes: the reference never moves. The precomputed
log-probs come from the engine's model before any step (the starting weights), one pair per forward on every
data-parallel rank.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmctl.errors import VlmctlError

# torch and the vlmctl modules that load it are imported inside the functions that use them: importing vlmctl (the
# CLI's start-up) must not pay for them.


def load_reference(cfg, train, ctx):
    """A frozen copy of the starting model (the run's source weights, also when resuming: the reference never
    moves): loaded as the trained model is (rank 0 alone under fsdp/ddp on several ranks), with the run's attention
    kernels, every parameter frozen in the compute dtype, and no LoRA. The weights rank 0 read ride on the model
    (`_vlmctl_deferred`) until `parallelize` places them."""
    from vlmctl.train.setup import apply_kernels, defer_weights, load_for_rank, model_source, store_frozen

    cfg = cfg.model_copy(update={"train": train})  # the run's resolved train section
    model, _, family = load_for_rank(model_source(cfg), cfg, ctx, resuming=False)
    apply_kernels(model, family, train, ctx.env.device, ctx.plan)
    model.requires_grad_(False)
    store_frozen(model, ctx.dtype)
    model._vlmctl_deferred = defer_weights(model, train, ctx.env)
    return model


REFERENCE_LOGPS = "reference_logps.json"
"""The run folder's precomputed DPO reference log-probs (`train.dpo.reference: precomputed`)."""


def reference_pass(cfg, ctx, tm, engine, objective, dataset, collate, run_dir: Path, resume_from: Path | None) -> None:
    """`train.dpo.reference: precomputed`: score every training pair (and val pair when the run validates) with the
    starting model once, before the first step (`precompute_reference`, pairs collated by `collate`, the run's
    `PairCollator`); a run resumed from `resume_from` reads the file its first start wrote (`read_reference`)."""
    path = run_dir / REFERENCE_LOGPS
    if resume_from is not None:
        read_reference(objective, path)
        return
    datasets = [dataset]
    if cfg.train.eval_steps:
        from vlmctl.data.loader import ShardDataset

        datasets.append(ShardDataset.from_dir(Path(cfg.data.prepared_dir) / "val"))
    if ctx.env.is_main:
        print(f"scoring {sum(len(d) for d in datasets)} pairs with the reference model (train.dpo.reference: precomputed)",
              file=sys.stderr)
    precompute_reference(objective, engine, datasets, collate, prepare=tm.prepare,
                         device=ctx.env.device, dp_rank=ctx.dims.dp_rank, dp_size=ctx.dims.dp_size,
                         dp_group=ctx.dims.dp_group, path=path)


@dataclass
class ReferencePass:
    """An objective-shaped pass (`Engine.forward` runs it under the engine's precision) returning the reference
    log-probs of a row of pairs: (sums [S], counts [S]) of `DPOObjective.sequence_logps`."""

    dpo: Any  # the DPOObjective

    def loss(self, engine, batch: dict[str, Any]):
        return self.dpo.sequence_logps(engine.model, engine.inputs(batch), batch)


def precompute_reference(objective, engine, datasets, collate, *, prepare=None, device, dp_rank: int,
                         dp_size: int, dp_group=None, path) -> int:
    """Reference log-probs of every pair of `datasets` (ShardDatasets of preference samples: the training split and
    the val split when the run validates) under the model as `engine` holds it before any step (the starting model),
    into `objective.precomputed` and the JSON file `path` ({sample id: [chosen, rejected]}, summed answer log-probs in
    nats; written by data-parallel rank 0, temporary file + rename). A resumed run reads `path` instead: its engine
    holds trained weights.

    Each data-parallel rank scores every `dp_size`-th pair, one pair per forward (so every rank runs the same number
    of forwards, which FSDP2's collectives need: the last rank's list is padded with its last pair), in eval mode
    and without gradients; the ranks' results are gathered over `dp_group`. Returns the number of pairs scored.
    Raises VlmctlError when `path` is missing on resume (`objective.precomputed` must then come from the file)."""
    import json
    import os

    import torch
    import torch.distributed as dist

    from vlmctl.train.loop import to_device

    items = [(ds, i) for ds in datasets for i in range(len(ds))]
    mine = items[dp_rank::dp_size]
    per_rank = -(-len(items) // dp_size)
    mine += mine[-1:] * (per_rank - len(mine)) if mine else []
    found: dict[str, list[float]] = {}
    model = engine.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for ds, i in mine:
                batch = collate([ds[i]])
                batch = to_device(prepare(batch) if prepare is not None else batch, device)
                sums, _ = engine.forward(ReferencePass(objective), batch)
                if batch["num_pairs"]:
                    found[batch["pair_ids"][0]] = [float(sums[0]), float(sums[1])]
    finally:
        model.train(was_training)
    every: list[dict[str, list[float]] | None] = [None] * dp_size
    if dist.is_initialized() and dp_size > 1:
        dist.all_gather_object(every, found, group=dp_group)
    else:
        every = [found]
    merged = {k: v for part in every for k, v in (part or {}).items()}
    objective.precomputed = {k: (v[0], v[1]) for k, v in merged.items()}
    if dp_rank == 0:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(merged))
        os.replace(tmp, path)
    return len(merged)


def read_reference(objective, path) -> int:
    """Load `precompute_reference`'s file into `objective.precomputed`; returns the number of pairs. Raises
    VlmctlError when it is missing or unreadable, or is not {pair id: [chosen, rejected]} with finite numbers (a
    resumed run cannot recompute it: its weights have trained; a value of another type would train on a wrong
    reference, silently)."""
    import json
    import math

    hint = ("start a new run (train.dpo.reference: precomputed computes them before its first step), "
            "or use train.dpo.reference: frozen")
    try:
        merged = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not UTF-8 or not JSON
        detail = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise VlmctlError(f"{path}: the precomputed reference log-probs of this run cannot be read ({detail})", hint=hint) from None
    if not isinstance(merged, dict):
        raise VlmctlError(f"{path}: the precomputed reference log-probs are a JSON {type(merged).__name__}, not "
                          "{pair id: [chosen, rejected]}", hint=hint)

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key, value in merged.items():
        if not (isinstance(value, list) and len(value) == 2 and all(number(v) for v in value)):
            raise VlmctlError(f"{path}: pair {key!r} holds {json.dumps(value)[:80]}, not [chosen, rejected] log-probabilities "
                              "(two finite numbers)", hint=hint)
    objective.precomputed = {k: (float(v[0]), float(v[1])) for k, v in merged.items()}
    return len(merged)


def probe_stand_ins(objective) -> None:
    """Placeholder reference log-probs for the auto-size probe of a precomputed-reference run (it measures memory,
    not loss; the pass that computes them runs after it, on the sized engine)."""
    from collections import defaultdict

    objective.precomputed = defaultdict(lambda: (0.0, 0.0))


__all__ = ["REFERENCE_LOGPS", "ReferencePass", "load_reference", "precompute_reference", "probe_stand_ins", "read_reference",
           "reference_pass"]
