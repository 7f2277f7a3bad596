"""The `auto` batch size / activation checkpointing search, on measured-like trials (peak = base + per-token bytes,
time = per-token seconds), and the fixed values where no probe runs."""

from __future__ import annotations

import pytest

from vlmctl.train import autotune
from vlmctl.train.autotune import Trial, fit_size, search

GIB = 2**30
# per mode: (base bytes, bytes per token, seconds per token): more checkpointing, less memory, more compute
MODES = {"off": (10 * GIB, 5 * 2**20, 1.0e-4), "op": (10 * GIB, 3 * 2**20, 1.1e-4),
         2: (10 * GIB, 2.6 * 2**20, 1.17e-4), "full": (10 * GIB, 0.3 * 2**20, 1.33e-4)}


def fake_run(modes=MODES, budget_cut=None, calls=None):
    def run(mode, size, timed=False):
        base, per, sec = modes[mode]
        if calls is not None:
            calls.append((mode, size))
        peak = int(base + per * size)
        if budget_cut is not None and peak > budget_cut:
            return Trial(mode, size, 0, 0.0, oom=True)
        return Trial(mode, size, peak, sec * size)
    return run


def test_fit_size_is_the_largest_step_multiple_within_budget():
    a, b = Trial("off", 1000, 10 * GIB + 1000 * 2**20, 0.1), Trial("off", 2000, 10 * GIB + 2000 * 2**20, 0.2)
    size = fit_size(a, b, 30 * GIB, 4 * GIB, floor=1, cap=10**6, step=512)
    assert size % 512 == 0
    assert 10 * GIB + size * 2**20 + 4 * GIB <= 30 * GIB < 10 * GIB + (size + 512) * 2**20 + 4 * GIB
    assert fit_size(a, b, 30 * GIB, 4 * GIB, floor=1, cap=4096, step=512) == 4096  # capped
    assert fit_size(a, b, 30 * GIB, 4 * GIB, floor=20000, cap=10**6, step=512) == 0  # below the longest sample


def test_search_picks_the_fastest_mode_at_the_largest_fitting_size():
    budget, state = 80 * GIB, 20 * GIB
    choice = search(fake_run(), modes=list(MODES), sizes=(2048, 4096), budget=budget, state=state, floor=1024,
                    cap=65536, step=512)
    # every mode runs at its largest fitting size; with these figures full fits the cap and is the fastest per token
    # among what fits... unless a cheaper mode fits a size where its rate is higher: rates are size/time = 1/sec
    rates = {m: 1 / sec for m, (_, _, sec) in MODES.items()}
    assert choice.activation_checkpointing == max(rates, key=rates.get) == "off"
    base, per, _ = MODES["off"]
    assert base + per * choice.tokens_per_batch + state <= budget
    assert base + per * (choice.tokens_per_batch + 512) + state > budget
    for trial in choice.trials:  # every measured size is recorded
        assert trial.size > 0


def test_search_reports_every_trial_as_it_runs():
    lines, calls = [], []
    choice = search(fake_run(budget_cut=30 * GIB, calls=calls), modes=["off", "full"], sizes=(2048, 4096),
                    budget=40 * GIB, state=GIB, floor=1024, cap=65536, step=512, log=lines.append)
    trial_lines = [line for line in lines if line.lstrip().startswith("trial ")]
    assert len(trial_lines) == len(choice.trials) == len(calls)
    for line, trial in zip(trial_lines, choice.trials):
        assert f"trial {trial.mode}, {trial.size} tokens" in line
        assert ("out of memory" in line) == trial.oom
        if not trial.oom:  # the peak shown includes the optimizer state the trial did not allocate
            assert f"peak {(trial.peak_bytes + GIB) / GIB:.1f} GiB" in line
    assert sum("(timed)" in line for line in trial_lines) == len(choice.rates) == 2


def test_a_mode_that_fits_only_a_small_row_loses_to_one_that_fits_a_large_row_when_speed_grows_with_size():
    # speed that grows with the row (fixed per-pass overhead of 0.5 s): the bigger row of full checkpointing wins
    modes = {"off": (10 * GIB, 20 * 2**20, 1.0e-4), "full": (10 * GIB, 0.5 * 2**20, 1.33e-4)}

    def run(mode, size, timed=False):
        base, per, sec = modes[mode]
        return Trial(mode, size, int(base + per * size), 0.5 + sec * size)

    choice = search(run, modes=list(modes), sizes=(2048, 4096), budget=60 * GIB, state=10 * GIB, floor=1024,
                    cap=65536, step=512)
    assert choice.activation_checkpointing == "full" and choice.tokens_per_batch == 65536
    assert choice.rates["full"] > choice.rates["off"]


