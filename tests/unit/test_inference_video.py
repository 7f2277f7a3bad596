"""Video in generation and chat on CPU: the tiny Qwen2.5-VL preset (random init) answers requests with clips written
by tests/video_data.py, the clips reach its vision tower as the collator hands them over (sampled by `data.video`,
frames with their metadata, the family's video prompt in the text), streamed and batched answers agree, `vlmctl
generate` reads videos from a data file and `vlmctl chat` from --video and /video; an images-only model given a
video is one usage-error panel (exit 2)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("av")

from cli_runner import run_cli as run  # noqa: E402
from video_data import moving_square, png_bytes  # noqa: E402

from vlmctl.config.data import DataVideo  # noqa: E402
from vlmctl.errors import DataError, UsageError  # noqa: E402
from vlmctl.inference import (  # noqa: E402
    ChatSession,
    GenerationRequest,
    generate,
    load_for_generation,
    parse_input,
    read_video,
    render_request,
    request_from_sample,
    stream_generate,
)

TEXTS = ["What moves in the video? A red square moves to the right. What color is the picture? Green."] * 20
VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_SIZE = {"shortest_edge": 3136, "longest_edge": 56 * 84}  # small grids: a few tokens per temporal patch
SETTINGS = DataVideo(fps=4, max_frames=8, min_pixels=256, max_pixels=3072)


def _ask(text: str, clips: int = 1) -> dict:
    return {"role": "user", "content": [*({"type": "video", "index": k} for k in range(clips)), {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def video_model(tmp_path_factory) -> Path:
    """The tiny Qwen2.5-VL preset, random init, fp32, its video processor's pixel bounds made small and saved."""
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_processor

    folder = tmp_path_factory.mktemp("video") / "model"
    build_model(ModelSection(preset="tiny-qwen2.5-vl", init="random", output_dir=folder, dtype="fp32"), tokenizer_texts=TEXTS)
    processor = load_processor(folder)
    processor.video_processor.size = dict(VIDEO_SIZE)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(video_model):
    import torch

    torch.manual_seed(0)
    model, processor = load_for_generation(video_model, device="cpu", dtype="fp32")
    model.set_attn_implementation("eager")
    return model, processor


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
    """The pixel tensors the vision tower's forward received, one entry per call."""
    model, _ = loaded
    calls: list = []
    handle = model.model.visual.register_forward_hook(lambda module, args, out: calls.append(args[0].detach().clone()))
    yield calls
    handle.remove()


def _family():
    from vlmctl.families import get_family

    return get_family("qwen2_5_vl")


def test_generate_sends_the_sampled_clip_through_the_vision_tower(loaded, tower_calls, tmp_path):
    from vlmctl.data.modalities.video import decode_clip
    from vlmctl.inference.generation import _model_inputs

    model, processor = loaded
    raw = moving_square(frames=16, width=64, height=48, fps=8)  # 2 s: 8 frames at 4 fps
    (tmp_path / "clip.mp4").write_bytes(raw)
    stored = read_video(tmp_path / "clip.mp4", SETTINGS)
    clip = decode_clip(stored)
    assert clip.frames.shape == (8, 48, 64, 3) and abs(clip.fps - 4.0) < 1e-6
    assert read_video(stored, DataVideo()) == stored  # a stored clip is used as it is, not sampled again
    requests = [GenerationRequest(messages=[_ask("What moves?")], videos=[stored], id="a"),
                GenerationRequest(messages=[_ask("And here?")], videos=[moving_square(frames=8, fps=4)], id="b")]
    text, images, audios, videos = render_request(requests[0], processor, _family())
    assert VIDEO_PROMPT + "What moves?" in text and images == [] and audios == [] and videos == [stored]
    inputs = _model_inputs(model, processor, [text], images, audios, videos, SETTINGS)
    assert inputs["pixel_values_videos"].dtype == model.dtype and "pixel_values" not in inputs
    t, h, w = (int(x) for x in inputs["video_grid_thw"][0])
    assert t == 4 and inputs["pixel_values_videos"].shape[0] == t * h * w  # 8 frames: 4 temporal patches
    assert torch_close(inputs["second_per_grid_ts"], [0.5])  # 2 frames per patch at 4 fps
    video_token = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert int((inputs["input_ids"] == video_token).sum()) == t * h * w // 4

    answers = generate(model, processor, requests, batch_size=2, max_new_tokens=4, video=SETTINGS)
    assert [g.prompt.count(VIDEO_PROMPT) for g in answers] == [1, 1] and all(isinstance(g.text, str) for g in answers)
    # one tower pass over both clips' patches (the prompt's forward; decoding steps reuse the cache)
    assert len(tower_calls) == 1 and tower_calls[0].abs().sum() > 0
    # streamed: the same greedy answer as batched, the clip through the tower once more
    for request, answer in zip(requests, answers):
        assert "".join(stream_generate(model, processor, request, max_new_tokens=4, video=SETTINGS)).strip() == answer.text
    assert len(tower_calls) == 3 and tower_calls[1].shape == inputs["pixel_values_videos"].shape


def torch_close(tensor, values) -> bool:
    import torch

    return torch.allclose(tensor.float(), torch.tensor(values, dtype=torch.float32))


