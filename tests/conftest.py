"""Shared fixtures. Tests run on CPU with tiny models and local data only (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["COLUMNS"] = "200"  # rich wraps long lines at the terminal width; assertions read whole lines

FIXTURES = Path(__file__).parent / "fixtures"
WORKERS = 2
"""pytest-xdist workers of the CPU suite (`VLMCTL_TEST_WORKERS`; 0: one process). Most of a multi-process test's time
is process start-up, rendezvous and one-rank phases that leave a core of the 2-core CI machine idle, which the
other worker's tests fill. Each worker takes whole files (`--dist loadfile`), so a module's fixtures are built once."""


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Run the tests on `WORKERS` pytest-xdist workers unless the command line chose (`-n`, `--dist`, `-p no:xdist`,
    `--pdb`), on a machine without NVIDIA GPUs and for a run that does not name tests/gpu (the GPU suite keeps its
    one pytest per GPU, tests/gpu/run.sh)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.pluginmanager.hasplugin("xdist"):
        return
    gpu = (Path(__file__).parent / "gpu").resolve()
    named = [Path(str(arg).split("::")[0]).resolve() for arg in config.args]
    if Path("/dev/nvidiactl").exists() or any(p == gpu or gpu in p.parents for p in named):
        return
    if config.option.numprocesses is None and config.option.dist == "no" and not config.getoption("usepdb"):
        config.option.numprocesses = int(os.environ.get("VLMCTL_TEST_WORKERS", WORKERS))
        config.option.dist = "loadfile"


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


SHAPES_TEXTS = ["What color is the triangle? How many circles are there? Is the square left of the circle? "
                "What shape is the red object? Answer with one word. red green blue yellow purple yes no 0 1 2 3"] * 20
"""The tokenizer texts of the shapes-VQA training projects (their words: one token each)."""


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """`get(preset="tiny", *, shapes=False, dtype="fp32") -> Path`: a tiny model folder built by `vlmctl model
    build`'s library (random init, weights stored in `dtype`, its tokenizer trained on `convert_helpers.TEXTS`, or on
    `SHAPES_TEXTS` with `shapes`), built once per test session for every module that asks: read it, or copy it
    (`shutil.copytree`) into a project that writes next to it."""
    from convert_helpers import TEXTS

    built: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("tiny-models")

    def get(preset: str = "tiny", *, shapes: bool = False, dtype: str = "fp32") -> Path:
        key = (preset, shapes, dtype)
        if key not in built:
            from vlmctl.config import ModelSection
            from vlmctl.models.build import build_model

            folder = root / (preset if key == (preset, False, "fp32") else f"{preset}-{'shapes' if shapes else 'convert'}-{dtype}")
            build_model(ModelSection(preset=preset, init="random", output_dir=folder, dtype=dtype),
                        tokenizer_texts=SHAPES_TEXTS if shapes else TEXTS)
            built[key] = folder
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_llava(tiny_models) -> Path:
    """The tiny LLaVA preset's folder (`tiny_models("tiny")`)."""
    return tiny_models("tiny")


@pytest.fixture
def write_config(tmp_path):
    """Write a vlmctl.yaml with the given text into tmp_path and return its path."""

    def _write(text: str, folder: Path | None = None) -> Path:
        folder = folder or tmp_path
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "vlmctl.yaml"
        path.write_text(text)
        return path

    return _write


@pytest.fixture
def ready_config(write_config):
    """`write_config` for a project that `vlmctl train` would start (what `--dry-run` checks too): a training shard in
    data/prepared/train and `model.base` set (the text must not have a `model` section)."""

    def _write(text: str, folder: Path | None = None) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = write_config(text + "model: {base: org/some-vlm}\n", folder)
        shard = path.parent / "data" / "prepared" / "train" / "train-00000.parquet"
        shard.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": ["s0"]}), shard)
        return path

    return _write
