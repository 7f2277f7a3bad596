"""The run's data: the training shards with each sample's token count (and estimated training FLOPs when batches
are compute-balanced, `train.balance`), this data-parallel rank's sampler (packed token-budget bins or padded
micro-batches, `vlmctl.data.samplers`) and its collator (`vlmctl.data.collate`)."""

from __future__ import annotations

import sys
from pathlib import Path

from vlmctl.config.plan import row_tokens

# The vlmctl modules that load numpy and torch when imported are imported inside the functions that use them:
# importing vlmctl (the CLI's start-up) must not pay for them. Light vlmctl modules sit next to their use too.


def load_data(cfg, ctx, tm):
    """The training shards and the token count of each sample (counted with the model's processor when the shards
    were prepared before the model was built). Returns (dataset, lengths)."""
    from vlmctl.data.loader import ShardDataset
    from vlmctl.train.registry import get_objective

    dataset = ShardDataset.from_dir(Path(cfg.data.prepared_dir) / "train")
    check_objective_data(dataset.column_names, get_objective(cfg.train.objective), Path(cfg.data.prepared_dir) / "train")
    lengths = dataset.lengths
    if cfg.train.packing and not dataset.exact_lengths:
        if ctx.env.is_main:
            print(f"counting the tokens of {len(dataset)} samples for packing (`vlmctl data prepare` after "
                  "`vlmctl model build` records them)", file=sys.stderr)
        lengths = dataset.count_tokens(tm.processor, tm.family.name)
    if cfg.train.packing and cfg.data.max_length:
        lengths = lengths.clip(max=cfg.data.max_length)  # encode_sample truncates text beyond max_length
    if ctx.plan.balance.value:  # compute-balanced batches (`train.balance`, decided by the run's plan)
        dataset.sample_costs = sample_costs(tm.cost_model, dataset, lengths)
    return dataset, lengths


def check_objective_data(columns, spec, folder: Path) -> None:
    """Raise DataError when an objective that trains on preference pairs (`spec.data`, an `ObjectiveSpec`) meets
    shards (in `folder`, with these `columns`) without them (no `rejected` column: data prepared as conversations)."""
    from vlmctl.data.sample import REJECTED_COLUMN
    from vlmctl.errors import DataError

    if spec.data == "preference" and REJECTED_COLUMN not in columns:
        raise DataError(f"{folder}: train.objective {spec.name} trains on preference pairs, and these shards hold "
                        "conversations (no rejected answers)", hint="prepare preference data (`vlmctl data prepare "
                        "data.kind=preference`, docs/formats.md, Preference data) into its own data.prepared_dir, or "
                        "set train.objective: sft")


def sample_costs(cost_model, dataset, lengths):
    """Estimated training FLOPs per sample (float64 [N]): `CostModel.sample_costs` on `lengths` and the visual and
    labelled tokens `ShardDataset.count_estimates` derives from the shards (an approximation, documented there), per
    modality, so each encoder, one that counts itself included, is charged its own media."""
    counts = dataset.count_estimates(lengths)
    return cost_model.sample_costs(lengths, counts["visual_tokens"], counts["labelled_tokens"], counts["images"],
                                   media=counts["media"])


def build_sampler(cfg, ctx, dataset, lengths):
    """This data-parallel rank's sampler: packed token-budget bins (`train.packing`) or padded micro-batches, each
    optimizer step's samples split by cost when `load_data` estimated costs (`train.balance`), and of one modality
    group when `train.group_by_modality` is on (`ShardDataset.modalities`; a group too small for one optimizer step
    is never drawn, with a warning). The ranks of a sequence-parallel group share one sampler position
    (`dims.dp_rank`) and a row budget of `tokens_per_batch x sequence_parallel` tokens."""
    from vlmctl.data.loader import DistributedBatchSampler, PackedBatchSampler
    from vlmctl.train.registry import get_objective

    train = cfg.train
    from vlmctl.data.formats._common import source_name

    weights = {source_name(s): s.weight for s in cfg.data.sources}  # the names the shards record
    sample_weights = dataset.sample_weights(weights) if any(w != 1.0 for w in weights.values()) else None
    split = {"world_size": ctx.dims.dp_size, "rank": ctx.dims.dp_rank, "seed": train.seed, "weights": sample_weights,
             "costs": getattr(dataset, "sample_costs", None), "step_batches": train.gradient_accumulation_steps,
             "modalities": dataset.modalities() if train.group_by_modality else None}
    if not train.packing or not get_objective(train.objective).packs_samples:  # e.g. grpo's prompts, rolled out later
        sampler = DistributedBatchSampler(lengths, micro_batch_size=train.micro_batch_size,
                                          group_by_length=train.group_by_length, **split)
    else:
        # a row is split over the sequence-parallel group: its budget is the group's
        budget = row_tokens(train)
        sampler = PackedBatchSampler(lengths, tokens_per_batch=budget, **split)
        if sampler.too_long and ctx.env.is_main:
            what = f"train.tokens_per_batch={train.tokens_per_batch}" + (f" x sequence_parallel={ctx.dims.sp}" if ctx.dims.sp > 1 else "")
            gpus = -(-int(max(lengths)) // train.tokens_per_batch)  # the longest sample, at this budget per GPU
            print(f"warning: {sampler.too_long} samples are longer than {what} tokens and are left out; the longest "
                  f"needs {gpus} GPUs (train.sequence_parallel={gpus}, a divisor of the GPUs per node and of the "
                  "attention heads; `vlmctl data prepare` drops such samples as too_long)", file=sys.stderr)
    if sampler.grouping and ctx.env.is_main:
        for name, (samples, steps) in sampler.grouped(0)[1].items():
            if samples and not steps:
                print(f"warning: train.group_by_modality: the {samples} {name} samples are fewer than one optimizer "
                      "step and are never drawn (lower train.gradient_accumulation_steps or the batch size, or add "
                      f"{name} data)", file=sys.stderr)
    return sampler


def build_collator(cfg, ctx, tm):
    """This rank's collator, the objective's (`ObjectiveSpec.collate`): for sft packed rows of `tokens_per_batch x
    sequence_parallel` tokens (`train.packing`) or padded micro-batches, with a dummy input for each encoder a
    rank's micro-batch does not use (`Collator`); for dpo rows of preference pairs, packed or padded
    (`PairCollator`, `PaddedPairCollator`); for grpo the prompts (`grpo.PromptCollator`).

    With `train.group_by_modality` under fsdp or ddp the dummies follow the step's modality group
    (`Collator(grouped=True)`): every rank of a step skips the same encoders, so FSDP2 issues the same collectives
    on all of them and DDP (`find_unused_parameters`) reduces the same buckets. Under DeepSpeed (zero2, zero3)
    every dummy stays (the sampler still groups): ZeRO-3 prefetches parameters along the module order it traced in
    earlier steps, and a step that skips a traced tower leaves them in flight ("still have inflight params",
    DeepSpeed issue 5828, released only by newer versions, PR 6557); ZeRO-2 is not checked without its dummies."""
    from vlmctl.distributed.engine import is_deepspeed
    from vlmctl.train.registry import get_objective

    train = cfg.train
    grouped = train.group_by_modality and not is_deepspeed(train.strategy)
    return get_objective(train.objective).collate(tm.processor, tm.family, packed=train.packing,
                                                  tokens_per_batch=row_tokens(train) if train.packing else None,
                                                  max_length=cfg.data.max_length, grouped=grouped)
