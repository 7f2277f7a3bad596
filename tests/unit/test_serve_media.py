"""`vlmctl serve` with audio and video parts, through the `openai` client against a server on a free local port:
a Qwen2-Audio clip (`input_audio`) and a Qwen2.5-VL video (`video_url`) are answered as `generate` answers them;
a clip over the model's window and audio for an image-only model are 400s."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("av")
pytest.importorskip("soundfile")

from audio_data import wav  # noqa: E402
from video_data import moving_square  # noqa: E402

from vlmctl.config.data import DataVideo  # noqa: E402
from vlmctl.inference import GenerationRequest, generate, load_for_generation, read_video  # noqa: E402
from vlmctl.serve import ServeSettings, running_server  # noqa: E402

TEXTS = ["What moves in the video? A red square. Transcribe the clip. What color is the picture? Green."] * 20
SETTINGS = DataVideo(fps=4, max_frames=8, min_pixels=256, max_pixels=3072)
VIDEO_SIZE = {"shortest_edge": 3136, "longest_edge": 56 * 84}


def build(preset: str, folder: Path) -> Path:
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    build_model(ModelSection(preset=preset, init="random", output_dir=folder, dtype="fp32"), tokenizer_texts=TEXTS)
    return folder


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_an_audio_clip_is_answered_as_generate_answers_it(tmp_path):
    from vlmctl.inference.chat import audio_window, read_audio

    model, processor = load_for_generation(build("tiny-qwen2-audio", tmp_path / "audio"), device="cpu", dtype="fp32")
    clip = wav(1.0, 16_000, freq=440)
    ask = [{"role": "user", "content": [{"type": "audio", "index": 0}, {"type": "text", "text": "Transcribe the clip."}]}]
    expected = generate(model, processor, [GenerationRequest(messages=ask, audios=[read_audio(clip, audio_window(processor))])],
                        batch_size=1, max_new_tokens=6)[0].text
    with running_server(model, processor, ServeSettings(port=0), name="audio") as url:
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}
        answer = client(url).chat.completions.create(model="audio", max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [part, {"type": "text", "text": "Transcribe the clip."}]}])
        assert answer.choices[0].message.content == expected
        too_long = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(audio_window(processor) + 1.0)).decode(),
                                                           "format": "wav"}}
        with pytest.raises(openai.BadRequestError, match="longer than"):
            client(url).chat.completions.create(model="audio", messages=[{"role": "user", "content": [too_long]}])
        with pytest.raises(openai.BadRequestError, match="not base64"):
            client(url).chat.completions.create(model="audio", messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}]}])


def test_a_video_is_answered_as_generate_answers_it_and_an_image_model_refuses_audio(tmp_path):
    from vlmctl.models import load_processor

    folder = build("tiny-qwen2.5-vl", tmp_path / "video")
    processor = load_processor(folder)
    processor.video_processor.size = dict(VIDEO_SIZE)  # small grids: a few tokens per temporal patch
    processor.save_pretrained(folder)
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    raw = moving_square(frames=16, width=64, height=48, fps=8)
    ask = [{"role": "user", "content": [{"type": "video", "index": 0}, {"type": "text", "text": "What moves in the video?"}]}]
    expected = generate(model, processor, [GenerationRequest(messages=ask, videos=[read_video(raw, SETTINGS)])], batch_size=1,
                        max_new_tokens=6, video=SETTINGS)[0].text
    with running_server(model, processor, ServeSettings(port=0, video=SETTINGS), name="video") as url:
        part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(raw).decode()}}
        answer = client(url).chat.completions.create(model="video", max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [part, {"type": "text", "text": "What moves in the video?"}]}])
        assert answer.choices[0].message.content == expected
        assert answer.usage.prompt_tokens > 20  # the clip's visual tokens are counted
        with pytest.raises(openai.BadRequestError):
            client(url).chat.completions.create(model="video", messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()}}]}])
        with pytest.raises(openai.BadRequestError, match="takes no audio"):
            client(url).chat.completions.create(model="video", messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(0.5)).decode(), "format": "wav"}}]}])
        assert client(url).chat.completions.create(model="video", max_tokens=2, messages=[
            {"role": "user", "content": "still there?"}]).choices[0].finish_reason
