"""Audio in generation and chat on CPU: the tiny Qwen2-Audio preset (random init) answers requests with clips written
by tests/audio_data.py, the clips reach its audio tower as the data pipeline hands them over (mono, resampled to
16 kHz, the family's audio prompt in the text), `vlmctl generate` reads them from a data file and `vlmctl chat`
from --audio and /audio; a vision-language model given audio is one usage-error panel (exit 2)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from audio_data import dominant_hz, encode, flac, tone, wav  # noqa: E402
from cli_runner import run_cli as run  # noqa: E402

from vlmctl.errors import DataError, UsageError  # noqa: E402
from vlmctl.inference import (  # noqa: E402
    ChatSession,
    GenerationRequest,
    generate,
    load_for_generation,
    parse_input,
    render_inputs,
    request_from_sample,
    stream_generate,
)

TEXTS = ["What is that sound? A tone.", "Transcribe the clip.", "Which one is higher? The second."] * 10
AUDIO_PROMPT = "<|audio_bos|><|AUDIO|><|audio_eos|>"


def _ask(text: str, clips: int = 1) -> dict:
    return {"role": "user", "content": [*({"type": "audio", "index": k} for k in range(clips)), {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory) -> Path:
    """The tiny Qwen2-Audio preset, random init, fp32: 2 s windows of 32 mel bins at 16 kHz."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    folder = tmp_path_factory.mktemp("audio") / "model"
    build_model(ModelSection(preset="tiny-qwen2-audio", init="random", output_dir=folder, dtype="fp32"), tokenizer_texts=TEXTS)
    return folder


