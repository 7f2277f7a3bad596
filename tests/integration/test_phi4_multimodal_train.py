"""An audio + image data set through the CLI with the phi4_multimodal family on CPU: `data prepare` (tokens counted with
the tiny preset's processor, its tokenizer trained at prepare time), `model build`, one FSDP2 training step on 2 ranks
(torchrun, gloo) on padded micro-batches of audio, image and text samples (the family refuses packed rows), `vlmctl
convert` of the DCP checkpoint, and the export loaded with vanilla transformers (`Phi4MultimodalForCausalLM`) giving
the run's `final/` logits."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from audio_data import flac, tone, wav  # noqa: E402
from cli_runner import run_cli as run  # noqa: E402

TIMEOUT = 240
RUN_TIMEOUT = 150


def _png(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def _project(root: Path) -> Path:
    raw = root / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "low.wav").write_bytes(wav(1.0, 16_000, freq=220))
    (raw / "high.flac").write_bytes(flac(0.6, 16_000, freq=880))
    (raw / "red.png").write_bytes(_png(64, 64, (220, 30, 30)))
    (raw / "blue.png").write_bytes(_png(90, 50, (30, 30, 220)))
    records = []
    for i in range(10):
        clip, image = ["low.wav", "high.flac"][i % 2], ["red.png", "blue.png"][i % 2]
        if i % 3 == 0:
            records.append({"messages": [{"role": "user", "content": f"<image>What color is picture {i}?"},
                                         {"role": "assistant", "content": "Red." if i % 2 == 0 else "Blue."}], "images": [image]})
        elif i % 3 == 1:
            records.append({"messages": [{"role": "user", "content": f"<audio>Is tone {i} high or low?"},
                                         {"role": "assistant", "content": "Low." if i % 2 == 0 else "High."}], "audios": [clip]})
        else:
            records.append({"messages": [{"role": "user", "content": f"<image><audio>Picture and tone {i}?"},
                                         {"role": "assistant", "content": "Both."}], "images": [image], "audios": [clip]})
    (raw / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
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
  packing: false
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


def _train(config: Path) -> str:
    """`vlmctl train` under torchrun (2 ranks, gloo) in its own process group, killed with its ranks on a timeout."""
    from vlmctl.distributed.env import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vlmctl", "-c", str(config), "train", "--launcher", "torchrun", "--nproc-per-node", "2",
           "--master-port", str(free_port())]
    proc = subprocess.Popen(cmd, cwd=config.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"training did not finish within {RUN_TIMEOUT}s (hang?):\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def _vanilla_logits(folder: Path):
    """Logits of `folder` loaded with vanilla transformers' class on a fixed image, clip and question (the processor
    through vlmctl: transformers' own image processor needs torchvision)."""
    import torch
    from PIL import Image
    from transformers import Phi4MultimodalForCausalLM

    from vlmctl.models import load_processor

    model = Phi4MultimodalForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    processor = load_processor(folder)
    content = [{"type": "image"}, {"type": "text", "text": "<|audio|>High or low?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.new("RGB", (64, 64), (10, 200, 10))], audio=[tone(0.8, 16_000, freq=660)],
                       sampling_rate=16_000, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits


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

    out = _train(config)
    run_dir = tmp_path / "runs" / "one"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] == rows[0]["loss"] > 0 and rows[0]["visual_tokens"] > 0
    state = json.loads((run_dir / "checkpoints" / "checkpoint-1" / "trainer_state.json").read_text())
    assert (state["family"], state["world_size"], state["strategy"], state["packing"]) == ("phi4_multimodal", 2, "fsdp", False)

    converted = tmp_path / "converted"
    code, stdout, err = run(["convert", str(run_dir / "checkpoints" / "checkpoint-1"), "-o", str(converted), "--dtype", "fp32"], capsys)
    assert code == 0, stdout + err
    trained, exported, built = (_vanilla_logits(p) for p in (run_dir / "final", converted, tmp_path / "model"))
    assert torch.allclose(trained, exported, atol=1e-5) and not torch.allclose(trained, built, atol=1e-3)  # the step trained
