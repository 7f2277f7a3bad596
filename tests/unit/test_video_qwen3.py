"""Video training for Qwen3-VL on a tiny random-init model: the torchvision-free video processor against the library's
own settings, frame sizes and patch layout; token counts (video tokens, timestamp text and vision start / end per
temporal patch) against what Qwen3VLProcessor writes; packed rows with videos giving every sample the positions,
logits and loss it has unpacked."""

from __future__ import annotations

import pytest

pytest.importorskip("av")

from video_data import moving_square, png_bytes  # noqa: E402

from vlmctl.config.data import DataVideo  # noqa: E402
from vlmctl.data.modalities.video import normalize_video  # noqa: E402
from vlmctl.data.sample import Sample  # noqa: E402
from vlmctl.errors import ModelError  # noqa: E402

TEXTS = ["What moves in the video? A red square moves to the right. What color is the picture? Green."] * 20
VIDEO_SIZE = {"shortest_edge": 4096, "longest_edge": 8 * 64 * 64}  # pixels of a whole clip: a few tokens per temporal patch


def _clip(frames: int, width: int, height: int, fps: float) -> bytes:
    settings = DataVideo(fps=fps, max_frames=64, min_pixels=16, max_pixels=width * height)
    return normalize_video(moving_square(frames=frames, width=width, height=height, fps=fps), settings).data


