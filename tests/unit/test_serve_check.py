"""`vlmctl serve --check`: it passes on the tiny preset of each image family, and fails on a run's export whose chat
template was changed after training, or on a folder whose generation prompt is not the one its template trains."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cli_runner import run_cli as run
from vlmctl.serve.check import PROBES, check_serving, training_reference

TEXTS = ["What color is the square?", "Name a primary color.", "What shape is in the picture?", "A square.",
         "And what color is it?", "red blue green"]
# the tiny preset of every family that takes images (the Omni thinkers and Phi-4-multimodal too); about a second each on CPU
PRESETS = ["tiny", "tiny-qwen2.5-vl", "tiny-idefics2", "tiny-idefics3", "tiny-smolvlm", "tiny-gemma3", "tiny-internvl",
           "tiny-llava-next", "tiny-llava-onevision", "tiny-mistral3", "tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe",
           "tiny-qwen2.5-omni", "tiny-qwen3-omni", "tiny-phi4-multimodal"]


def build(preset: str, folder: Path) -> Path:
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    build_model(ModelSection(preset=preset, init="random", output_dir=folder, dtype="fp32"), tokenizer_texts=TEXTS * 5)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build("tiny", tmp_path_factory.mktemp("check") / "tiny")


@pytest.mark.parametrize("preset", PRESETS)
def test_check_passes_on_the_tiny_preset(preset, tmp_path, tiny):
    folder = tiny if preset == "tiny" else build(preset, tmp_path / preset)
    report = check_serving(folder, device="cpu", dtype="fp32")
    assert [p.name for p in report.probes] == list(PROBES)
    assert report.ok, [p.failures for p in report.probes]
    assert all(p.served == p.generated for p in report.probes)
    assert all(p.max_logprob_error <= 1e-4 for p in report.probes)


def test_check_fails_on_an_export_whose_template_changed_after_training(tiny, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "run1"
    shutil.copytree(tiny, run_dir / "final")
    (run_dir / "config.yaml").write_text(f"model:\n  output_dir: {tiny}\n")
    assert training_reference(run_dir / "final") == tiny
    template = run_dir / "final" / "chat_template.jinja"
    original = template.read_text()
    # every user turn now says "User:": the export renders prompts the model never saw in training
    template.write_text(original.replace("'<|im_start|>' + message['role'] + '\\n'", "'<|im_start|>' + message['role'] + '\\nUser: '"))
    assert template.read_text() != original
    code, out, _ = run(["serve", str(run_dir / "final"), "--check", "--device", "cpu", "--dtype", "fp32"], capsys)
    assert code == 1 and "FAIL" in out and "differs from the trainer's" in out
    template.write_text(original)  # as trained: the check passes again
    code, out, _ = run(["serve", str(run_dir / "final"), "--check", "--device", "cpu", "--dtype", "fp32"], capsys)
    assert code == 0, out


def test_check_fails_when_the_generation_prompt_is_not_the_trained_one(tiny, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text().replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant:\\n'"))
    report = check_serving(folder, device="cpu", dtype="fp32")
    assert training_reference(folder) == folder.resolve()
    assert not report.ok and all(any(f.startswith("prompt:") for f in p.failures) for p in report.probes)


def test_the_presets_checked_cover_every_family_that_takes_images():
    from vlmctl.config import ModelSection
    from vlmctl.data.modalities import get_unit
    from vlmctl.families.registry import FAMILIES
    from vlmctl.models.build import plan_build

    checked = {plan_build(ModelSection(preset=p, init="random")).family.name for p in PRESETS}
    assert checked == {name for name, spec in FAMILIES.items() if get_unit("image").accepted_by(spec)}
