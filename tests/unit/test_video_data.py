"""The video unit and the formats users bring, on real tiny clips encoded with PyAV in the test: sampling by
`data.video`, the stored clip, one defective file per reason code, and the readers (LLaMA-Factory ShareGPT with
`videos`, OpenAI-style content parts, LLaVA-Video's `video` key, WebDataset members, Parquet)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

pytest.importorskip("av")

from video_data import moving_square, png_bytes, rotated, square_x, unknown_codec  # noqa: E402

from vlmctl.config.data import DataSource, DataVideo  # noqa: E402
from vlmctl.data.checks import Rejection, build_sample, check_images  # noqa: E402
from vlmctl.data.formats import read_source  # noqa: E402
from vlmctl.data.modalities import get_unit  # noqa: E402
from vlmctl.data.modalities.video import (  # noqa: E402
    VideoError, decode_clip, frame_indices, frame_size, normalize_video, probe,
)
from vlmctl.data.sample import Sample  # noqa: E402

SMALL = DataVideo(fps=4, max_frames=6, min_pixels=16, max_pixels=32 * 24)


# ------------------------------------------------------------------------------------------------ sampling


def test_a_clip_is_sampled_by_fps_and_max_frames_and_scaled_into_the_pixel_bounds():
    original = moving_square(frames=16, width=64, height=48, fps=8)  # 2 s
    info = probe(original)
    assert (info.codec, info.frames, info.width, info.height, info.seconds) == ("h264", 16, 64, 48, 2.0)
    # 2 s at 4 fps = 8 frames, capped at 6; 64x48 = 3072 px scaled to the 768 px bound keeping 4:3
    stored = normalize_video(original, SMALL)
    assert (stored.frames, stored.width, stored.height, stored.seconds) == (6, 32, 24, 2.0)
    clip = decode_clip(stored.data)
    assert clip.frames.shape == (6, 24, 32, 3) and str(clip.frames.dtype) == "uint8"
    assert clip.fps == pytest.approx(3.0)  # 6 frames over the 2 s of the original
    # the frames kept are spread over the clip, in order: the square moves right from frame to frame
    xs = [square_x(f) for f in clip.frames]
    assert xs == sorted(xs) and xs[0] < 0.2 and xs[-1] > 0.7
    # uncapped: round(2 s x 4 fps) = 8 frames, the whole size kept when it is inside the bounds
    roomy = normalize_video(original, DataVideo(fps=4, max_frames=64, min_pixels=16, max_pixels=64 * 48))
    assert (roomy.frames, roomy.width, roomy.height) == (8, 64, 48)


def test_frame_counts_are_even_and_spread_as_transformers_spreads_them():
    import torch

    settings = DataVideo(fps=2, max_frames=64, min_frames=4)
    for total, seconds in [(16, 2.0), (301, 10.0), (7, 3.5), (900, 30.0), (5, 0.2)]:
        keep = frame_indices(total, seconds, settings)
        n = len(keep)
        assert n % 2 == 0 and settings.min_frames <= n <= min(total, settings.max_frames)
        # Qwen2VLVideoProcessor.sample_frames: torch.arange(0, total, total / n).int()
        assert keep == torch.arange(0, total, total / n).int().tolist()
    assert len(frame_indices(900, 30.0, settings)) == 60 and len(frame_indices(900, 300.0, settings)) == 64
    assert frame_size(640, 480, 256, 65536) == (295, 221) and 295 * 221 <= 65536
    assert frame_size(8, 4, 256, 65536) == (23, 12) and 23 * 12 >= 256
    assert frame_size(100, 60, 256, 65536) == (100, 60)


def test_a_stored_clip_is_kept_byte_for_byte_when_prepared_again():
    stored = normalize_video(moving_square(frames=16), SMALL)
    again = normalize_video(stored.data, SMALL)
    assert again.data == stored.data and again.conversion is None and stored.conversion is not None
    # with other settings it is sampled again
    fewer = normalize_video(stored.data, DataVideo(fps=4, max_frames=4, min_pixels=16, max_pixels=32 * 24))
    assert fewer.frames == 4 and fewer.data != stored.data


def test_a_clip_with_a_display_rotation_is_stored_upright():
    import numpy as np

    upright = decode_clip(normalize_video(moving_square(frames=8, width=64, height=48), DataVideo(fps=8, min_pixels=16)).data).frames
    turned = decode_clip(normalize_video(rotated(moving_square(frames=8, width=64, height=48)), DataVideo(fps=8, min_pixels=16)).data).frames
    assert upright.shape == (8, 48, 64, 3) and turned.shape == (8, 64, 48, 3)  # portrait after a quarter turn
    # turned clockwise: the square's top-left start is now top-right, and its rightward motion goes down
    assert np.abs(np.rot90(upright, k=-1, axes=(1, 2)).astype(int) - turned.astype(int)).mean() < 4
    red = [np.nonzero((f[..., 0] > 128) & (f[..., 1] < 100)) for f in turned]
    rows = [r.mean() for r, _ in red]
    assert rows == sorted(rows) and red[0][1].mean() > 24


# ------------------------------------------------------------------------------------------------ defects


@pytest.mark.parametrize("name, data, settings, reason, detail", [
    ("truncated", lambda: moving_square(frames=16)[:1200], None, "corrupt_video", "truncated|not a readable"),
    ("cut in half", lambda: moving_square(frames=16)[:600], None, "corrupt_video", "not a readable video container"),
    ("zero frames", lambda: _zero_frames(), None, "corrupt_video", "no frames|not a readable|no video stream"),
    ("png named .mp4", lambda: png_bytes(), None, "corrupt_video", "still image"),
    ("text named .mp4", lambda: b"not a video at all\n", None, "corrupt_video", "not a readable video container"),
    ("unknown codec", lambda: unknown_codec(), None, "unsupported_codec", "no decoder"),
    ("three frames", lambda: moving_square(frames=3), None, "video_too_short", "3 frame"),
    ("over max_seconds", lambda: moving_square(frames=16, fps=8), DataVideo(max_seconds=1.5), "video_too_long", "2.0 s, over data.video.max_seconds=1.5"),
])
def test_each_defect_gets_its_reason_code(name, data, settings, reason, detail):
    import re

    with pytest.raises(VideoError) as err:
        normalize_video(data(), settings)
    assert err.value.reason == reason and re.search(detail, err.value.detail), (name, err.value.detail)


def _zero_frames() -> bytes:
    """A Matroska file with a video track header and no frame."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="matroska") as c:
        stream = c.add_stream("mjpeg", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuvj444p"
        c.start_encoding()  # writes the header
    assert out.getvalue()
    return out.getvalue()


def _write(folder, name, data):
    (folder / name).write_bytes(data)
    return name


def test_check_images_rejects_videos_with_the_reason_and_names_the_file(tmp_path):
    written = moving_square(frames=8)  # the encoder is not byte-deterministic between calls: keep what was written
    good = _write(tmp_path, "good.mp4", written)
    bad = _write(tmp_path, "broken.mp4", moving_square(frames=16)[:1200])
    _write(tmp_path, "photo.mp4", png_bytes())
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "<video>What moves?"}, {"role": "assistant", "content": "A square."}], "videos": [good]},
        {"id": "bad", "messages": [{"role": "user", "content": "<video>What moves?"}, {"role": "assistant", "content": "?"}], "videos": [bad]},
        {"id": "photo", "messages": [{"role": "user", "content": "<video>Hm?"}, {"role": "assistant", "content": "?"}], "videos": ["photo.mp4"]},
        {"id": "gone", "messages": [{"role": "user", "content": "<video>Hm?"}, {"role": "assistant", "content": "?"}], "videos": ["nowhere.mp4"]},
        {"id": "two", "messages": [{"role": "user", "content": "<video><video>Both?"}, {"role": "assistant", "content": "?"}], "videos": [good]},
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = {item.id: item for item in read_source(DataSource(path=str(tmp_path / "data.jsonl"), format="sharegpt"), video=SMALL)}
    assert isinstance(out["ok"], Sample) and len(out["ok"].videos) == 1
    assert decode_clip(out["ok"].videos[0]).frames.shape[0] == 4  # 1 s at 4 fps
    reasons = {k: (v.reason, v.detail) for k, v in out.items() if isinstance(v, Rejection)}
    assert reasons["bad"][0] == "corrupt_video" and "broken.mp4" in reasons["bad"][1] and "video 0" in reasons["bad"][1]
    assert reasons["photo"][0] == "corrupt_video" and "photo.mp4" in reasons["photo"][1]
    assert reasons["gone"][0] == "missing_video" and "nowhere.mp4" in reasons["gone"][1]
    assert reasons["two"] == ("placeholder_mismatch", "2 <video> placeholder(s) for 1 video(s)")
    # the input files are untouched
    assert (tmp_path / good).read_bytes() == written