def _turns(*user_parts, answer: str = "A red square moves to the right.") -> list[dict]:
    return [{"role": "user", "content": list(user_parts)}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


def _library_processor(**settings):
    """transformers' own `Qwen3VLVideoProcessor` from its module (the top-level name needs torchvision; building one and
    its torch-only methods do not)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(**settings)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, processor, family, model): the tiny Qwen3-VL preset, random init, fp32, eager attention, its
    video processor's pixel bounds made small and saved (the counter reads them from the folder)."""
    import torch

    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_model, load_processor

    out = tmp_path_factory.mktemp("video-qwen3") / "model"
    build_model(ModelSection(preset="tiny-qwen3-vl", init="random", output_dir=out), tokenizer_texts=TEXTS)
    processor = load_processor(out)
    processor.video_processor.size = dict(VIDEO_SIZE)
    processor.save_pretrained(out)
    torch.manual_seed(0)
    model, processor, family = load_model(out, dtype="fp32")
    model.set_attn_implementation("eager")
    assert processor.video_processor.size == VIDEO_SIZE  # read back from the folder
    return out, processor, family, model


# ------------------------------------------------------------------------------------------------ the video processor


def test_the_stand_in_has_the_library_settings_frame_sizes_and_patch_layout():
    import numpy as np
    import torch
    from PIL import Image

    from vlmctl.families.qwen_video import STAND_INS, Qwen3FramesVideoProcessor
    from vlmctl.families.qwen_vl import video_layout

    library = _library_processor()
    assert STAND_INS["Qwen3VLVideoProcessor"] is Qwen3FramesVideoProcessor
    default = Qwen3FramesVideoProcessor()
    for key in ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor",
                "max_video_tokens"):
        assert getattr(default, key) == pytest.approx(getattr(library, key)), key
    assert default.to_dict()["video_processor_type"] == "Qwen3VLVideoProcessor"  # a machine with torchvision loads the real one

    # frame sizes: the pixel bounds hold the whole clip, so the frame count matters (with and without the cap)
    counts = {}
    for cap in (False, True):
        library = _library_processor(size=VIDEO_SIZE, cap_pixels_per_frame=cap, max_video_tokens=6)
        video = Qwen3FramesVideoProcessor(size=VIDEO_SIZE, cap_pixels_per_frame=cap, max_video_tokens=6)
        patches = {(f, h, w): video.get_num_of_video_patches(f, h, w) for f in (2, 5, 8, 16) for h, w in ((48, 64), (100, 30), (200, 200))}
        assert patches == {k: library.get_num_of_video_patches(*k) for k in patches}, cap
        # the token rule reads the same settings (a saved processor_config.json's video_processor)
        saved = {"size": VIDEO_SIZE, "cap_pixels_per_frame": cap, "max_video_tokens": 6, "patch_size": 16}
        for (f, h, w), n in patches.items():
            t, per_patch, _ = video_layout(f, w, h, saved, default_patch=16, whole_clip=True)
            assert t * per_patch * 4 == n, (f, h, w, cap)
        counts[cap] = patches
    assert len(set(counts[False].values())) >= 5 and counts[False] != counts[True]  # sizes, frame counts and the cap matter
    video = Qwen3FramesVideoProcessor(size=VIDEO_SIZE)
    assert video.get_num_of_video_patches(16, 200, 200) < 8 * video.get_num_of_video_patches(2, 200, 200)

    # values: the library's rescale / normalize settings and its own patchify over the frames resized to its size
    library = _library_processor(size=VIDEO_SIZE)
    rng = np.random.default_rng(0)
    for frames, (h, w) in [(4, (48, 64)), (5, (56, 84)), (8, (100, 30))]:
        clip = rng.integers(0, 256, size=(frames, h, w, 3), dtype=np.uint8)
        out = video(videos=[clip], return_tensors="pt")
        rh, rw = video.frame_size(frames, h, w)
        resized = np.stack([np.asarray(Image.fromarray(f).resize((rw, rh), Image.BICUBIC)) for f in clip])
        x = torch.from_numpy(resized).permute(0, 3, 1, 2).float() * library.rescale_factor
        x = (x - torch.tensor(library.image_mean).view(3, 1, 1)) / torch.tensor(library.image_std).view(3, 1, 1)
        expected, t, gh, gw = library.patchify(x[None], patch_size=16, merge_size=2, temporal_patch_size=2)
        assert out["video_grid_thw"].tolist() == [[t, gh, gw]] == [[-(-frames // 2), rh // 16, rw // 16]]
        assert torch.allclose(out["pixel_values_videos"], expected[0], atol=1e-5)


def test_the_stand_in_refuses_to_sample_and_clips_shorter_than_a_temporal_patch():
    import numpy as np

    from vlmctl.families.qwen_video import Qwen3FramesVideoProcessor

    video = Qwen3FramesVideoProcessor(size=VIDEO_SIZE)
    clip = np.zeros((4, 32, 32, 3), np.uint8)
    with pytest.raises(ValueError, match="does not sample frames"):
        video(videos=[clip], do_sample_frames=True)
    with pytest.raises(ValueError, match="at least 2 frames"):
        video(videos=[clip[:1]])
    # metadata without frame indices: the frames given are the clip's, in order (the processor's timestamps need them)
    out = video(videos=[clip], video_metadata=[{"total_num_frames": 4, "fps": 2.0}], return_metadata=True)
    assert out["video_metadata"][0].frames_indices == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------------ token counts


def test_token_counts_are_what_the_processor_writes(tiny):
    import numpy as np

    from vlmctl.families.qwen_vl import qwen3_timestamps

    _, processor, family, model = tiny
    assert type(processor).__name__ == "Qwen3VLProcessor" and type(processor.video_processor).__name__ == "Qwen3FramesVideoProcessor"
    tokenizer = processor.tokenizer
    prompt = "<|im_start|>user\n" + family.prompt("video") + "What moves?<|im_end|>\n"
    plain = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    video_id, start_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<|video_pad|>", "<|vision_start|>"))
    rng = np.random.default_rng(1)
    seen = set()
    for frames, fps, (h, w) in [(8, 2.0, (48, 64)), (5, 3.0, (70, 50)), (12, 0.5, (64, 64)), (40, 1.5, (40, 90))]:
        clip = rng.integers(0, 256, size=(frames, h, w, 3), dtype=np.uint8)
        meta = {"total_num_frames": frames, "fps": fps, "frames_indices": list(range(frames))}
        out = processor(text=[prompt], videos=[clip], video_metadata=[meta], do_sample_frames=False, return_tensors="pt")
        ids = out["input_ids"][0]
        t, gh, gw = out["video_grid_thw"][0].tolist()
        # one timestamp per temporal patch, each followed by a vision start, the patch's video tokens, a vision end
        text = tokenizer.decode(ids)
        times = qwen3_timestamps(frames, fps)
        assert len(times) == t and all(f"<{s:.1f} seconds><|vision_start|>" in text for s in times)
        assert int((ids == video_id).sum()) == t * gh * gw // 4 and int((ids == start_id).sum()) == t + 1
        written = len(ids) - plain + 1  # in place of the prompt's one <|video_pad|>
        assert family.num_video_tokens(frames, w, h, processor, fps=fps) == written, (frames, fps)
        assert written > t * gh * gw // 4 + 2 * t  # the timestamp text counts
        seen.add(written)
    assert len(seen) == 4
    # the same clip at another rate writes other timestamps, and the count follows them
    assert family.num_video_tokens(40, 90, 40, processor, fps=1.5) != family.num_video_tokens(40, 90, 40, processor, fps=0.1)
    assert family.num_video_tokens(8, 64, 48, processor) == family.num_video_tokens(8, 64, 48, processor, fps=24.0)
    with pytest.raises(ModelError, match="tokenizer"):
        family.num_video_tokens(8, 64, 48, model.config, fps=2.0)
    with pytest.raises(ModelError, match="at least 2 frames"):
        family.num_video_tokens(1, 64, 48, processor, fps=2.0)
    from vlmctl.families import get_family

    assert get_family("qwen3_vl_moe").num_video_tokens(8, 64, 48, processor, fps=2.0) == family.num_video_tokens(8, 64, 48, processor, fps=2.0)


def test_counted_tokens_are_the_collated_length(tiny):
    from vlmctl.data.collate import encode_sample
    from vlmctl.data.tokens import TokenCounter

    folder, processor, family, _ = tiny
    clips = [_clip(8, 64, 48, 4), _clip(12, 84, 56, 1)]  # 12 frames at 1 fps: timestamps past 10 s
    sample = Sample("v", _turns({"type": "image", "index": 0}, {"type": "video", "index": 0}, _text("Then"),
                                {"type": "video", "index": 1}, _text("what moved?")), videos=clips, images=[png_bytes(40)])
    enc = encode_sample(sample, processor, family)
    assert [g[0] for g in enc.media_inputs["video"]["video_grid_thw"].tolist()] == [4, 6]
    assert "second_per_grid_ts" not in enc.media_inputs["video"]
    counter = TokenCounter.load(folder)  # read from the folder's files, as `data prepare` counts
    assert counter.processor.__class__.__name__ == "SimpleNamespace"
    assert counter.count(sample, [(40, 40)]) == enc.length
    per_clip = sample.media_tokens["video"]
    assert per_clip == [family.num_video_tokens(f, w, h, processor, fps=r) for f, w, h, r in ((8, 64, 48, 4.0), (12, 84, 56, 1.0))]
    assert TokenCounter(processor, family.name, folder).count(sample, [(40, 40)]) == enc.length


# ------------------------------------------------------------------------------------------------ packed rows


def _samples() -> list[Sample]:
    slow, fast = _clip(8, 64, 48, 4), _clip(6, 84, 56, 12)  # 4 and 6 temporal patches, timestamps spaced apart
    return [
        Sample("video", _turns({"type": "video", "index": 0}, _text("What moves?")), videos=[slow]),
        Sample("text", _turns(_text("What color is the picture?"), answer="Green.")),
        Sample("image-and-videos", _turns({"type": "image", "index": 0}, {"type": "video", "index": 0}, _text("and"),
                                          {"type": "video", "index": 1}, _text("?")), images=[png_bytes(40)], videos=[fast, slow]),
    ]


def test_a_packed_row_with_videos_gives_each_sample_its_unpacked_positions_logits_and_loss(tiny):
    import torch

    from vlmctl.data.collate import Collator, PackedCollator, model_inputs
    from vlmctl.train.objectives import loss_sum

    _, processor, family, model = tiny
    samples = _samples()
    packed = PackedCollator(processor, family, tokens_per_batch=4096, dummy_image=False)(samples)
    assert packed["video_grid_thw"][:, 0].tolist() == [4, 3, 4]  # three videos, eleven runs of video tokens
    packed = family.position_hook(model, model.config.image_token_id)(packed)
    assert tuple(packed["position_ids"].shape) == (4, 1, packed["input_ids"].shape[1])
    start, total = 0, 0.0
    with torch.no_grad():
        logits = model(**model_inputs(packed), use_cache=False).logits
        for sample, n in zip(samples, packed["seq_lens"]):
            alone = Collator(processor, family, dummy_image=False)([sample])
            assert alone["input_ids"].shape[1] == n
            expect, _ = model.model.get_rope_index(alone["input_ids"], alone["mm_token_type_ids"],
                                                   image_grid_thw=alone.get("image_grid_thw"), video_grid_thw=alone.get("video_grid_thw"))
            assert torch.equal(packed["position_ids"][1:, :, start:start + n], expect), sample.id
            assert torch.equal(packed["position_ids"][0, 0, start:start + n], torch.arange(n)), sample.id
            unpacked = model(**model_inputs(alone), use_cache=False).logits
            assert torch.allclose(logits[:, start:start + n], unpacked, rtol=1e-4, atol=1e-5), sample.id
            total += loss_sum(model, alone).item()
            start += n
        assert loss_sum(model, packed).item() == pytest.approx(total, rel=1e-5)
        padded = Collator(processor, family, dummy_image=False)(samples)
        assert loss_sum(model, padded).item() == pytest.approx(total, rel=1e-5)
        # the video positions matter: with the text positions alone the packed loss differs
        plain = {**packed, "position_ids": packed["position_ids"][:1]}
        assert abs(loss_sum(model, plain).item() - total) > 1e-4


def test_packed_positions_refuse_grids_that_do_not_match_the_tokens(tiny):
    from vlmctl.data.collate import PackedCollator
    from vlmctl.families.qwen_vl import packed_mrope_positions, rope_index_fn

    _, processor, family, model = tiny
    packed = PackedCollator(processor, family, tokens_per_batch=4096, dummy_image=False)(_samples()[:1])
    grid = packed["video_grid_thw"].clone()
    grid[0, 0] -= 1  # one temporal patch fewer than the tokens hold
    with pytest.raises(ModelError, match="video tokens"):
        packed_mrope_positions(rope_index_fn(model), packed["input_ids"], packed["mm_token_type_ids"], packed["seq_lens"],
                               video_grid_thw=grid)
