"""`VLMCTL_GPU_SHARD=i/n` (tests/gpu/conftest.py): the GPU suite's shards, one per GPU of a device machine, collected here
on the CPU (collection needs no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def collected(shard: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "VLMCTL_GPU_SHARD"}
    if shard is not None:
        env["VLMCTL_GPU_SHARD"] = shard
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/gpu", "-k", "not two_gpus"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_two_shards_split_the_suite_and_keep_a_shared_fixtures_module_whole():
    everything, shards = collected(None), [collected(f"{i}/2") for i in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(everything) and not set(shards[0]) & set(shards[1])
    for module in ("test_fp8_gpu.py", "test_training_paths.py"):  # marked one_shard: their module fixture trains every case
        holders = [i for i, shard in enumerate(shards) if any(f"/{module}::" in test for test in shard)]
        assert len(holders) == 1, (module, holders)
    # the other tests still spread: each shard has some of the slow post-training runs
    assert all(any("test_post_training_gpu.py::" in test for test in shard) for shard in shards)
