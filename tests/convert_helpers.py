"""Helpers shared by the convert tests and their distributed workers: the tiny model and its probe logits."""

from __future__ import annotations

from pathlib import Path

TEXTS = [
    "What color is the triangle? The triangle is red.",
    "What shape is the blue object? It is a circle.",
    "How many squares are there? There are 2 squares.",
    "Is the square left of the circle? yes no",
    "What is in the image? Describe the colors and shapes.",
] * 20


def make_tiny_model(out: Path, seed: int = 0) -> Path:
    """Build the tiny random LLaVA preset (model + processor, fp32) into `out` with `vlmctl model build`'s library."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    out = Path(out)
    build_model(ModelSection(preset="tiny", init="random", output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS, seed=seed)
    return out


def source_logits(model_dir: Path):
    """Probe logits [1, T, vocab] of an HF folder (or adapter folder) loaded with the Auto classes."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.convert import probe_inputs, probe_logits

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype="auto").eval()
    return probe_logits(model, probe_inputs(AutoProcessor.from_pretrained(str(model_dir))))
