"""An audio + image data set through the CLI with the phi4_multimodal family on CPU: `data prepare` (tokens counted with
the tiny preset's processor, its tokenizer trained at prepare time), `model build`, one FSDP2 training step on 2 ranks
(torchrun, gloo) on packed rows of audio, image and image + audio samples (each sample's clips projected by its own
images), `vlmctl convert` of the DCP checkpoint, and the export loaded with vanilla transformers (`Phi4MultimodalForCausalLM`) giving
the run's `final/` logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from omni_data import train_two_ranks, vanilla_logits, write_audio_image_data  # noqa: E402
from cli_runner import run_cli as run  # noqa: E402

TIMEOUT = 240
RUN_TIMEOUT = 150


def _project(root: Path) -> Path:
    write_audio_image_data(root)
    (root / "vlmctl.yaml").write_text("""
project: {name: phi4}
data:
  sources: [{path: data/raw/mixed.jsonl, format: sharegpt}]
  prepared_dir: data/prepared
  val_ratio: 0
  max_length: 2048
  audio: {max_seconds: 2}
model: {preset: tiny-phi4-multimodal, init: random, output_dir: model, dtype: fp32}
train:
  stage: full
  strategy: fsdp
  nproc_per_node: 2
  precision: fp32
  packing: true
  learning_rate: 1.0e-2
  warmup_ratio: 0.0
  micro_batch_size: 2
  tokens_per_batch: 2048
  max_steps: 1
  save_steps: 1
  logging_steps: 1
  num_workers: 0
  output_dir: runs
  run_name: one
""")
    return root / "vlmctl.yaml"


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_phi4_audio_and_image_data_prepare_build_train_fsdp_convert_and_load_in_transformers(tmp_path, capsys):
    import pyarrow.parquet as pq
    import torch

    from vlmctl.data.collate import encode_sample
    from vlmctl.data.sample import Sample
    from vlmctl.families import get_family
    from vlmctl.models import load_processor

    config = _project(tmp_path)
    code, out, err = run(["-c", str(config), "data", "prepare", "--num-proc", "1", "--json"], capsys)
    assert code == 0, out + err
    manifest = json.loads(out)
    assert manifest["totals"]["kept"] == 10 and manifest["tokens"]["family"] == "phi4_multimodal"
    # 8 frames per token: 0.6 s (58 frames) -> 8, 1.0 s (98 frames) -> 13
    clips = manifest["audios"]["tokens_per_clip"]
    assert (clips["min"], clips["max"]) == (8, 13)

    code, out, err = run(["-c", str(config), "model", "build"], capsys)
    assert code == 0, out + err
    processor, family = load_processor(tmp_path / "model"), get_family("phi4_multimodal")
    shards = sorted((tmp_path / "data" / "prepared" / "train").glob("*.parquet"))
    samples = [Sample.from_row(r) for f in shards for r in pq.read_table(f).to_pylist()]
    assert (sum(bool(s.images) and bool(s.audios) for s in samples), sum(bool(s.images) for s in samples)) == (3, 7)
    for s in samples:  # the counts the batches are planned with are the lengths the collator produces
        assert s.num_tokens == encode_sample(s, processor, family).length, s.id

    out = train_two_ranks(config, RUN_TIMEOUT)
    assert "cannot take packed rows" not in out
    run_dir = tmp_path / "runs" / "one"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] == rows[0]["loss"] > 0 and rows[0]["visual_tokens"] > 0
    assert json.loads((run_dir / "plan.json").read_text())["decisions"]["packing"]["value"] is True
    state = json.loads((run_dir / "checkpoints" / "checkpoint-1" / "trainer_state.json").read_text())
    assert (state["family"], state["world_size"], state["strategy"], state["packing"]) == ("phi4_multimodal", 2, "fsdp", True)

    converted = tmp_path / "converted"
    code, stdout, err = run(["convert", str(run_dir / "checkpoints" / "checkpoint-1"), "-o", str(converted), "--dtype", "fp32"], capsys)
    assert code == 0, stdout + err
    trained, exported, built = (vanilla_logits(p, 'Phi4MultimodalForCausalLM', '<|audio|>') for p in (run_dir / "final", converted, tmp_path / "model"))
    assert torch.allclose(trained, exported, atol=1e-5) and not torch.allclose(trained, built, atol=1e-3)  # the step trained
