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