def test_video_sample_requests_and_modality_checks(loaded, video_model, llava_model):
    from vlmctl.data.sample import Sample
    from vlmctl.inference import check_requests, folder_family

    model, processor = loaded
    stored = read_video(moving_square(frames=8, fps=4), SETTINGS)
    sample = Sample("s", [_ask("Compare.", 2), {"role": "assistant", "content": [{"type": "text", "text": "Same."}]}],
                    videos=[stored, stored])
    request = request_from_sample(sample)
    assert request.videos == sample.videos and len(request.messages) == 1
    assert render_request(request, processor, _family()).text.count(VIDEO_PROMPT) == 2
    with pytest.raises(DataError, match="video part points at video 1"):
        render_request(GenerationRequest(messages=[_ask("?", 2)], videos=[stored]), processor)
    # not a video; too few frames for data.video.min_frames: data errors naming the reason
    with pytest.raises(DataError, match="corrupt_video"):
        read_video(png_bytes())
    with pytest.raises(DataError, match="video_too_short"):
        read_video(moving_square(frames=2, fps=4))
    llava = folder_family(llava_model)
    assert llava.name == "llava" and folder_family(video_model).name == "qwen2_5_vl"
    with pytest.raises(UsageError, match="family llava takes no video input .* request 's' gives it a video"):
        check_requests([request], llava)


def test_chat_session_keeps_its_videos_across_turns(loaded, tower_calls, tmp_path):
    model, processor = loaded
    (tmp_path / "slow.mp4").write_bytes(moving_square(frames=8, fps=4))
    (tmp_path / "fast.webm").write_bytes(moving_square(frames=16, width=48, height=48, fps=16, codec="libvpx", container="webm"))
    (tmp_path / "green.png").write_bytes(png_bytes(56))
    cmd = parse_input("/video slow.mp4 What moves?", cwd=tmp_path)
    assert (cmd.kind, cmd.text, cmd.videos, cmd.images, cmd.audios) == ("video", "What moves?", (tmp_path / "slow.mp4",), (), ())
    cmd = parse_input("fast.webm and green.png, which is faster?", cwd=tmp_path)
    assert (cmd.kind, cmd.text, cmd.videos, cmd.images) == ("message", "and , which is faster?", (tmp_path / "fast.webm",),
                                                            (tmp_path / "green.png",))
    with pytest.raises(DataError, match="sub/none.mp4: no such video file"):
        parse_input("watch sub/none.mp4", cwd=tmp_path)
    with pytest.raises(UsageError, match="/video needs a path"):
        parse_input("/video")

    session = ChatSession(model, processor, max_new_tokens=3, video=SETTINGS)
    session.attach_video(tmp_path / "slow.mp4")
    first = session.ask("What moves?")
    assert session.turns == 1 and len(session.videos) == 1 and not session.pending_videos and isinstance(first, str)
    second = session.request("Which is faster?", videos=[tmp_path / "fast.webm"])
    assert [p["index"] for m in second.messages for p in m["content"] if p["type"] == "video"] == [0, 1]
    assert session.ask("Which is faster?", videos=[tmp_path / "fast.webm"]) == generate(
        model, processor, [second], max_new_tokens=3, video=SETTINGS)[0].text
    assert len(session.videos) == 2 and tower_calls
    session.reset()
    assert not session.videos and not session.history and not session.pending_videos


def test_cli_generate_and_chat_with_video(video_model, llava_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow.mp4").write_bytes(moving_square(frames=8, width=64, height=48, fps=4))
    rows = [{"messages": [{"role": "user", "content": "<video>Where does the square go?"}, {"role": "assistant", "content": "Right."}],
             "videos": ["slow.mp4"]}]
    (tmp_path / "clips.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "predictions.jsonl"
    code, _, err = run(["generate", str(video_model), "-i", "clips.jsonl", "-o", str(out), "--max-new-tokens", "3",
                        "--device", "cpu"], capsys)
    assert code == 0, err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 1 and VIDEO_PROMPT in got[0]["prompt"] and got[0]["references"] == ["Right."]
    # an images-only model: one usage-error panel, exit 2, nothing written
    code, _, err = run(["generate", str(llava_model), "-i", "clips.jsonl", "-o", "no.jsonl", "--device", "cpu"], capsys)
    assert code == 2 and err.count("Usage error") == 1 and "family llava takes no video input" in err
    assert not (tmp_path / "no.jsonl").exists()

    monkeypatch.setattr(sys, "stdin", io.StringIO("What moves?\n/video slow.mp4 And now?\n/exit\n"))
    code, out_text, err = run(["chat", str(video_model), "--video", "slow.mp4", "--max-new-tokens", "3", "--device", "cpu"], capsys)
    assert code == 0, err
    assert "/video PATH attaches a video" in out_text and "attached slow.mp4 (1 video(s) for the first message)" in out_text
    assert sum(line.startswith("model ›") for line in out_text.splitlines()) == 2
    code, _, err = run(["chat", str(llava_model), "--video", "slow.mp4", "--device", "cpu"], capsys)
    assert code == 2 and err.count("Usage error") == 1 and "family llava takes no video input" in err and "--video" in err
    code, _, err = run(["chat", str(video_model), "--video", "missing.mp4", "--device", "cpu"], capsys)
    assert code == 1 and "missing.mp4: no such video file" in err


def test_video_settings_come_from_the_project_else_the_run_else_the_defaults(tmp_path):
    from types import SimpleNamespace

    from vlmctl.inference import video_settings

    run_dir = tmp_path / "runs" / "r1"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    assert video_settings(run_dir / "final") == DataVideo()  # no run config
    (run_dir / "config.yaml").write_text("data:\n  video: {fps: 4, max_frames: 8}\n")
    expected = DataVideo(fps=4, max_frames=8)
    assert video_settings(run_dir / "final") == expected
    assert video_settings(run_dir / "checkpoints" / "checkpoint-2") == expected
    assert video_settings(run_dir / "final", SimpleNamespace(video=SETTINGS)) == SETTINGS  # the project's first
    (run_dir / "config.yaml").write_text("data:\n  video: {fps: -1}\n")
    assert video_settings(run_dir / "final") == DataVideo()  # a run config that does not validate: the defaults
    assert video_settings(tmp_path / "model") == DataVideo()  # a folder of no run
