"""too_long against the packed training row (`RowBudget`: train.tokens_per_batch x train.sequence_parallel): the
limit, the detail naming the GPUs a sample needs, the CLI's budget from the train section and its summary line."""

from __future__ import annotations

import pytest

from vlmctl.config import validate_config
from vlmctl.data.pipeline import RowBudget, token_limit, too_long, with_token_counts
from vlmctl.data.sample import Sample


def sample(n_tokens: int | None) -> Sample:
    return Sample(id="s", messages=[], source="src", location="f.json:3", num_tokens=n_tokens)


def test_row_budget_tokens_and_gpus():
    budget = RowBudget(8192, 2)
    assert budget.tokens == 16384
    assert [budget.gpus_for(n) for n in (1, 8192, 8193, 14200, 16384, 16385)] == [1, 1, 2, 2, 2, 3]
    assert budget.to_dict() == {"row_budget_tokens": 16384, "tokens_per_batch": 8192, "sequence_parallel": 2}
    assert token_limit(4096, budget) == 4096 and token_limit(100_000, budget) == 16384 and token_limit(4096, None) == 4096
    for bad in ((0, 1), (8192, 0)):
        with pytest.raises(ValueError, match="tokens_per_batch >= 1 and sequence_parallel >= 1"):
            RowBudget(*bad)


def test_the_default_budget_is_trainings():
    from vlmctl.data.pipeline import DEFAULT_TOKENS_PER_GPU
    from vlmctl.train.autotune import DEFAULT_TOKENS

    assert DEFAULT_TOKENS_PER_GPU == DEFAULT_TOKENS  # gpus_needed without a row budget is computed at it


def test_too_long_detail_names_the_key_and_the_gpus():
    over_row = too_long(sample(12_000), 100_000, RowBudget(8192))
    assert (over_row.reason, over_row.location, over_row.id) == ("too_long", "f.json:3", "s")
    assert over_row.detail == ("12,000 tokens (text + visual) > 8,192 tokens per packed row (train.tokens_per_batch=8192 "
                               "x train.sequence_parallel=1); it needs 2 GPUs: set train.sequence_parallel=2 (or raise "
                               "train.tokens_per_batch)")
    # over data.max_length only (the smaller limit): the detail is the max_length one, as without a budget
    assert too_long(sample(5000), 4096, RowBudget(8192)).detail == "5000 tokens (text + visual) > data.max_length=4096"
    assert too_long(sample(5000), 4096).detail == "5000 tokens (text + visual) > data.max_length=4096"
    both = too_long(sample(30_000), 20_000, RowBudget(8192, 2)).detail
    assert both.startswith("30000 tokens (text + visual) > data.max_length=20000 and > 16,384 tokens per packed row")
    assert "it needs 4 GPUs: raise data.max_length and set train.sequence_parallel=4" in both
    # within both limits, or not counted: kept
    assert too_long(sample(16_384), 100_000, RowBudget(8192, 2)) is None
    assert too_long(sample(None), 10, RowBudget(8)) is None


def test_with_token_counts_applies_the_row_budget():
    class Counter:
        def count(self, s, sizes):
            return int(s.id)

    class Info:
        widths, heights = [], []

    results = [(0, Sample(id=str(n), messages=[]), Info()) for n in (100, 300, 500)]
    kept = [item.id for _, item, info in with_token_counts(iter(results), Counter(), 1000, RowBudget(128, 3)) if info]
    assert kept == ["100", "300"]
    results = [(0, Sample(id=str(n), messages=[]), Info()) for n in (100, 300, 500)]
    assert len([1 for *_, info in with_token_counts(iter(results), Counter(), 1000) if info]) == 3


@pytest.mark.parametrize("overrides, expected", [
    ([], None),  # tokens_per_batch auto: known only when training starts
    (["train.tokens_per_batch=4096"], RowBudget(4096, 1)),
    (["train.tokens_per_batch=4096", "train.sequence_parallel=4"], RowBudget(4096, 4)),
    (["train.tokens_per_batch=4096", "train.packing=false"], None),  # a sample is its own padded row
])
def test_cli_builds_the_budget_from_the_train_section(overrides, expected):
    from vlmctl.cli.data import _row_budget
    from vlmctl.config import apply_overrides

    assert _row_budget(validate_config(apply_overrides({}, overrides), overrides=overrides)) == expected


def test_longest_sample_line():
    from vlmctl.cli.data import _longest_line

    def tokens(longest, budget: RowBudget | None):
        per_gpu = budget or RowBudget(8192)
        blank = dict.fromkeys(("row_budget_tokens", "tokens_per_batch", "sequence_parallel"))
        return {"max": longest, **(budget.to_dict() if budget else blank), "gpus_needed": per_gpu.gpus_for(longest),
                "gpus_needed_at": per_gpu.tokens_per_batch}

    assert _longest_line(tokens(14_200, RowBudget(8192, 2))) == \
        "Longest sample: 14,200 tokens, 2 GPUs at train.tokens_per_batch=8192 (train.sequence_parallel=2 holds it)"
    assert _longest_line(tokens(3000, RowBudget(4096))) == "Longest sample: 3,000 tokens, 1 GPU at train.tokens_per_batch=4096"
    assert _longest_line(tokens(3000, RowBudget(2048, 4))) == ("Longest sample: 3,000 tokens, 2 GPUs at train.tokens_per_batch=2048 "
                                                              "(train.sequence_parallel=4 holds it; train.sequence_parallel=2 would too)")
    assert _longest_line(tokens(20_000, None)) == ("Longest sample: 20,000 tokens, 3 GPUs at 8,192 tokens per GPU "
                                                   "(train.tokens_per_batch: auto without a probe; set train.sequence_parallel=3 for it)")
