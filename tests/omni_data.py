"""One audio + image data set and the steps the omni families' CLI tests share (tests/integration/test_audio_omni_cli.py,
test_qwen3_omni_train.py, test_phi4_multimodal_train.py): the raw files of a prepare, a 2-rank torchrun training
run, and the logits of a folder loaded with a vanilla transformers class."""

from __future__ import annotations

import io
import json
from pathlib import Path


from audio_data import flac, tone, wav


def png(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def write_audio_image_data(root: Path) -> None:
    """`root/data/raw/mixed.jsonl` (ShareGPT messages): 10 samples of an image, an audio clip, or both, with their
    two WAV/FLAC clips and two PNG images."""
    raw = root / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "low.wav").write_bytes(wav(1.0, 16_000, freq=220))
    (raw / "high.flac").write_bytes(flac(0.6, 16_000, freq=880))
    (raw / "red.png").write_bytes(png(64, 64, (220, 30, 30)))
    (raw / "blue.png").write_bytes(png(90, 50, (30, 30, 220)))
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


def train_two_ranks(config: Path, timeout: float) -> str:
    """`vlmctl train` under torchrun (2 ranks, gloo), killed with its ranks after `timeout` seconds; returns its
    output."""
    from train_runner import run_train

    return run_train(config, "--launcher", "torchrun", "--nproc-per-node", "2", timeout=timeout)


def vanilla_logits(folder: Path, model_class: str, audio_prompt: str):
    """Logits of `folder` loaded with transformers' `model_class` on a fixed image, clip and question
    (`audio_prompt` + "High or low?"), the processor loaded through vlmctl (transformers' own processors of these
    families need torchvision)."""
    import torch
    import transformers
    from PIL import Image

    from vlmctl.models import load_processor

    model = getattr(transformers, model_class).from_pretrained(str(folder), dtype=torch.float32).eval()
    processor = load_processor(folder)
    content = [{"type": "image"}, {"type": "text", "text": f"{audio_prompt}High or low?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.new("RGB", (64, 64), (10, 200, 10))], audio=[tone(0.8, 16_000, freq=660)],
                       sampling_rate=16_000, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits
