"""`vlmctl bench --scaling 1,2` on CPU: the tiny preset's bench in this process and on two gloo processes
(torchrun, FSDP2), one row each, with the figures every row must have and the efficiency they imply."""

from __future__ import annotations

import json

import pytest

from cli_runner import run_cli

STEPS, WARMUP, BUDGET = 2, 1, 400


@pytest.fixture
def project(tmp_path):
    path = tmp_path / "vlmctl.yaml"
    path.write_text(f"model:\n  preset: tiny\n  init: random\ntrain:\n  strategy: fsdp\n  stage: full\n"
                    f"  tokens_per_batch: {BUDGET}\n  attn_implementation: sdpa\n")
    return path


@pytest.mark.timeout(600)
def test_scaling_one_and_two_processes(project, capsys):
    code, out, err = run_cli(["bench", "-c", str(project), "--scaling", "2,1", "--steps", str(STEPS), "--warmup",
                              str(WARMUP), "--text-tokens", "8,40", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out[out.index("{"):])
    rows = data["rows"]
    assert data["baseline_processes"] == 1 and [r["world_size"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["strategy"], r["steps"], r["workload"], r["packing"]) == ("fsdp", STEPS, "chat", True)
        # one packed row of at most the budget per process and step
        assert (r["world_size"] - 1) * BUDGET < r["tokens_per_step"] <= r["world_size"] * BUDGET
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0
        assert r["tokens_per_s_per_gpu"] * r["world_size"] == pytest.approx(r["tokens_per_s"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
        assert 0 <= r["data_wait"] < 1
        # one rank reshards (a kept copy would save no all-gather); two keep the layers gathered
        kept = "true" if r["world_size"] == 1 else "false"
        assert f"FSDP2 reshard after forward {kept} (auto: " in r["settings"] and "prefetch 1 layer" in r["settings"]
    one, two = rows
    assert one["efficiency"] == 1.0 and one["balance"] == 1.0  # one rank is as slow as the slowest
    assert two["efficiency"] == pytest.approx(two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"])
    assert 0 < two["efficiency"] and 0 < two["balance"] <= 1 and 0 < two["balance_flops"] <= 1
