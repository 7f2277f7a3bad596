"""The GPU suite: the code paths only a GPU takes (`tests/gpu/README.md`). Every test here is marked `gpu` and skips
without CUDA; `two_gpus` tests skip with fewer than 2 GPUs. `tests/gpu/run.sh` sets up a device machine and runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TIMEOUT = 480


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def shard_of(text: str | None) -> tuple[int, int] | None:
    """(index, count) of `VLMCTL_GPU_SHARD=i/n` (`tests/gpu/run.sh` on a machine of n GPUs), None when unset.
    Raises pytest.UsageError for a value that is not i/n with 0 <= i < n."""
    if not text:
        return None
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"VLMCTL_GPU_SHARD={text!r} is not i/n (e.g. 0/2)") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"VLMCTL_GPU_SHARD={text!r}: i must be in 0..n-1")
    return index, count


def shard_groups(items) -> list[list]:
    """`items` in the groups one shard runs whole, in collection order: the tests of a module marked
    `one_shard` together (they share a module fixture that trains every case at once: built in each shard that
    runs one of them), every other test alone."""
    groups, by_module = [], {}
    for item in items:
        if item.get_closest_marker("one_shard") is None:
            groups.append([item])
        elif item.module in by_module:
            by_module[item.module].append(item)
        else:
            by_module[item.module] = [item]
            groups.append(by_module[item.module])
    return groups


def pytest_collection_modifyitems(config, items):
    # One shard of the one-GPU tests per GPU: the i-th group of tests (`shard_groups`) goes to shard i mod n, so the
    # slow subprocess runs, which sit next to each other, spread over the shards.
    shard = shard_of(os.environ.get("VLMCTL_GPU_SHARD"))
    if shard is not None:
        mine = [item for i, group in enumerate(shard_groups(items)) if i % shard[1] == shard[0] for item in group]
        config.hook.pytest_deselected(items=[item for item in items if item not in mine])
        items[:] = mine
    count = _cuda_count()
    for item in items:
        if HERE not in Path(str(item.fspath)).parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if count == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu/run.sh on a device machine)"))
        elif item.get_closest_marker("two_gpus") and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA GPUs"))


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """Tiny Qwen2.5-VL and LLaVA model folders (fp32) and shapes-VQA shards (every third sample text-only)."""
    from shapes_shards import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("gpu"), 20)


def run_ranks(built: Path, preset: str, cases: dict, world: int, tmp_path: Path) -> dict:
    """Run `cases` (see `gpu_worker`) on `world` GPUs, one process each; returns rank 0's results (and the CPU
    reference under "reference": {"1": ..., "2": ...} for the first 1..world rows)."""
    import torch

    from vlmctl.distributed.env import free_port

    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    out = tmp_path / "results.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")])}
    port = str(free_port())
    code = "import sys; from gpu_worker import main; main(sys.argv[1:])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(world), port, str(built / preset), str(built / "data"),
                               str(spec), str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"ranks did not finish within {TIMEOUT} s:\n" + "\n".join(q.communicate()[0][-3000:] for q in procs))
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    return torch.load(out, weights_only=False)
