"""The tiny model of the `vlmctl serve` tests, as module-scoped fixtures a test module imports: `tiny_model` (the
`tiny` preset, LLaVA layout, built with random weights in fp32, its tokenizer trained on the module's `TEXTS`) and
`reference` (that model loaded in this process on CPU, as `vlmctl generate` loads it)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, request) -> Path:
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    folder = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]) / "tiny"
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder, dtype="fp32"),
                tokenizer_texts=list(request.module.TEXTS) * 5)
    return folder


@pytest.fixture(scope="module")
def reference(tiny_model):
    """(model, processor) of `tiny_model`, loaded in this process."""
    from vlmctl.inference import load_for_generation

    return load_for_generation(tiny_model, device="cpu", dtype="fp32")