# ------------------------------------------------------------------------------------------------ formats


def _messages(sample: Sample) -> list[list[tuple]]:
    return [[(p["type"], p.get("index", p.get("text"))) for p in m["content"]] for m in sample.messages]


def test_llamafactory_sharegpt_with_videos_and_images(tmp_path):
    # LLaMA-Factory data/README.md: `videos` next to `images`, `<video>` / `<image>` placeholders in the text
    clip = _write(tmp_path, "1.mp4", moving_square(frames=8))
    img = _write(tmp_path, "1.png", png_bytes(40))
    record = {"messages": [{"role": "user", "content": "<image>Look, then <video>what changed?"},
                           {"role": "assistant", "content": "The square moved."},
                           {"role": "user", "content": "<video>And here?"}, {"role": "assistant", "content": "Same."}],
              "images": [img], "videos": [clip, clip]}
    (tmp_path / "demo.json").write_text(json.dumps([record]))
    [sample] = list(read_source(DataSource(path=str(tmp_path / "demo.json")), video=SMALL))  # format auto: sharegpt
    assert isinstance(sample, Sample), sample
    assert _messages(sample)[0] == [("image", 0), ("text", "Look, then"), ("video", 0), ("text", "what changed?")]
    assert _messages(sample)[2] == [("video", 1), ("text", "And here?")]
    assert len(sample.images) == 1 and len(sample.videos) == 2 and sample.videos[0] == sample.videos[1]


