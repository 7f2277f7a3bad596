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


def pytest_collection_modifyitems(config, items):
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
