"""Compute-balanced batches and straggler metrics in real runs of the tiny model on CPU: balancing leaves a step's
loss alone, and a rank whose data loader is slowed on purpose (VLMCTL_TEST_DATA_DELAY) shows as `data_wait` on
that rank in metrics.jsonl, not in the other rank's compute time."""

from __future__ import annotations

import itertools

import pytest

from cli_runner import run_cli as run_cli_inprocess
from train_runner import finish_train, start_train
from test_train_runs import RUN_TIMEOUT, metrics, project  # noqa: F401 - `project` is the shared fixture

DELAY = 2.0  # seconds each micro-batch of the slowed rank waits; a tiny-model step computes in well under half


def _capture_samplers(monkeypatch) -> list:
    from vlmctl.data import loader

    made = []
    original = loader.PackedBatchSampler.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(loader.PackedBatchSampler, "__init__", init)
    return made


@pytest.mark.timeout(RUN_TIMEOUT)
def test_balancing_changes_the_split_but_not_the_loss_of_a_step(project, capsys, monkeypatch):  # noqa: F811
    # one rank, two accumulated packed rows a step: train.balance=on splits each step's samples again by cost
    made = _capture_samplers(monkeypatch)
    base = ["-c", str(project / "vlmctl.yaml"), "train", "--launcher", "none", "train.strategy=ddp", "train.max_steps=3",
            "train.gradient_accumulation_steps=2", "train.save_steps=100"]
    for mode in ("off", "on"):
        code, out, err = run_cli_inprocess([*base, f"train.balance={mode}", f"train.run_name=balance-{mode}"], capsys)
        assert code == 0, out + err
    plain, balanced = made
    assert not plain.balancing and balanced.balancing
    rows_plain, rows_balanced = (list(itertools.islice(iter(s), 6)) for s in (plain, balanced))
    assert rows_plain != rows_balanced  # the costs moved samples between the step's rows
    for step in range(3):
        a, b = (sorted(i for row in rows[2 * step:2 * step + 2] for i in row) for rows in (rows_plain, rows_balanced))
        assert a == b  # the same global batch
    off, on = metrics(project / "runs" / "balance-off"), metrics(project / "runs" / "balance-on")
    assert [r["label_tokens"] for r in off] == [r["label_tokens"] for r in on]
    for p, q in zip(off, on):
        assert q["loss"] == pytest.approx(p["loss"], rel=1e-5)
        assert q["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_rank_with_a_slow_data_loader_shows_as_data_wait_on_that_rank(project):  # noqa: F811
    finish_train(start_train(project / "vlmctl.yaml", "train.run_name=slow-rank", "train.max_steps=3", "train.save_steps=100",
                             "train.strategy=ddp", env={"VLMCTL_TEST_DATA_DELAY": f"1:{DELAY}"}), timeout=RUN_TIMEOUT)
    rows = metrics(project / "runs" / "slow-rank")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["data_wait_rank"] == 1 and len(row["rank_compute_s"]) == 2
        # the slowed rank waits for nearly its whole delay (less the step it overlaps); the other barely waits
        assert row["rank_data_wait_s"][1] > 0.5 * DELAY and row["rank_data_wait_s"][0] < 0.25 * DELAY
        # and the other rank's wait for it is not counted as its compute: no false imbalance
        assert row["rank_compute_s"][0] < 0.5 * DELAY and row["rank_sync_s"][0] > 0.5 * DELAY
    log = (project / "runs" / "slow-rank" / "train.log").read_text()
    assert "(rank 1)" in log and "balance" in log  # the step line names the waiting rank
