"""`vlmctl train --dry-run`, `vlmctl bench --plan` and a real run's plan.json agree for the same config: one plan,
printed the same way (`vlmctl.config.plan.plan_text`), and the run's plan.json holds the same decisions."""

from __future__ import annotations

import pytest

from cli_runner import run_cli as run_cli_inprocess
from test_train_runs import RUN_TIMEOUT, project  # noqa: F401 - `project` is the shared fixture


@pytest.mark.timeout(RUN_TIMEOUT)
def test_dry_run_bench_and_the_run_print_one_plan(project, capsys):  # noqa: F811
    from vlmctl.config.plan import plan_text, read_plan

    cfg = str(project / "vlmctl.yaml")
    same = ["--launcher", "none", "train.strategy=auto", "train.tokens_per_batch=auto", "train.max_steps=1",
            "train.save_steps=100", "train.run_name=plan-agree", "train.lora.r=4"]
    code, _, dry = run_cli_inprocess(["-c", cfg, "train", "--dry-run", *same], capsys)
    assert code == 0, dry
    code, _, bench = run_cli_inprocess(["-c", cfg, "bench", "--plan", "--nproc-per-node", "1", *same[2:]], capsys)
    assert code == 0, bench
    code, out, err = run_cli_inprocess(["-c", cfg, "train", *same], capsys)
    assert code == 0, out + err
    recorded = read_plan(project / "runs" / "plan-agree")
    text = plan_text(recorded)
    assert recorded.strategy.value == "ddp" and recorded.tokens_per_batch.value == 8192
    for printed in (dry, bench, err):  # the same table, line for line
        assert text.strip() in printed, printed
