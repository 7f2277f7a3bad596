"""`vlmctl train` on compose models with the pixel-shuffle (Idefics3) and perceiver (Idefics2) connectors: stage `align` runs in process
and changes exactly the connector's weights; the exported model loads with vanilla transformers."""

from __future__ import annotations

import json

import pytest

from cli_runner import run_cli
from convert_helpers import TEXTS
from shapes_shards import write_shapes_shards


@pytest.mark.timeout(180)
def test_align_step_on_pixel_shuffle_changes_only_the_connector(tmp_path, capsys):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    write_shapes_shards(tmp_path / "data", 6, text_only_every=0)
    model = dict(vision="tiny", llm="tiny", init="random", projector="pixel_shuffle", output_dir=tmp_path / "model", dtype="fp32")
    build_model(ModelSection(**model), tokenizer_texts=TEXTS)
    (tmp_path / "vlmctl.yaml").write_text(f"""
project: {{name: ps}}
data: {{prepared_dir: data/prepared, max_length: 512}}
model: {{vision: tiny, llm: tiny, init: random, projector: pixel_shuffle, output_dir: model}}
train:
  stage: align
  strategy: ddp
  nproc_per_node: 1
  precision: fp32
  learning_rate: 1.0e-2
  warmup_ratio: 0.0
  micro_batch_size: 2
  packing: false
  max_steps: 1
  save_steps: 100
  logging_steps: 1
  num_workers: 0
  output_dir: runs
  run_name: align
""")
    code, out, err = run_cli(["-c", str(tmp_path / "vlmctl.yaml"), "train", "--launcher", "none"], capsys)
    assert code == 0, out + err
    before = AutoModelForImageTextToText.from_pretrained(tmp_path / "model").state_dict()
    final = tmp_path / "runs" / "align" / "final"
    after = AutoModelForImageTextToText.from_pretrained(final)
    assert type(after).__name__ == "Idefics3ForConditionalGeneration"
    changed = {n for n, t in after.state_dict().items() if not torch.equal(t, before[n])}
    assert changed == {"model.connector.modality_projection.proj.weight"}
    AutoProcessor.from_pretrained(final)


@pytest.mark.timeout(300)
def test_one_fsdp_align_step_on_perceiver_changes_only_the_connector(tmp_path, capsys):
    """`model.projector: perceiver` (Idefics2 layout): one FSDP2 step of stage `align` through `vlmctl train` on CPU
    (packed rows) trains every connector weight (modality projection, resampler latents and blocks) and nothing else."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    write_shapes_shards(tmp_path / "data", 6, text_only_every=0)
    model = dict(vision="tiny", llm="tiny", init="random", projector="perceiver", perceiver_queries=8, perceiver_depth=1,
                 perceiver_heads=4)
    build_model(ModelSection(**model, output_dir=tmp_path / "model", dtype="fp32"), tokenizer_texts=TEXTS)
    (tmp_path / "vlmctl.yaml").write_text(f"""
project: {{name: perceiver}}
data: {{prepared_dir: data/prepared, max_length: 256}}
model: {{vision: tiny, llm: tiny, init: random, projector: perceiver, perceiver_queries: 8, perceiver_depth: 1, perceiver_heads: 4, output_dir: model}}
train:
  stage: align
  strategy: fsdp
  nproc_per_node: 1
  precision: fp32
  learning_rate: 1.0e-2
  warmup_ratio: 0.0
  micro_batch_size: 2
  packing: true
  max_steps: 1
  save_steps: 100
  logging_steps: 1
  num_workers: 0
  output_dir: runs
  run_name: align
""")
    code, out, err = run_cli(["-c", str(tmp_path / "vlmctl.yaml"), "train", "--launcher", "none"], capsys)
    assert code == 0, out + err
    run = tmp_path / "runs" / "align"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] == rows[0]["loss"] > 0  # finite, not NaN
    assert rows[0]["visual_tokens"] == 6 * 8  # 6 images x perceiver_queries, counted by the family's rule
    state = json.loads((run / "checkpoints" / "checkpoint-1" / "trainer_state.json").read_text())
    assert (state["family"], state["strategy"], state["packing"]) == ("idefics2", "fsdp", True)
    before = AutoModelForImageTextToText.from_pretrained(tmp_path / "model").state_dict()
    after = AutoModelForImageTextToText.from_pretrained(run / "final")
    assert type(after).__name__ == "Idefics2ForConditionalGeneration"
    changed = {n for n, t in after.state_dict().items() if not torch.equal(t, before[n])}
    assert changed == {n for n in before if n.startswith("model.connector.")}
    assert "model.connector.perceiver_resampler.latents" in changed
    AutoProcessor.from_pretrained(run / "final")