def test_the_optimizer_steps_share_can_turn_the_choice_to_the_longer_row():
    # forward + backward alone: off (short rows, 1.0e-4 s/token) beats full (the cap, 1.1e-4 s/token); a fixed
    # 0.2 s optimizer step per row costs off's ~4k-token rows far more per token than full's 65,536
    modes = {"off": (10 * GIB, 10 * 2**20, 1.0e-4), "full": (10 * GIB, 0.3 * 2**20, 1.1e-4)}
    kwargs = dict(modes=list(modes), sizes=(2048, 4096), budget=60 * GIB, state=10 * GIB, floor=1024, cap=65536, step=512)
    alone = search(fake_run(modes), **kwargs)
    stepped = search(fake_run(modes), overhead=0.2, **kwargs)
    assert alone.activation_checkpointing == "off" and alone.step_seconds == 0.0
    assert stepped.activation_checkpointing == "full" and stepped.step_seconds == 0.2
    size = stepped.trials[-1].size  # full's timed trial
    assert stepped.rates["full"] == pytest.approx(size / (1.1e-4 * size + 0.2))


def test_measure_step_leaves_weights_and_optimizer_as_they_were():
    import torch

    from vlmctl.train.autotune import measure_step
    from vlmctl.distributed.engine import TorchEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    engine = TorchEngine(model, optimizer, scheduler, max_grad_norm=1.0, device=torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    seconds = measure_step(engine, torch.device("cpu"))
    assert seconds > 0
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q) and p.grad is None
    assert not optimizer.state and optimizer.param_groups[0]["lr"] == 1e-3
    # training's first step is the one it would have been without the measurement
    model(torch.ones(2, 16)).sum().backward()
    engine.step(skip=False)
    assert optimizer.state[next(model.parameters())]["step"] == 1
    # a resumed run's optimizer already holds state: nothing is stepped
    assert measure_step(engine, torch.device("cpu")) == 0.0


def test_an_optimistic_prediction_is_checked_and_shrunk():
    # memory grows faster than linearly past 20k tokens: the first check runs out of memory, the shrunk one fits
    calls = []

    def run(mode, size, timed=False):
        calls.append(size)
        peak = 10 * GIB + size * 2**20 + (max(0, size - 20000) * 2**21)
        return Trial(mode, size, 0, 0.0, oom=True) if peak > 40 * GIB else Trial(mode, size, peak, 1e-4 * size)

    choice = search(run, modes=["off"], sizes=(2048, 4096), budget=40 * GIB, state=0, floor=1024, cap=65536, step=512)
    assert calls[2] > choice.tokens_per_batch == calls[-1]  # predicted, missed, bisected, then timed at the size that fits
    assert 10 * GIB + choice.tokens_per_batch * 2**20 + max(0, choice.tokens_per_batch - 20000) * 2**21 <= 40 * GIB


def test_when_no_mode_fits_the_longest_sample_the_most_frugal_is_taken_and_said():
    choice = search(fake_run(), modes=list(MODES), sizes=(2048, 4096), budget=12 * GIB, state=GIB, floor=60000,
                    cap=65536, step=512)
    assert choice.activation_checkpointing == "full" and choice.tokens_per_batch < 60000
    assert "longest sample" in choice.reason


def test_nothing_fits_at_all_is_an_error():
    with pytest.raises(RuntimeError, match="no activation checkpointing mode fits"):
        search(fake_run(budget_cut=GIB), modes=["off"], sizes=(2048, 4096), budget=GIB, state=0, floor=1,
               cap=65536, step=512)


def test_fixed_values_where_no_probe_runs():
    from vlmctl.config.plan import PROBE, DeviceFacts, build_plan
    from vlmctl.config.train import TrainSection

    cpu, gpu = DeviceFacts(kind="cpu"), DeviceFacts(kind="cuda", memory_bytes=80 * GIB, processes=2)
    train = TrainSection()
    plan = build_plan(train, cpu)
    assert autotune.fixed_record(plan) is not None and not autotune.wants(plan)
    resolved = plan.train_section(train)
    assert (resolved.tokens_per_batch, resolved.micro_batch_size, resolved.activation_checkpointing) == (8192, 1, "off")
    assert train.tokens_per_batch == "auto"  # the config itself is never changed
    resolved = build_plan(TrainSection(strategy="zero3"), gpu).train_section(TrainSection(strategy="zero3"))
    assert (resolved.tokens_per_batch, resolved.activation_checkpointing) == (8192, "full")
    # on a GPU with fsdp the probe settles the batching in use and checkpointing; the other batching gets its default
    train = TrainSection(strategy="fsdp")
    plan = build_plan(train, gpu)
    resolved = plan.train_section(train)
    assert resolved.tokens_per_batch == "auto" and resolved.activation_checkpointing == "auto" and resolved.micro_batch_size == 1
    assert autotune.wants(plan) == {"tokens_per_batch", "activation_checkpointing"}
    assert plan.tokens_per_batch.value == PROBE and plan.row_tokens is None
    # explicit values are never touched
    train = TrainSection(tokens_per_batch=4096, activation_checkpointing=2, micro_batch_size=3)
    plan = build_plan(train, cpu)
    assert autotune.fixed_record(plan) is None
    resolved = plan.train_section(train)
    assert (resolved.tokens_per_batch, resolved.micro_batch_size, resolved.activation_checkpointing) == (4096, 3, 2)
    # the record (a run's autotune.json) holds only what auto decided, not the configured values' defaults
    settled = autotune.fixed_record(build_plan(TrainSection(tokens_per_batch=4096), cpu))
    assert settled.tokens_per_batch is None and settled.reason == "no probe on CPU"
    assert (settled.micro_batch_size, settled.activation_checkpointing) == (1, "off")