def test_openai_style_video_parts(tmp_path):
    clip = _write(tmp_path, "c.mp4", moving_square(frames=8))
    rows = [
        {"id": "url", "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}},
                                                                  {"type": "text", "text": "What moves?"}]},
                                    {"role": "assistant", "content": "A square."}]},
        {"id": "chat-template", "messages": [{"role": "user", "content": [{"type": "video", "video": f"file://{tmp_path / clip}"},
                                                                            {"type": "text", "text": "Where to?"}]},
                                              {"role": "assistant", "content": [{"type": "text", "text": "Right."}]}]},
        {"id": "listed", "videos": [clip], "messages": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hm?"}]},
                                                         {"role": "assistant", "content": "A square."}]},
        {"id": "both", "videos": [clip], "messages": [{"role": "user", "content": [{"type": "video", "path": clip}, {"type": "text", "text": "?"}]},
                                                       {"role": "assistant", "content": "?"}]},
    ]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = {s.id: s for s in read_source(DataSource(path=str(tmp_path / "m.jsonl"), format="messages"), video=SMALL)}
    for sid in ("url", "chat-template", "listed"):
        assert isinstance(out[sid], Sample) and _messages(out[sid])[0][0] == ("video", 0) and len(out[sid].videos) == 1, sid
    assert out["url"].videos == out["listed"].videos  # the same file, the same stored clip
    assert out["both"].reason == "placeholder_mismatch" and "1 video part(s) and also 1 listed video(s)" in out["both"].detail


