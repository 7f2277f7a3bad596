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


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """`get(preset="tiny") -> Path`: a tiny model folder built by `vlmctl model build`'s library (random init, fp32,
    its tokenizer trained on `convert_helpers.TEXTS`), once per test session for every module that asks: read it,
    copy it before changing it."""
    from convert_helpers import TEXTS

    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tiny-models")

    def get(preset: str = "tiny") -> Path:
        if preset not in built:
            from vlmctl.config import ModelSection
            from vlmctl.models.build import build_model

            build_model(ModelSection(preset=preset, init="random", output_dir=root / preset, dtype="fp32"), tokenizer_texts=TEXTS)
            built[preset] = root / preset
        return built[preset]

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
