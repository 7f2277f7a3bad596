"""An audio data set end to end through the CLI on CPU: `data validate` (a corrupt clip and an empty one found),
`data prepare` (tokens counted with the configured tiny Qwen2-Audio, its tokenizer trained at prepare time),
`model build`, one FSDP2 training step on 2 ranks (torchrun, gloo) on packed rows, `vlmctl convert` of the DCP
checkpoint, and the export loaded with vanilla transformers (`AutoModelForMultimodalLM` + `AutoProcessor`) giving
the run's `final/` logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from audio_data import encode, flac, tone, wav  # noqa: E402
from cli_runner import run_cli as run  # noqa: E402
from train_runner import run_train  # noqa: E402

TIMEOUT = 240
RUN_TIMEOUT = 150


def _project(root: Path) -> Path:
    raw = root / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "low.wav").write_bytes(wav(1.0, 16_000, freq=220))
    (raw / "high.flac").write_bytes(flac(0.6, 16_000, freq=880))
    (raw / "stereo.wav").write_bytes(encode(tone(1.2, 44_100, freq=440, channels=2), 44_100, "WAV", "PCM_24"))
    (raw / "broken.wav").write_bytes(wav(1.0)[:6_000])
    (raw / "empty.wav").write_bytes(wav(0.0))
    words = {"low.wav": "low", "high.flac": "high", "stereo.wav": "middle"}
    records = []
    for i in range(9):
        clip = list(words)[i % 3]
        if i % 4 == 3:
            records.append({"messages": [{"role": "user", "content": f"Say something {i}."}, {"role": "assistant", "content": "Something."}]})
        records.append({"messages": [{"role": "user", "content": f"<audio>Is tone {i} high or low?"},
                                     {"role": "assistant", "content": f"It is {words[clip]}."}], "audios": [clip]})
    records.append({"messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "?"}], "audios": ["broken.wav"]})
    records.append({"messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "?"}], "audios": ["empty.wav"]})
    (raw / "tones.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "vlmctl.yaml").write_text("""
project: {name: audio}
data:
  sources: [{path: data/raw/tones.jsonl, format: sharegpt}]
  prepared_dir: data/prepared
  val_ratio: 0
  max_length: 512
  audio: {max_seconds: 2}
model: {preset: tiny-qwen2-audio, init: random, output_dir: model, dtype: fp32}
train:
  stage: full
  strategy: fsdp
  nproc_per_node: 2
  precision: fp32
  packing: true
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
    return root / "vlmctl.yaml"


def _train(config: Path) -> str:
    return run_train(config, "--launcher", "torchrun", "--nproc-per-node", "2", timeout=RUN_TIMEOUT)


def _vanilla_logits(folder: Path):
    """Logits of `folder` loaded with plain transformers auto classes on a fixed clip and question."""
    import torch
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    model = AutoModelForMultimodalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(str(folder))
    assert type(model).__name__ == "Qwen2AudioForConditionalGeneration" and type(processor).__name__ == "Qwen2AudioProcessor"
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "High or low?"}]}],
                                         add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], audio=[tone(0.8, 16_000, freq=660)], sampling_rate=16_000, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_audio_data_validate_prepare_build_train_fsdp_convert_and_load_in_transformers(tmp_path, capsys):
    import pyarrow.parquet as pq
    import torch

    from vlmctl.data.collate import encode_sample
    from vlmctl.data.sample import Sample
    from vlmctl.families import get_family
    from vlmctl.models import load_processor

    config = _project(tmp_path)
    raw_before = {p.name: p.read_bytes() for p in (tmp_path / "data" / "raw").iterdir()}

    code, out, err = run(["-c", str(config), "data", "validate", "--json"], capsys)
    report = json.loads(out)
    assert code == 1, err
    assert report["kept"] == 11 and report["counts"] == {"corrupt_audio": 1, "audio_too_short": 1}
    assert "broken.wav" in report["examples"]["corrupt_audio"][0]["detail"]

    code, out, err = run(["-c", str(config), "data", "prepare", "--num-proc", "1", "--json"], capsys)
    assert code == 0, out + err
    manifest = json.loads(out)
    assert manifest["totals"]["kept"] == 11 and manifest["totals"]["rejected"] == {"corrupt_audio": 1, "audio_too_short": 1}
    audios = manifest["audios"]
    assert audios["count"] == 9 and audios["original_sampling_rate"] == {"16000": 6, "44100": 3}
    # 25 tokens per second of 16 kHz audio: 0.6 s -> 15, 1.0 s -> 25, 1.2 s -> 30
    assert (audios["tokens_per_clip"]["min"], audios["tokens_per_clip"]["max"], audios["tokens_per_clip"]["count"]) == (15, 30, 9)
    assert manifest["tokens"]["family"] == "qwen2_audio" and manifest["tokens"]["tokenizer"]["converged"]

    code, out, err = run(["-c", str(config), "model", "build"], capsys)
    assert code == 0, out + err
    processor = load_processor(tmp_path / "model")
    family = get_family("qwen2_audio")
    shards = sorted((tmp_path / "data" / "prepared" / "train").glob("*.parquet"))
    samples = [Sample.from_row(r) for f in shards for r in pq.read_table(f).to_pylist()]
    assert sum(bool(s.audios) for s in samples) == 9
    for s in samples:  # the counts the batches are planned with are the lengths the collator produces
        assert s.num_tokens == encode_sample(s, processor, family).length, s.id

    out = _train(config)
    assert "cannot take packed rows" not in out
    run_dir = tmp_path / "runs" / "one"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] == rows[0]["loss"] > 0 and rows[0]["visual_tokens"] > 0
    state = json.loads((run_dir / "checkpoints" / "checkpoint-1" / "trainer_state.json").read_text())
    assert (state["family"], state["world_size"], state["strategy"], state["packing"]) == ("qwen2_audio", 2, "fsdp", True)

    converted = tmp_path / "converted"
    code, stdout, err = run(["convert", str(run_dir / "checkpoints" / "checkpoint-1"), "-o", str(converted), "--dtype", "fp32"], capsys)
    assert code == 0, stdout + err
    trained, exported, built = (_vanilla_logits(p) for p in (run_dir / "final", converted, tmp_path / "model"))
    assert torch.allclose(trained, exported, atol=1e-5) and not torch.allclose(trained, built, atol=1e-3)  # the step trained
    assert {p.name: p.read_bytes() for p in (tmp_path / "data" / "raw").iterdir()} == raw_before  # inputs untouched