def test_llava_video_records_use_the_image_placeholder_for_their_video(tmp_path):
    # LLaVA-Video-178K: a `video` key, and the `<image>` placeholder marks it (LLaVA-NeXT's LazySupervisedDataset)
    clip = _write(tmp_path, "v.mp4", moving_square(frames=8))
    img = _write(tmp_path, "i.png", png_bytes(40))
    rows = [
        {"id": "v1", "video": clip, "data_source": "test",
         "conversations": [{"from": "human", "value": "<image>\nWhat moves?"}, {"from": "gpt", "value": "A square."}]},
        {"id": "v2", "video": clip, "conversations": [{"from": "human", "value": "What moves?"}, {"from": "gpt", "value": "A square."}]},
        {"id": "i1", "image": img, "conversations": [{"from": "human", "value": "<image>\nColor?"}, {"from": "gpt", "value": "Green."}]},
    ]
    (tmp_path / "llava_video.json").write_text(json.dumps(rows))
    out = {s.id: s for s in read_source(DataSource(path=str(tmp_path / "llava_video.json")), video=SMALL)}  # auto: llava
    assert _messages(out["v1"])[0] == [("video", 0), ("text", "What moves?")] and len(out["v1"].videos) == 1 and out["v1"].images == []
    assert _messages(out["v2"])[0] == [("video", 0), ("text", "What moves?")]  # no placeholder: put first
    assert _messages(out["i1"])[0] == [("image", 0), ("text", "Color?")] and out["i1"].videos == []
    # the same placeholder in a ShareGPT record with videos only is a mismatch there (LLaMA-Factory's rule)
    s = build_sample([("user", "<image>x"), ("assistant", "y")], videos=[b"v"], id="s", source="s", location="s:1")
    assert isinstance(s, Rejection) and s.reason == "placeholder_mismatch"