def test_the_record_round_trips_and_resolves_only_auto_keys(tmp_path):
    from vlmctl.config import TrainSection, load_config
    from vlmctl.config.plan import DeviceFacts, build_plan, read_plan, settle_probe

    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\ntrain: {micro_batch_size: 4}\n")
    cfg = load_config(tmp_path / "vlmctl.yaml")
    choice = search(fake_run(), modes=["full"], sizes=(2048, 4096), budget=40 * GIB, state=GIB, floor=1,
                    cap=30000, step=512)
    choice.micro_batch_size = 9  # never applied: the config sets 4
    applied = choice.apply(cfg.train)
    assert applied == [f"tokens_per_batch={choice.tokens_per_batch}", "activation_checkpointing=full"]
    plan = build_plan(TrainSection(micro_batch_size=4), DeviceFacts(kind="cuda", memory_bytes=80 * GIB))
    plan, applied = settle_probe(plan, TrainSection(micro_batch_size=4), choice)
    autotune.save_record(tmp_path, choice, plan)
    again = autotune.load_record(tmp_path)
    assert again.tokens_per_batch == choice.tokens_per_batch and len(again.trials) == len(choice.trials)
    saved = read_plan(tmp_path)  # the plan records the probe's decisions; no config.yaml is written
    assert not (tmp_path / "config.yaml").exists()
    assert (saved.tokens_per_batch.value, saved.activation_checkpointing.value, saved.micro_batch_size.value) == (
        choice.tokens_per_batch, "full", 4)
    assert saved.row_tokens == choice.tokens_per_batch and saved.probe["applied"] == applied


def test_probe_rows_take_the_heaviest_samples_per_token_first():
    """A packed probe row is filled with the samples of the most estimated FLOPs per token (image-heavy ones),
    not the longest: those need the most activation memory per token. Padded rows stay longest first."""
    import numpy as np

    lengths = np.array([1000, 300, 900, 250, 800])
    costs = np.array([1000.0, 900.0, 900.0, 750.0, 800.0])  # per token: 1, 3, 1, 3, 1
    seen = []
    rows = autotune.probe_rows(lengths, lambda idx: seen.append(list(idx)) or idx, packing=True, costs=costs)
    rows(600)
    assert seen[-1] == [1, 3]  # 300 + 250 tokens of the heaviest samples (3 FLOPs per token), longest first
    rows(1500)
    assert seen[-1][:2] == [1, 3] and sum(lengths[seen[-1]]) <= 1500
    plain = autotune.probe_rows(lengths, lambda idx: seen.append(list(idx)) or idx, packing=True)
    plain(1500)
    assert seen[-1][0] == 0  # without costs: the longest first
    padded = autotune.probe_rows(lengths, lambda idx: seen.append(list(idx)) or idx, packing=False, costs=costs)
    padded(2)
    assert seen[-1] == [0, 2]
    # the timed row: samples in a fixed random order, not the heaviest first; the same on every call
    rows(1500, heaviest=False)
    typical = seen[-1]
    assert sum(lengths[typical]) <= 1500 and typical[:2] != [1, 3]
    rows(1500, heaviest=False)
    assert seen[-1] == typical


def test_the_timed_trial_asks_for_a_typical_row():
    calls = []

    def run(mode, size, timed=False):
        calls.append((mode, size, timed))
        return Trial(mode=mode, size=size, peak_bytes=size * 1000, seconds=size / 1e4)

    choice = search(run, modes=["off"], sizes=(2048, 4096), budget=10**9, state=0, floor=1024, cap=8192, step=512)
    assert choice.tokens_per_batch == 8192
    assert [c[2] for c in calls] == [False] * (len(calls) - 1) + [True]  # fits measured on the heaviest rows
