"""Resuming with another batching would move the data position (it counts micro-batches of the old size): such a
resume is refused with the setting to restore."""

from __future__ import annotations

import json

import pytest

from vlmctl.config.train import TrainSection
from vlmctl.errors import ConfigError
from vlmctl.train.checkpoint import STATE_FILE, check_batching


def checkpoint(tmp_path, **state):
    folder = tmp_path / "run" / "checkpoints" / "checkpoint-20"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"step": 20, "consumed_micro_batches": 40, **state}))
    return folder


@pytest.mark.parametrize("saved, now, key", [
    ({"packing": False, "micro_batch_size": 4}, {"packing": True, "tokens_per_batch": 4096}, "train.packing=false"),
    ({"packing": True, "tokens_per_batch": 4096}, {"packing": False, "micro_batch_size": 4}, "train.packing=true"),
    ({"packing": True, "tokens_per_batch": 4096}, {"packing": True, "tokens_per_batch": 8192}, "train.tokens_per_batch=4096"),
    ({"packing": False, "micro_batch_size": 4}, {"packing": False, "micro_batch_size": 8}, "train.micro_batch_size=4"),
])
def test_a_batching_change_is_refused_with_the_setting_to_restore(tmp_path, saved, now, key):
    folder = checkpoint(tmp_path, **saved)
    with pytest.raises(ConfigError) as err:
        check_batching(folder, TrainSection(**now))
    assert key in err.value.message and "40 micro-batches" in err.value.message and key in err.value.hint


@pytest.mark.parametrize("saved, now", [
    ({"packing": True, "tokens_per_batch": 4096}, {"packing": True, "tokens_per_batch": 4096}),
    ({"packing": True, "tokens_per_batch": 4096}, {"packing": True, "tokens_per_batch": "auto"}),  # reuses the first run's choice
    ({"packing": False, "micro_batch_size": 4}, {"packing": False, "micro_batch_size": 4, "gradient_accumulation_steps": 3}),
    ({}, {"packing": True}),  # a checkpoint of an earlier version without the record
])
def test_the_same_batching_resumes(tmp_path, saved, now):
    check_batching(checkpoint(tmp_path, **saved), TrainSection(**now))


def test_the_launcher_lets_a_padded_checkpoint_pass_a_packing_config_the_ranks_decide(tmp_path):
    # a family that cannot take packed rows trains padded whatever train.packing says: only the ranks know the family
    folder = checkpoint(tmp_path, packing=False, micro_batch_size=4)
    check_batching(folder, TrainSection(packing=True), before_launch=True)
    with pytest.raises(ConfigError, match="train.packing=false"):
        check_batching(folder, TrainSection(packing=True))  # on a rank, after the model kept packing on
    with pytest.raises(ConfigError, match="train.packing=true"):  # packed before, padded now: a change in any case
        check_batching(checkpoint(tmp_path / "b", packing=True, tokens_per_batch=4096), TrainSection(packing=False), before_launch=True)


def test_a_row_split_over_another_number_of_ranks_is_the_same_batching(tmp_path):
    # sequence parallelism splits one packed row of tokens_per_batch x sequence_parallel tokens over its group
    import json

    from vlmctl.config.train import TrainSection
    from vlmctl.errors import ConfigError
    from vlmctl.train.checkpoint import STATE_FILE, check_batching

    (tmp_path / STATE_FILE).write_text(json.dumps({"packing": True, "tokens_per_batch": 300, "sequence_parallel": 2,
                                                   "consumed_micro_batches": 1}))
    check_batching(tmp_path, TrainSection(packing=True, tokens_per_batch=600, sequence_parallel=1))
    check_batching(tmp_path, TrainSection(packing=True, tokens_per_batch=150, sequence_parallel=4))
    with pytest.raises(ConfigError) as err:
        check_batching(tmp_path, TrainSection(packing=True, tokens_per_batch=300, sequence_parallel=1))
    assert "train.tokens_per_batch=600" in err.value.hint  # the value giving the checkpoint's rows without the split