@pytest.fixture(scope="module")
def loaded(audio_model):
    return load_for_generation(audio_model, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def llava_model(tmp_path_factory) -> Path:
    """The tiny LLaVA preset (images only)."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    folder = tmp_path_factory.mktemp("llava") / "model"
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder), tokenizer_texts=TEXTS)
    return folder


@pytest.fixture
def tower_calls(loaded):
    """The input_features the audio tower's forward received, one entry per call."""
    model, _ = loaded
    calls: list = []
    handle = model.model.audio_tower.register_forward_hook(lambda module, args, out: calls.append(args[0].detach().clone()))
    yield calls
    handle.remove()


def test_generate_sends_the_clips_through_the_audio_tower(loaded, tower_calls):
    from vlmctl.inference.generation import _model_inputs, audio_inputs

    model, processor = loaded
    stereo = encode(tone(1.0, 44_100, freq=440, channels=2), 44_100, "WAV", "PCM_24")  # resampled and down-mixed
    requests = [GenerationRequest(messages=[_ask("What is that sound?")], audios=[wav(1.0, freq=880)], id="a"),
                GenerationRequest(messages=[_ask("And this one?")], audios=[stereo], id="b")]
    text, images, clips = render_inputs(requests[1], processor, get_family())
    assert AUDIO_PROMPT + "And this one?" in text and images == [] and clips == [stereo]
    # the data pipeline's path: 16 kHz mono float32 for the feature extractor, the tone where it was
    audio = audio_inputs(processor, clips)
    assert audio["sampling_rate"] == 16_000 and audio["audio"][0].ndim == 1 and len(audio["audio"][0]) == 16_000
    assert abs(dominant_hz(audio["audio"][0], 16_000) - 440) < 5
    inputs = _model_inputs(model, processor, [text], images, clips)
    assert tuple(inputs["input_features"].shape) == (1, 32, 200) and inputs["feature_attention_mask"].sum().item() == 100
    assert int((inputs["input_ids"] == processor.audio_token_id).sum()) == 25  # 1 s: 25 audio tokens

    answers = generate(model, processor, requests, batch_size=2, max_new_tokens=4)
    assert [g.prompt.count(AUDIO_PROMPT) for g in answers] == [1, 1] and all(isinstance(g.text, str) for g in answers)
    # one encoder pass over both clips (the prompt's forward; decoding steps reuse the cache)
    assert len(tower_calls) == 1 and tuple(tower_calls[0].shape) == (2, 32, 200)
    assert tower_calls[0].abs().sum() > 0
    # streamed: the same greedy answer, the clip through the tower once more
    assert "".join(stream_generate(model, processor, requests[1], max_new_tokens=4)).strip() == answers[1].text
    assert len(tower_calls) == 2 and tuple(tower_calls[1].shape) == (1, 32, 200)


def get_family():
    from vlmctl.families import get_family as family

    return family("qwen2_audio")


def test_audio_sample_requests_and_modality_checks(loaded, audio_model, llava_model):
    from vlmctl.data.sample import Sample
    from vlmctl.inference import check_requests, folder_family

    model, processor = loaded
    sample = Sample("s", [_ask("Transcribe.", 2), {"role": "assistant", "content": [{"type": "text", "text": "la la"}]}],
                    audios=[wav(0.5), flac(0.7)])
    request = request_from_sample(sample)
    assert request.audios == sample.audios and len(request.messages) == 1
    assert render_inputs(request, processor, get_family()).text.count(AUDIO_PROMPT) == 2
    # a part past the clips: a data error, as for images
    with pytest.raises(DataError, match="audio part points at audio 1"):
        render_inputs(GenerationRequest(messages=[_ask("?", 2)], audios=[wav(0.5)]), processor)
    # a vision-language family takes no audio; Qwen2-Audio takes no images: usage errors, before any model runs
    llava = folder_family(llava_model)
    assert llava.name == "llava" and folder_family(audio_model).name == "qwen2_audio"
    with pytest.raises(UsageError, match="family llava takes no audio input .* request 's' gives it an audio clip"):
        check_requests([request], llava)
    with pytest.raises(UsageError, match="family qwen2_audio takes no image input"):
        generate(model, processor, [GenerationRequest(messages=[{"role": "user", "content": [{"type": "image", "index": 0}]}],
                                                      images=[b"png"])], max_new_tokens=2)


def test_chat_session_keeps_its_clips_across_turns(loaded, tower_calls, tmp_path):
    model, processor = loaded
    (tmp_path / "low.wav").write_bytes(wav(1.0, freq=220))
    (tmp_path / "high.flac").write_bytes(flac(0.6, freq=880))
    (tmp_path / "long.wav").write_bytes(wav(3.0))
    cmd = parse_input("/audio low.wav What is it?", cwd=tmp_path)
    assert (cmd.kind, cmd.text, cmd.audios, cmd.images) == ("audio", "What is it?", (tmp_path / "low.wav",), ())
    cmd = parse_input("high.flac which is higher?", cwd=tmp_path)
    assert (cmd.kind, cmd.text, cmd.audios) == ("message", "which is higher?", (tmp_path / "high.flac",))
    with pytest.raises(DataError, match="sub/none.wav: no such audio file"):
        parse_input("hear sub/none.wav", cwd=tmp_path)
    with pytest.raises(UsageError, match="/audio needs a path"):
        parse_input("/audio")

    session = ChatSession(model, processor, max_new_tokens=3)
    assert session.family.name == "qwen2_audio"
    session.attach_audio(tmp_path / "low.wav")
    first = session.ask("What is it?")
    assert session.turns == 1 and len(session.audios) == 1 and not session.pending_audios
    second = session.request("Which is higher?", audios=[tmp_path / "high.flac"])
    assert [p["index"] for m in second.messages for p in m["content"] if p["type"] == "audio"] == [0, 1]
    assert session.ask("Which is higher?", audios=[tmp_path / "high.flac"]) == generate(model, processor, [second], max_new_tokens=3)[0].text
    assert isinstance(first, str) and len(session.audios) == 2 and tower_calls  # the clips ran through the tower
    # longer than the 2 s the feature extractor takes: refused, not cut; images: not taken by this family
    with pytest.raises(DataError, match=r"long.wav: 3.00 s, longer than the 2 s"):
        session.attach_audio(tmp_path / "long.wav")
    with pytest.raises(UsageError, match="takes no image input"):
        session.attach(tmp_path / "low.wav")
    session.reset()
    assert not session.audios and not session.history and not session.pending_audios


def _clips_file(root: Path) -> Path:
    (root / "low.wav").write_bytes(wav(1.0, freq=220))
    (root / "stereo.wav").write_bytes(encode(tone(0.8, 44_100, channels=2), 44_100, "WAV", "PCM_24"))
    rows = [{"messages": [{"role": "user", "content": "<audio>Is the tone high or low?"}, {"role": "assistant", "content": "Low."}],
             "audios": ["low.wav"]},
            {"messages": [{"role": "user", "content": "<audio>Transcribe."}, {"role": "assistant", "content": "la"}],
             "audios": ["stereo.wav"]}]
    path = root / "clips.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_generate_answers_a_file_of_audio_questions(audio_model, llava_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clips = _clips_file(tmp_path)
    out = tmp_path / "predictions.jsonl"
    code, stdout, err = run(["generate", str(audio_model), "-i", str(clips), "-o", str(out), "--max-new-tokens", "3",
                             "--device", "cpu"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(AUDIO_PROMPT in r["prompt"] for r in rows) and rows[0]["references"] == ["Low."]
    # the same file for an images-only model: one usage-error panel, exit 2, nothing written
    code, _, err = run(["generate", str(llava_model), "-i", str(clips), "-o", str(tmp_path / "no.jsonl"), "--device", "cpu"], capsys)
    assert code == 2 and err.count("Usage error") == 1 and "family llava takes no audio input" in err
    assert not (tmp_path / "no.jsonl").exists()


def test_cli_chat_with_audio(audio_model, llava_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "low.wav").write_bytes(wav(1.0, freq=220))
    (tmp_path / "high.flac").write_bytes(flac(0.6, freq=880))
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is it?\n/audio high.flac Which is higher?\n/image low.wav\n/exit\n"))
    code, out, err = run(["chat", str(audio_model), "--audio", "low.wav", "--max-new-tokens", "3", "--device", "cpu"], capsys)
    assert code == 0, err
    assert "/audio PATH attaches an audio clip" in out and "/image PATH" not in out.split("›")[0]
    assert "attached low.wav (1 clip(s) for the first message)" in out
    assert sum(line.startswith("model ›") for line in out.splitlines()) == 2
    assert "takes no image input" in err  # a bad turn shows its panel and the chat goes on
    # an images-only model: --audio is a usage error before the model loads
    code, out, err = run(["chat", str(llava_model), "--audio", "low.wav", "--device", "cpu"], capsys)
    assert code == 2 and err.count("Usage error") == 1 and "family llava takes no audio input" in err and "--audio" in err
    code, _, err = run(["chat", str(audio_model), "--audio", "missing.wav", "--device", "cpu"], capsys)
    assert code == 1 and "missing.wav: no such audio file" in err
