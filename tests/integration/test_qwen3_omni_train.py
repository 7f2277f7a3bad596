"""An audio + image data set through the CLI with the qwen3_omni family (Qwen3-Omni's thinker) on CPU: `data prepare`
(tokens counted with the tiny preset's processor, its tokenizer trained at prepare time), `model build`, one FSDP2
training step on 2 ranks (torchrun, gloo) on packed rows of audio, image and text samples (mixture-of-experts layers
as FSDP units, TMRoPE positions from the family's hook, the cost model's FLOPs in the metrics), `vlmctl convert` of
the DCP checkpoint, and the export loaded with vanilla transformers (`Qwen3OmniMoeThinkerForConditionalGeneration`)
giving the run's `final/` logits; and a video data set (videos alone, with an audio clip, with an image) prepared,
built and trained for two packed steps in one process."""

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
project: {name: omni3}
data:
  sources: [{path: data/raw/mixed.jsonl, format: sharegpt}]
  prepared_dir: data/prepared
  val_ratio: 0
  max_length: 512
  audio: {max_seconds: 2}
model: {preset: tiny-qwen3-omni, init: random, output_dir: model, dtype: fp32}
train:
  stage: full
  strategy: fsdp
  nproc_per_node: 2
  precision: fp32
  packing: true
  learning_rate: 1.0e-2
  warmup_ratio: 0.0
  micro_batch_size: 2
  tokens_per_batch: 200
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
def test_qwen3_omni_audio_and_image_data_prepare_build_train_fsdp_packed_convert_and_load_in_transformers(tmp_path, capsys):
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
    assert manifest["totals"]["kept"] == 10 and manifest["tokens"]["family"] == "qwen3_omni"
    # 1 s chunks of 13 tokens: 0.6 s (60 frames) -> 8, 1.0 s -> 13
    clips = manifest["audios"]["tokens_per_clip"]
    assert (clips["min"], clips["max"]) == (8, 13)

    code, out, err = run(["-c", str(config), "model", "build"], capsys)
    assert code == 0, out + err
    processor, family = load_processor(tmp_path / "model"), get_family("qwen3_omni")
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
    state = json.loads((run_dir / "checkpoints" / "checkpoint-1" / "trainer_state.json").read_text())
    assert (state["family"], state["world_size"], state["strategy"], state["packing"]) == ("qwen3_omni", 2, "fsdp", True)

    converted = tmp_path / "converted"
    code, stdout, err = run(["convert", str(run_dir / "checkpoints" / "checkpoint-1"), "-o", str(converted), "--dtype", "fp32"], capsys)
    assert code == 0, stdout + err
    trained, exported, built = (vanilla_logits(p, 'Qwen3OmniMoeThinkerForConditionalGeneration', '<|audio_start|><|audio_pad|><|audio_end|>') for p in (run_dir / "final", converted, tmp_path / "model"))
    assert torch.allclose(trained, exported, atol=1e-5) and not torch.allclose(trained, built, atol=1e-3)  # the step trained


def _video_project(root: Path) -> Path:
    """Video, video + audio, image + video and text samples (ShareGPT), and a one-process packed training run."""
    from audio_data import wav
    from omni_data import png
    from video_data import moving_square

    raw = root / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "slow.mp4").write_bytes(moving_square(frames=8, width=64, height=48, fps=4))
    (raw / "fast.mp4").write_bytes(moving_square(frames=16, width=48, height=48, fps=16))
    (raw / "tone.wav").write_bytes(wav(1.0, 16_000, freq=440))
    (raw / "red.png").write_bytes(png(64, 64, (220, 30, 30)))
    records = []
    for i in range(8):
        clip, answer = ["slow.mp4", "fast.mp4"][i % 2], f"The square moves right, {i}."
        if i % 4 == 0:
            records.append({"messages": [{"role": "user", "content": f"<video>Where does square {i} go?"},
                                         {"role": "assistant", "content": answer}], "videos": [clip]})
        elif i % 4 == 1:
            records.append({"messages": [{"role": "user", "content": f"<video><audio>Square and tone {i}?"},
                                         {"role": "assistant", "content": answer}], "videos": [clip], "audios": ["tone.wav"]})
        elif i % 4 == 2:
            records.append({"messages": [{"role": "user", "content": f"<image>Compare with <video>{i}"},
                                         {"role": "assistant", "content": answer}], "images": ["red.png"], "videos": [clip]})
        else:
            records.append({"messages": [{"role": "user", "content": f"Where does square {i} go?"}, {"role": "assistant", "content": answer}]})
    (raw / "videos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "vlmctl.yaml").write_text("""
project: {name: omni3video}
data:
  sources: [{path: data/raw/videos.jsonl, format: sharegpt}]
  prepared_dir: data/prepared
  val_ratio: 0
  max_length: 512
  audio: {max_seconds: 2}
  video: {fps: 4, max_frames: 8, min_pixels: 256, max_pixels: 3072}
model: {preset: tiny-qwen3-omni, init: random, output_dir: model, dtype: fp32}
train: {stage: full, precision: fp32, packing: true, learning_rate: 2.0e-3, tokens_per_batch: 512, logging_steps: 1,
        num_workers: 0, output_dir: runs}
""")
    return root / "vlmctl.yaml"


@pytest.mark.timeout(TIMEOUT)
def test_qwen3_omni_video_data_prepare_build_and_train_packed(tmp_path, capsys):
    """Videos through the CLI on a machine without torchvision: prepare counts their tokens with the family's video
    rule (each shard's count is the collated length), and two packed training steps in one process see video tokens."""
    pytest.importorskip("av")
    import pyarrow.parquet as pq

    from vlmctl.data.collate import encode_sample
    from vlmctl.data.sample import Sample
    from vlmctl.families import get_family
    from vlmctl.models import load_processor

    config = _video_project(tmp_path)
    code, out, err = run(["-c", str(config), "data", "prepare", "--num-proc", "1", "--json"], capsys)
    assert code == 0, out + err
    manifest = json.loads(out)
    assert manifest["totals"]["kept"] == 8 and manifest["videos"]["count"] == 6 and manifest["videos"]["tokens_per_clip"]["min"] > 0
    code, out, err = run(["-c", str(config), "model", "build"], capsys)
    assert code == 0, out + err
    processor, family = load_processor(tmp_path / "model"), get_family("qwen3_omni")
    assert processor.video_processor.size == {"shortest_edge": 4096, "longest_edge": 16384}  # saved and read back
    shards = sorted((tmp_path / "data" / "prepared" / "train").glob("*.parquet"))
    samples = [Sample.from_row(r) for f in shards for r in pq.read_table(f).to_pylist()]
    assert sum(bool(s.videos) for s in samples) == 6 and sum(bool(s.videos) and bool(s.audios) for s in samples) == 2
    for s in samples:  # the counts packing plans with are the lengths the collator produces
        enc = encode_sample(s, processor, family)
        assert s.num_tokens == enc.length, s.id
        if s.videos:
            assert enc.media_inputs["video"]["video_second_per_grid"].tolist() == pytest.approx([0.5])  # 2 frames at 4 fps

    code, out, err = run(["-c", str(config), "train", "--launcher", "none", "train.strategy=ddp", "train.max_steps=2",
                          "train.save_steps=100", "train.run_name=video"], capsys)
    assert code == 0, out + err
    assert "cannot take packed rows" not in out + err
    rows = [json.loads(line) for line in (tmp_path / "runs" / "video" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["visual_tokens"] > 0 and r["loss"] == r["loss"] > 0 for r in rows)
