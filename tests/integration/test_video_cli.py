"""A mixed image + video data set end to end through the CLI: `data validate`, `data prepare` (tokens counted with
the configured tiny Qwen2.5-VL or Qwen3-VL, its tokenizer trained at prepare time), `model build`, the shards' token
counts against the built processor, and a few packed training steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("av")

from cli_runner import run_cli as run  # noqa: E402
from video_data import moving_square, png_bytes  # noqa: E402

TIMEOUT = 300


def _project(root: Path, preset: str) -> Path:
    raw = root / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "slow.mp4").write_bytes(moving_square(frames=8, width=64, height=48, fps=4))
    (raw / "fast.webm").write_bytes(moving_square(frames=16, width=48, height=48, fps=16, codec="libvpx", container="webm"))
    (raw / "broken.mp4").write_bytes(moving_square(frames=16)[:1200])
    (raw / "notes.mp4").write_text("not a video\n")
    (raw / "green.png").write_bytes(png_bytes(56))
    words = ["left", "right", "up", "down", "red", "green", "square", "moves"]
    records = []
    for i in range(12):
        kind = i % 4
        q, a = f"Where does square {i} go, {words[i % 8]}?", f"The {words[(i + 3) % 8]} square moves {words[i % 4]}."
        if kind == 0:
            records.append({"messages": [{"role": "user", "content": f"<video>{q}"}, {"role": "assistant", "content": a}], "videos": ["slow.mp4"]})
        elif kind == 1:
            records.append({"messages": [{"role": "user", "content": f"<image>What color, {i}?"}, {"role": "assistant", "content": a}],
                            "images": ["green.png"]})
        elif kind == 2:
            records.append({"messages": [{"role": "user", "content": f"<image>Compare with <video>{q}"}, {"role": "assistant", "content": a}],
                            "images": ["green.png"], "videos": ["fast.webm"]})
        else:
            records.append({"messages": [{"role": "user", "content": f"{q} {i}"}, {"role": "assistant", "content": a}]})
    records.append({"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "?"}], "videos": ["broken.mp4"]})
    records.append({"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "?"}], "videos": ["notes.mp4"]})
    (raw / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "vlmctl.yaml").write_text("""
project: {name: video}
data:
  sources: [{path: data/raw/mixed.jsonl, format: sharegpt}]
  prepared_dir: data/prepared
  val_ratio: 0
  max_length: 2048
  video: {fps: 4, max_frames: 8, min_pixels: 256, max_pixels: 3072}
model: {preset: PRESET, init: random, output_dir: model}
train: {stage: full, precision: fp32, learning_rate: 2.0e-3, tokens_per_batch: 2048, logging_steps: 1, num_workers: 0, output_dir: runs}
""".replace("PRESET", preset))
    return root / "vlmctl.yaml"


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("preset, name", [("tiny-qwen2.5-vl", "qwen2_5_vl"), ("tiny-qwen3-vl", "qwen3_vl")])
def test_mixed_image_and_video_data_validate_prepare_build_and_train(tmp_path, capsys, preset, name):
    import pyarrow.parquet as pq

    from vlmctl.data.collate import encode_sample
    from vlmctl.data.sample import Sample
    from vlmctl.models import load_processor
    from vlmctl.families import get_family

    config = _project(tmp_path, preset)
    raw_before = {p.name: p.read_bytes() for p in (tmp_path / "data" / "raw").iterdir()}

    code, out, err = run(["-c", str(config), "data", "validate", "--json"], capsys)
    report = json.loads(out)
    assert code == 1, err  # two defective videos
    assert report["kept"] == 12 and report["counts"] == {"corrupt_video": 2}
    assert {e["location"].rsplit(":", 1)[1] for e in report["examples"]["corrupt_video"]} == {"13", "14"}
    code, out, _ = run(["-c", str(config), "data", "validate"], capsys)
    assert code == 1 and "corrupt_video" in out and not (tmp_path / "data" / "prepared").exists()

    code, out, err = run(["-c", str(config), "data", "prepare", "--num-proc", "1", "--json"], capsys)
    assert code == 0, out + err
    manifest = json.loads(out)
    assert manifest["totals"]["kept"] == 12 and manifest["totals"]["rejected"] == {"corrupt_video": 2}
    videos = manifest["videos"]
    # slow.mp4: 2 s at 4 fps = 8 frames; fast.webm: 1 s = 4 frames
    assert videos["count"] == 6 and (videos["frames"]["min"], videos["frames"]["max"]) == (4, 8)
    assert videos["tokens_per_clip"]["count"] == 6 and videos["tokens_per_clip"]["min"] > 0
    assert manifest["tokens"]["count"] == 12 and manifest["tokens"]["tokenizer"]["converged"]

    code, out, err = run(["-c", str(config), "model", "build"], capsys)
    assert code == 0, out + err
    processor = load_processor(tmp_path / "model")
    family = get_family(name)
    shards = sorted((tmp_path / "data" / "prepared" / "train").glob("*.parquet"))
    samples = [Sample.from_row(r) for f in shards for r in pq.read_table(f).to_pylist()]
    assert sum(bool(s.videos) for s in samples) == 6
    for s in samples:  # the counts packing plans with are the lengths the collator produces
        assert s.num_tokens == encode_sample(s, processor, family).length, s.id

    code, out, err = run(["-c", str(config), "train", "--launcher", "none", "train.strategy=ddp", "train.max_steps=2",
                          "train.save_steps=100", "train.run_name=video"], capsys)
    assert code == 0, out + err
    rows = [json.loads(line) for line in (tmp_path / "runs" / "video" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["visual_tokens"] > 0 for r in rows)
    assert {p.name: p.read_bytes() for p in (tmp_path / "data" / "raw").iterdir()} == raw_before  # inputs untouched
