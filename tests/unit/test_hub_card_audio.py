"""The model card of an audio-language model (qwen2_audio's tiny preset, built by `vlmctl model build`): the Hub's
`audio-text-to-text` pipeline tag and a usage snippet that vanilla transformers runs on the built folder; image
models keep the image card."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from vlmctl.config import HubSection  # noqa: E402
from vlmctl.config.model import ModelSection  # noqa: E402
from vlmctl.hub import build_model_card  # noqa: E402

TEXTS = ["What is said in the audio? A tone.", "Transcribe the clip.", "la la la"] * 10

IMAGE_USAGE = """from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

processor = AutoProcessor.from_pretrained("alice/m")
model = AutoModelForImageTextToText.from_pretrained("alice/m", dtype="auto")
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(images=Image.open("image.jpg"), text=prompt, return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=64)
print(processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))"""


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory):
    from vlmctl.models import build_model

    folder = tmp_path_factory.mktemp("audio") / "model"
    build_model(ModelSection(preset="tiny-qwen2-audio", init="random", dtype="fp32", output_dir=folder), tokenizer_texts=TEXTS)
    return folder


def _usage(card) -> str:
    return card.text.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_audio_card_has_the_audio_tag_and_a_snippet_transformers_runs(audio_model, monkeypatch, capsys):
    card = build_model_card(audio_model, hub=HubSection(), repo_id="alice/tiny-audio")
    data = card.data.to_dict()
    assert data["pipeline_tag"] == "audio-text-to-text"
    assert "audio-text-to-text" in data["tags"] and "audio-language" in data["tags"]
    assert "image-text-to-text" not in data["tags"] and "vision-language" not in data["tags"]
    assert "An audio-language model trained with vlmctl" in card.text
    assert "audio encoder: `qwen2_audio_encoder`, language model: `qwen2`" in card.text
    usage = _usage(card)
    assert "AutoModelForMultimodalLM" in usage and '{"type": "audio"}' in usage and "processor(audio=audio" in usage
    assert "Image" not in usage and "image" not in usage

    # the snippet as a user runs it, on the built folder, with librosa.load stood in by a 1 s tone at the rate asked
    rates = []

    def load(path, sr):
        rates.append(sr)
        return (0.1 * np.sin(2 * np.pi * 440 * np.arange(sr) / sr)).astype(np.float32), sr

    monkeypatch.setitem(sys.modules, "librosa", types.SimpleNamespace(load=load))
    code = usage.replace('"alice/tiny-audio"', json.dumps(str(audio_model))).replace("max_new_tokens=64", "max_new_tokens=3")
    scope: dict = {}
    exec(compile(code, "usage", "exec"), scope)  # noqa: S102 - the card's own snippet
    assert rates == [16_000]
    assert type(scope["model"]).__name__ == "Qwen2AudioForConditionalGeneration"
    audio_token = scope["processor"].tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert int((scope["inputs"]["input_ids"] == audio_token).sum()) == 25  # 1 s at 16 kHz: 25 audio tokens
    assert scope["out"].shape[1] > scope["inputs"]["input_ids"].shape[1]


def test_audio_eval_results_use_the_asr_task_and_image_cards_are_unchanged(audio_model, tmp_path):
    (audio_model / "metrics.json").write_text(json.dumps({"task": "asr", "data": "val", "n": 4, "metrics": {"wer": 0.25}}))
    try:
        card = build_model_card(audio_model, hub=HubSection(datasets=["alice/clips"]), repo_id="alice/tiny-audio")
    finally:
        (audio_model / "metrics.json").unlink()
    result = card.data.eval_results[0]
    assert (result.task_type, result.metric_type, result.metric_value) == ("automatic-speech-recognition", "wer", 0.25)

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                                                    "vision_config": {"model_type": "siglip_vision_model"}, "text_config": {"model_type": "qwen2"}}))
    card = build_model_card(folder, hub=HubSection(), repo_id="alice/m")
    data = card.data.to_dict()
    assert data["pipeline_tag"] == "image-text-to-text" and {"vision-language", "image-text-to-text"} <= set(data["tags"])
    assert "A vision-language model trained with vlmctl" in card.text
    assert "vision encoder: `siglip_vision_model`, language model: `qwen2`" in card.text
    assert _usage(card) == IMAGE_USAGE


def test_a_composed_audio_model_names_its_whisper_checkpoint_and_llm(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2AudioForConditionalGeneration"], "model_type": "qwen2_audio"}))
    (folder / "vlmctl_model.json").write_text(json.dumps({"family": "qwen2_audio", "mode": "compose", "init": "pretrained",
                                                          "built_from": {"audio": "openai/whisper-tiny", "vision": None, "llm": "Qwen/Qwen3-0.6B"}}))
    card = build_model_card(folder, hub=HubSection(), repo_id="alice/m")
    assert card.data.base_model == ["Qwen/Qwen3-0.6B", "openai/whisper-tiny"] and card.data.base_model_relation == "finetune"
    assert "from the audio encoder [`openai/whisper-tiny`]" in card.text and "audio: `openai/whisper-tiny`" in card.text
    assert card.data.pipeline_tag == "audio-text-to-text"
