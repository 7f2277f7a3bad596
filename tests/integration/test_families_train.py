"""End to end per family on CPU: build the family's tiny preset, train one step on 2 ranks with FSDP2 (`vlmctl train`
under torchrun, packed rows where the family packs, padded micro-batches otherwise), convert the run's DCP
checkpoint with `vlmctl convert`, and check that the export loads with vanilla `AutoModelForImageTextToText` and
gives the trained model's logits (the run's `final/` export) within fp32 tolerance. In process, packed rows of
image, text-only and two-image samples must give the padded batch's loss for every family that packs.

Every case has a timeout: a hang (e.g. a rank skipping the vision tower or an expert layer under FSDP) fails the
test instead of blocking the suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import run_cli
from convert_helpers import TEXTS
from shapes_shards import write_shapes_shards
from train_runner import RunsAhead, start_train

FAMILIES = ["internvl", "gemma3", "llava_next", "llava_onevision", "qwen3_vl_moe", "idefics2", "mistral3", "smolvlm", "qwen2_5_omni"]
RUN_TIMEOUT = 120


def _project(root: Path, preset: str) -> Path:
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    write_shapes_shards(root / "data", 12)
    build_model(ModelSection(preset=preset, init="random", output_dir=root / "model", dtype="fp32"), tokenizer_texts=TEXTS)
    (root / "vlmctl.yaml").write_text(f"""
project: {{name: fam}}
data: {{prepared_dir: data/prepared, max_length: 160}}
model: {{preset: {preset}, init: random, output_dir: model}}
train:
  stage: full
  strategy: fsdp
  nproc_per_node: 2
  precision: fp32
  learning_rate: 1.0e-2
  warmup_ratio: 0.0
  micro_batch_size: 2
  tokens_per_batch: 160
  max_steps: 1
  save_steps: 1
  logging_steps: 1
  num_workers: 0
  output_dir: runs
  run_name: one
""")
    return root


@pytest.fixture(scope="module")
def families_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def family_runs(families_root):
    """Each family's one-step run in its project `<families_root>/<family>`, started one family ahead of the test that
    reads it (RunsAhead): the next family's build and start-up overlap this family's step, convert and checks. Two
    runs share the cores, hence twice the time of one to wait for."""
    from vlmctl.families import get_family

    def start(name: str):
        (families_root / name).mkdir()
        project = _project(families_root / name, get_family(name).tiny_preset)
        return start_train(project / "vlmctl.yaml", "--launcher", "torchrun", "--nproc-per-node", "2")

    runs = RunsAhead({name: (lambda name=name: start(name)) for name in FAMILIES}, timeout=2 * RUN_TIMEOUT)
    yield runs
    runs.close()


def _probe_logits(folder: Path):
    """Probe logits of `folder` loaded with vanilla `AutoModelForImageTextToText` in fp32, on the probe inputs of its
    processor (`load_processor`: AutoProcessor, or its image-only variant without torchvision)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmctl.convert import probe_inputs, probe_logits
    from vlmctl.models.load import load_processor

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    return probe_logits(model, probe_inputs(load_processor(folder)))


def _changed_weights(before: Path, after: Path) -> int:
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(before / "model.safetensors")), load_file(str(after / "model.safetensors"))
    return sum(not torch.equal(a[k], b[k]) for k in a if k in b)


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
@pytest.mark.parametrize("name", FAMILIES)
def test_train_one_fsdp_step_then_convert_matches_the_trained_model(name, families_root, family_runs, tmp_path, capsys):
    from vlmctl.convert import compare
    from vlmctl.families import get_family

    spec = get_family(name)
    family_runs.output(name)
    project = families_root / name
    run = project / "runs" / "one"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] == rows[0]["loss"] > 0  # finite, not NaN
    state = json.loads((run / "checkpoints" / "checkpoint-1" / "trainer_state.json").read_text())
    assert (state["family"], state["world_size"], state["strategy"]) == (name, 2, "fsdp")
    assert state["packing"] is spec.supports_packing  # a family that cannot pack falls back to padded batches
    if not spec.supports_packing:  # the run plan says why
        packing = json.loads((run / "plan.json").read_text())["decisions"]["packing"]
        assert packing["value"] is False and f"{name} models cannot take packed rows" in packing["reason"]
    assert _changed_weights(project / "model", run / "final") > 0  # the step trained

    converted = tmp_path / "converted"
    code, stdout, err = run_cli(["convert", str(run / "checkpoints" / "checkpoint-1"), "-o", str(converted), "--dtype", "fp32"], capsys)
    assert code == 0, stdout + err
    result = compare(_probe_logits(run / "final"), _probe_logits(converted), "fp32")
    assert result.passed, result


def _png(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "gemma3"])  # gemma3: supports_packing=False
def test_packed_rows_give_the_padded_loss(name):
    import torch

    from vlmctl.config import ModelSection
    from vlmctl.data.collate import Collator, PackedCollator
    from vlmctl.data.sample import Sample
    from vlmctl.families import get_family
    from vlmctl.models.build import make_model, make_processor, plan_build
    from vlmctl.train.objectives import loss_sum

    spec = get_family(name)
    assert spec.supports_packing
    plan = plan_build(ModelSection(preset=spec.tiny_preset, init="random", dtype="fp32"))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    model = make_model(plan, processor).eval()

    def sample(i: int, sizes: list[tuple[int, int]], question: str = "What color is the triangle?") -> Sample:
        user = [{"type": "image", "index": k} for k in range(len(sizes))] + [{"type": "text", "text": question}]
        return Sample(id=str(i), images=[_png(w, h, (60 * i % 255, 100, 200)) for w, h in sizes], messages=[
            {"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": "red"}]}])

    samples = [sample(0, [(64, 64)]), sample(1, [(100, 60)]), sample(2, [], "How many circles are there?"),
               sample(3, [(37, 211), (64, 48)])]
    packed = PackedCollator(processor, spec, tokens_per_batch=4096)(samples)
    hook = spec.position_hook(model, processor.tokenizer.convert_tokens_to_ids(spec.image_token))
    with torch.no_grad():
        padded_loss = float(loss_sum(model, Collator(processor, spec)(samples)))
        packed_loss = float(loss_sum(model, hook(packed) if hook else packed))
    assert packed["num_samples"] == 4 and packed["num_dummy_images"] == 0
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
