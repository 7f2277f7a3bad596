"""`vlmctl eval` on a prepared val split of video questions, end to end through the CLI: `data prepare` (clips
sampled by the project's data.video), `model build` (the tiny Qwen2.5-VL preset, random init), `eval --data val`;
every sample's clip reaches the model as the processor's video tensors and the report scores every sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("av")

from cli_runner import run_cli as run  # noqa: E402
from video_data import moving_square  # noqa: E402

TIMEOUT = 300


def _project(root: Path) -> Path:
    raw = root / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "slow.mp4").write_bytes(moving_square(frames=8, width=64, height=48, fps=4))
    (raw / "fast.webm").write_bytes(moving_square(frames=16, width=48, height=48, fps=16, codec="libvpx", container="webm"))
    words = ["left", "right", "up", "down"]
    records = [{"messages": [{"role": "user", "content": f"<video>Where does square {i} go?"},
                             {"role": "assistant", "content": words[i % 4]}],
                "videos": ["slow.mp4" if i % 2 else "fast.webm"]} for i in range(16)]
    (raw / "videos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "vlmctl.yaml").write_text("""
project: {name: video-eval}
data:
  sources: [{path: data/raw/videos.jsonl, format: sharegpt}]
  prepared_dir: data/prepared
  val_ratio: 0.4
  max_length: 2048
  video: {fps: 4, max_frames: 8, min_pixels: 256, max_pixels: 3072}
model: {preset: tiny-qwen2.5-vl, init: random, output_dir: model}
eval: {output_dir: evals}
""")
    return root / "vlmctl.yaml"


@pytest.mark.timeout(TIMEOUT)
def test_eval_on_a_prepared_val_split_of_videos(tmp_path, capsys, monkeypatch):
    import pyarrow.parquet as pq

    from vlmctl.data.sample import Sample
    from vlmctl.inference import inputs

    config = _project(tmp_path)
    code, out, err = run(["-c", str(config), "data", "prepare", "--num-proc", "1", "--json"], capsys)
    assert code == 0, out + err
    val = [Sample.from_row(r) for f in sorted((tmp_path / "data" / "prepared" / "val").glob("*.parquet"))
           for r in pq.read_table(f).to_pylist()]
    assert len(val) >= 2 and all(len(s.videos) == 1 for s in val)
    code, out, err = run(["-c", str(config), "model", "build"], capsys)
    assert code == 0, out + err

    # what the processor made of each generation batch: the video tensors the model is called with
    seen: list[dict] = []
    to_model = inputs.to_model

    def record(model, tensors):
        moved = to_model(model, tensors)
        seen.append({k: tuple(v.shape) for k, v in moved.items() if hasattr(v, "shape")})
        return moved

    monkeypatch.setattr(inputs, "to_model", record)
    folder = tmp_path / "evals" / "val"
    code, out, err = run(["-c", str(config), "eval", "--data", "val", "--task", "vqa", "--batch-size", "4",
                          "--max-new-tokens", "3", "-o", str(folder), "--json"], capsys)
    assert code == 0, out + err
    # every sample's clip went in: one video grid per sample, its patches for the vision tower
    assert sum(s["video_grid_thw"][0] for s in seen) == len(val)
    assert all(s["pixel_values_videos"][0] > 0 and "pixel_values" not in s for s in seen)
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["task"] == "vqa" and metrics["n"] == len(val) and metrics["metrics"]
    rows = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(s.id for s in val)
    assert all(isinstance(r["score"], (int, float)) and r["prompt"].count("<|video_pad|>") == 1 for r in rows)
    assert (folder / "report.html").is_file()


def test_eval_on_a_raw_file_samples_its_videos_by_the_projects_data_video(tmp_path):
    """`eval --data FILE` on a file that is not prepared reads it as `data prepare` would, with the project's
    data.video settings: a cap of 2 frames gives 2-frame clips where the defaults keep all 8 of the 4 fps clip."""
    from vlmctl.config.data import DataVideo
    from vlmctl.data.modalities.video import clip_shape
    from vlmctl.evaluation import runner

    _project(tmp_path)
    raw = str(tmp_path / "data" / "raw" / "videos.jsonl")
    media = [tmp_path / "data" / "raw"]

    def frames(video):
        samples = runner.load_samples(raw, tmp_path / "unused", limit=4, media_roots=media, video=video)
        assert len(samples) == 4 and not samples.skipped
        return {clip_shape(s.videos[0])[0] for s in samples}

    capped = DataVideo(fps=4, max_frames=2, min_frames=2, min_pixels=256, max_pixels=3072)
    assert frames(capped) == {2}
    assert max(frames(None)) > 2
