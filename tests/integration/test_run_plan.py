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


@pytest.mark.timeout(RUN_TIMEOUT)
def test_dry_run_and_bench_plan_qlora_alike_for_a_gpu(project, capsys, monkeypatch):  # noqa: F811
    # QLoRA needs a GPU: both commands plan for one described by hand (`DeviceFacts.here` is what they ask)
    from vlmctl.config import load_config
    from vlmctl.config.plan import DeviceFacts, build_plan, plan_text
    from vlmctl.inference.load import folder_family

    def gpu(cls, processes=1, *, cuda=None):
        return DeviceFacts(kind="cuda", memory_bytes=80 * 2**30, processes=processes, torchao=True, triton=True,
                           varlen=True)

    monkeypatch.setattr(DeviceFacts, "here", classmethod(gpu))
    monkeypatch.setattr("vlmctl.train.launch.check_packages", lambda train: None)  # bitsandbytes: GPU machines only
    cfg = str(project / "vlmctl.yaml")
    qlora = ["train.strategy=auto", "train.lora.r=4", "train.lora.quantize=4bit", "train.precision=auto"]
    # two processes: one would store bf16 weights and be ddp whatever the QLoRA flag says
    code, _, dry = run_cli_inprocess(["-c", cfg, "train", "--dry-run", "--launcher", "torchrun", "--nproc-per-node",
                                      "2", *qlora], capsys)
    assert code == 0, dry
    code, _, bench = run_cli_inprocess(["-c", cfg, "bench", "--plan", "--nproc-per-node", "2", *qlora], capsys)
    assert code == 0, bench
    train = load_config(project / "vlmctl.yaml", overrides=qlora).train
    plan = build_plan(train, gpu(DeviceFacts, 2), family=folder_family(project / "model"))
    # QLoRA replicates its 4-bit base: ddp, in the dry run and in bench alike (LoRA alone shards: fsdp)
    assert (plan.strategy.value, plan.compile.value, plan.stored.value) == ("ddp", "off", "bf16")
    lora = build_plan(load_config(project / "vlmctl.yaml", overrides=qlora[:2]).train, gpu(DeviceFacts, 2))
    assert lora.strategy.value == "fsdp"
    for printed in (dry, bench):
        assert plan_text(plan).strip() in printed, printed