def test_webdataset_members_and_parquet_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    clip = moving_square(frames=8)
    tar = tmp_path / "shard-000.tar"
    with tarfile.open(tar, "w") as t:
        for name, data in [("a.mp4", clip), ("a.json", json.dumps({"messages": [{"role": "user", "content": "<video>What moves?"},
                                                                                  {"role": "assistant", "content": "A square."}]}).encode()),
                           ("b.mkv", clip), ("b.txt", b"a square moving right")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    out = {s.id: s for s in read_source(DataSource(path=str(tar)), video=SMALL)}
    assert _messages(out["a"])[0] == [("video", 0), ("text", "What moves?")]
    assert _messages(out["b"]) == [[("video", 0)], [("text", "a square moving right")]]  # a caption sample
    table = pa.Table.from_pylist([{"question": "What moves?", "answer": "A square.", "video": {"bytes": clip, "path": None}}])
    pq.write_table(table, tmp_path / "vqa.parquet")
    [s] = list(read_source(DataSource(path=str(tmp_path / "vqa.parquet")), video=SMALL))
    assert _messages(s)[0] == [("video", 0), ("text", "What moves?")] and decode_clip(s.videos[0]).frames.shape[0] == 4


def test_the_unit_hands_frames_and_metadata_to_the_processor():
    stored = normalize_video(moving_square(frames=16, fps=8), SMALL).data
    unit = get_unit("video")
    inputs = unit.processor_inputs([stored, stored])
    assert set(inputs) == {"videos", "video_metadata", "do_sample_frames"} and inputs["do_sample_frames"] is False
    assert [v.shape for v in inputs["videos"]] == [(6, 24, 32, 3)] * 2
    assert inputs["video_metadata"][0]["total_num_frames"] == 6 and inputs["video_metadata"][0]["fps"] == pytest.approx(3.0)
    assert unit.dummy_input(None) is None and unit.owns("video_grid_thw") and not unit.owns("pixel_values")
    s = check_images(Sample("x", [{"role": "user", "content": [{"type": "video", "index": 0}]}], videos=[stored]), video=SMALL)
    assert not isinstance(s, Rejection) and s[1].videos[0].frames == 6 and not s[1].videos[0].converted


def test_prepare_writes_stored_clips_and_one_schema_for_mixed_shards(tmp_path):
    import pyarrow.parquet as pq

    from vlmctl.config.data import DataSection
    from vlmctl.data.loader import ShardDataset
    from vlmctl.data.prepare import prepare_data

    clip = _write(tmp_path, "c.mp4", moving_square(frames=16, fps=8))
    img = _write(tmp_path, "i.png", png_bytes(40))
    rows = [{"id": f"img{i}", "messages": [{"role": "user", "content": f"<image>Color {i}?"}, {"role": "assistant", "content": "Green."}],
             "images": [img]} for i in range(3)]
    rows += [{"id": f"vid{i}", "messages": [{"role": "user", "content": f"<video>Motion {i}?"}, {"role": "assistant", "content": "Right."}],
              "videos": [clip]} for i in range(2)]
    rows.append({"id": "bad", "messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "?"}], "videos": ["i.png"]})
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataSection(sources=[DataSource(path=str(tmp_path / "mixed.jsonl"), format="sharegpt")], prepared_dir=tmp_path / "prepared",
                       val_ratio=0, video=SMALL, num_proc=1)
    result = prepare_data(data, progress=False)
    assert result.kept == 5 and result.rejected == {"corrupt_video": 1}
    videos = result.manifest["videos"]
    assert videos["count"] == 2 and videos["frames"]["max"] == 6 and videos["width"]["max"] == 32 and videos["seconds"]["max"] == 2.0
    assert videos["tokens_per_clip"] is None and videos["settings"]["max_frames"] == 6  # no model: nothing counted
    files = [tmp_path / "prepared" / f for f in result.manifest["splits"]["train"]["shards"]]
    assert len(files) == 2  # the shard being written when the first video came ended there
    schemas = {str(pq.read_schema(f).remove_metadata()) for f in files}
    assert len(schemas) == 1 and "videos" in next(iter(schemas))
    ds = ShardDataset(files)
    samples = [ds[i] for i in range(len(ds))]
    assert [s.id for s in samples] == ["img0", "img1", "img2", "vid0", "vid1"]
    assert all(s.videos == [] for s in samples[:3]) and samples[3].videos == samples[4].videos
    assert decode_clip(samples[3].videos[0]).frames.shape == (6, 24, 32, 3)
    rejected = [json.loads(line) for line in (tmp_path / "prepared" / "rejected.jsonl").read_text().splitlines()]
    assert rejected[0]["reason"] == "corrupt_video" and "i.png" in rejected[0]["detail"]
    # image-only data keeps the image-only schema
    data.sources[0] = DataSource(path=str(tmp_path / "images.jsonl"), format="sharegpt")
    (tmp_path / "images.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    result = prepare_data(data, progress=False)
    assert result.manifest["videos"] is None
    assert "videos" not in pq.read_schema(tmp_path / "prepared" / result.manifest["splits"]["train"]["shards"][0]).names


def test_a_video_sample_for_a_family_without_video_is_refused_with_the_fix():
    from vlmctl.config import ModelSection
    from vlmctl.data.collate import encode_sample
    from vlmctl.errors import DataError
    from vlmctl.models.build import make_processor, plan_build

    plan = plan_build(ModelSection(preset="tiny", init="random"))  # LLaVA: images only
    processor = make_processor(plan, tokenizer_texts=["What moves? A square."] * 20)
    sample = Sample("v", [{"role": "user", "content": [{"type": "video", "index": 0}, {"type": "text", "text": "What moves?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "A square."}]}],
                    videos=[normalize_video(moving_square(frames=8), SMALL).data])
    with pytest.raises(DataError, match="takes no video input") as err:
        encode_sample(sample, processor, plan.family)
    assert "drop the video samples" in err.value.hint
