"""Video training for Qwen2/2.5-VL on a tiny random-init model: the processor's video tensors (the torchvision-free
stand-in against the library's own patch layout), token counts, packed rows with 3-D mRoPE equal to padded
batches (loss and gradients), and the FLOP model against torch's counter."""

from __future__ import annotations

import ast

import pytest

pytest.importorskip("av")

from video_data import moving_square, png_bytes  # noqa: E402

from vlmctl.config.data import DataVideo  # noqa: E402
from vlmctl.data.modalities.video import decode_clip, normalize_video  # noqa: E402
from vlmctl.data.sample import Sample  # noqa: E402

TEXTS = ["What moves in the video? A red square moves to the right. What color is the picture? Green."] * 20
VIDEO_SIZE = {"shortest_edge": 3136, "longest_edge": 56 * 84}  # small grids: a few tokens per temporal patch


def _clip(frames: int, width: int, height: int, fps: int, settings: DataVideo | None = None) -> bytes:
    settings = settings or DataVideo(fps=fps, max_frames=64, min_pixels=16, max_pixels=width * height)
    return normalize_video(moving_square(frames=frames, width=width, height=height, fps=fps), settings).data


def _turns(*user_parts, answer: str = "A red square moves to the right.") -> list[dict]:
    return [{"role": "user", "content": list(user_parts)}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, processor, family, model): the tiny Qwen2.5-VL preset, random init, fp32, eager attention,
    its video processor's pixel bounds made small and saved (the counter reads them from the folder)."""
    import torch

    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_model, load_processor

    out = tmp_path_factory.mktemp("video-qwen") / "model"
    build_model(ModelSection(preset="tiny-qwen2.5-vl", init="random", output_dir=out), tokenizer_texts=TEXTS)
    processor = load_processor(out)
    processor.video_processor.size = dict(VIDEO_SIZE)
    processor.save_pretrained(out)
    torch.manual_seed(0)
    model, processor, family = load_model(out, dtype="fp32")
    model.set_attn_implementation("eager")
    assert processor.video_processor.size == VIDEO_SIZE  # read back from the folder
    return out, processor, family, model


# ------------------------------------------------------------------------------------------------ processor


def _library_patchify():
    """transformers' own `Qwen2VLVideoProcessor.patchify`, compiled from its source file (the module itself
    imports torchvision, which this machine may not have)."""
    import importlib.util

    import torch

    path = importlib.util.find_spec("transformers.models.qwen2_vl").submodule_search_locations[0] + "/video_processing_qwen2_vl.py"
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify")
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), namespace)
    return namespace["patchify"]


def test_the_stand_in_video_processor_has_the_library_layout_and_token_count(tiny):
    import numpy as np
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from vlmctl.families.qwen_video import FramesVideoProcessor

    _, processor, family, _ = tiny
    video = FramesVideoProcessor(size=VIDEO_SIZE, patch_size=14, merge_size=2, temporal_patch_size=2)
    patchify = _library_patchify()
    rng = np.random.default_rng(0)
    for frames, (h, w) in [(4, (48, 64)), (5, (56, 84)), (8, (100, 30))]:
        clip = rng.integers(0, 256, size=(frames, h, w, 3), dtype=np.uint8)
        out = video(videos=[clip], return_tensors="pt")
        # the library's patchify over the same resized, normalized frames ([B, T, C, H, W])
        single = Qwen2VLImageProcessorPil(size=VIDEO_SIZE, patch_size=14, merge_size=2, temporal_patch_size=2)
        per_frame = [single(images=[f], return_tensors="np", do_resize=True) for f in clip]
        gh, gw = (int(x) for x in per_frame[0]["image_grid_thw"][0][1:])
        pixels = torch.stack([torch.from_numpy(p["pixel_values"].reshape(gh // 2, gw // 2, 2, 2, 3, 2, 14, 14)[..., 0, :, :])
                              .permute(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * 14, gw * 14) for p in per_frame])
        expected, t, eh, ew = patchify(None, pixels[None], patch_size=14, merge_size=2, temporal_patch_size=2)
        assert out["video_grid_thw"].tolist() == [[t, eh, ew]] == [[-(-frames // 2), gh, gw]]
        assert torch.allclose(out["pixel_values_videos"], expected[0], atol=1e-6)
        assert family.num_video_tokens(frames, w, h, processor) == t * eh * ew // 4 == video.get_num_of_video_patches(frames, h, w) // 4


def test_processor_outputs_and_token_counts_of_video_samples(tiny):
    from vlmctl.data.collate import encode_sample
    from vlmctl.data.tokens import TokenCounter

    folder, processor, family, _ = tiny
    clips = [_clip(8, 64, 48, 8), _clip(12, 84, 56, 4)]  # 8 frames at 8 fps; 12 frames at 4 fps
    sample = Sample("v", _turns({"type": "video", "index": 0}, _text("Then"), {"type": "video", "index": 1}, _text("what moved?")),
                    videos=clips, images=[png_bytes(40)])
    sample.messages[0]["content"].insert(0, {"type": "image", "index": 0})
    enc = encode_sample(sample, processor, family)
    grids = enc.media_inputs["video"]["video_grid_thw"].tolist()
    assert [g[0] for g in grids] == [4, 6]  # frames / temporal patch 2
    # Qwen2.5-VL's seconds per temporal patch: 2 frames / the clip's rate
    assert enc.media_inputs["video"]["second_per_grid_ts"].tolist() == pytest.approx([2 / 8, 2 / 4])
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    per_clip = [family.num_video_tokens(*_shape(c), processor) for c in clips]
    assert int((enc.input_ids == video_id).sum()) == sum(per_clip) == sum(g[0] * g[1] * g[2] // 4 for g in grids)
    # the counter prepare uses (read from the folder's files, no transformers) counts the same tokens
    counter = TokenCounter.load(folder)
    assert counter.processor.__class__.__name__ == "SimpleNamespace"
    assert counter.count(sample, [(40, 40)]) == enc.length
    assert sample.media_tokens == {"image": [family.num_visual_tokens(40, 40, processor)], "video": per_clip}
    assert TokenCounter(processor, family.name, folder).count(sample, [(40, 40)]) == enc.length


def _shape(clip: bytes) -> tuple[int, int, int]:
    frames = decode_clip(clip).frames
    return frames.shape[0], frames.shape[2], frames.shape[1]


# ------------------------------------------------------------------------------------------------ packed rows


def _samples() -> list[Sample]:
    slow, fast = _clip(8, 64, 48, 4), _clip(12, 84, 56, 12)  # 2 fps and 6 fps after sampling: other temporal spacing
    return [
        Sample("video", _turns({"type": "video", "index": 0}, _text("What moves?")), videos=[slow]),
        Sample("text", _turns(_text("What color is the picture?"), answer="Green.")),
        Sample("both", _turns({"type": "image", "index": 0}, {"type": "video", "index": 0}, _text("What moves?")),
               images=[png_bytes(40)], videos=[fast]),
        Sample("two-videos", _turns({"type": "video", "index": 0}, _text("and"), {"type": "video", "index": 1}, _text("?")),
               videos=[fast, slow]),
    ]


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_packed_row_with_videos_equals_the_padded_batch(tiny):
    import torch

    from vlmctl.data.collate import Collator, PackedCollator
    from vlmctl.train.objectives import loss_sum

    _, processor, family, model = tiny
    samples = _samples()
    packed = PackedCollator(processor, family, tokens_per_batch=4096, dummy_image=False)(samples)
    padded = Collator(processor, family, dummy_image=False)(samples)
    assert packed["video_grid_thw"].tolist() == padded["video_grid_thw"].tolist() and len(packed["video_grid_thw"]) == 4
    assert len(set(packed["second_per_grid_ts"].tolist())) == 2
    hook = family.position_hook(model, model.config.image_token_id)
    packed = hook(packed)
    assert tuple(packed["position_ids"].shape) == (4, 1, packed["input_ids"].shape[1])
    # each sample's 3-D positions are the model's own for that sample alone (temporal spacing included)
    start = 0
    for i, n in enumerate(packed["seq_lens"]):
        ids = padded["input_ids"][i:i + 1, :n]
        alone = PackedCollator(processor, family, tokens_per_batch=4096, dummy_image=False)([samples[i]])
        expect, _ = model.model.get_rope_index(ids, padded["mm_token_type_ids"][i:i + 1, :n],
                                               image_grid_thw=alone.get("image_grid_thw"), video_grid_thw=alone.get("video_grid_thw"),
                                               second_per_grid_ts=alone.get("second_per_grid_ts"))
        assert torch.equal(packed["position_ids"][1:, :, start:start + n], expect), samples[i].id
        start += n
    model.zero_grad(set_to_none=True)
    loss_packed = loss_sum(model, packed)
    loss_packed.backward()
    g_packed = _grads(model)
    model.zero_grad(set_to_none=True)
    loss_padded = loss_sum(model, padded)
    loss_padded.backward()
    g_padded = _grads(model)
    model.zero_grad(set_to_none=True)
    assert packed["num_label_tokens"] == padded["num_label_tokens"] and packed["num_visual_tokens"] == padded["num_visual_tokens"]
    assert loss_packed.item() == pytest.approx(loss_padded.item(), rel=1e-5)
    assert g_packed.keys() == g_padded.keys() and any("visual.patch_embed" in n for n in g_packed)
    for name in g_packed:
        assert torch.allclose(g_packed[name], g_padded[name], rtol=1e-4, atol=1e-6), name
    # the video positions matter: without the hook's positions the packed loss differs
    plain = {k: v for k, v in packed.items() if k != "position_ids"}
    plain["position_ids"] = packed["position_ids"][:1]
    with torch.no_grad():
        assert abs(loss_sum(model, plain).item() - loss_padded.item()) > 1e-4


def test_a_row_with_video_needs_no_dummy_image(tiny):
    from vlmctl.data.collate import Collator, PackedCollator

    _, processor, family, _ = tiny
    video, text = _samples()[:2]
    assert Collator(processor, family)([video, text])["num_dummy_images"] == 0  # the vision tower runs on the video
    assert Collator(processor, family)([text])["num_dummy_images"] == 1
    row = PackedCollator(processor, family, tokens_per_batch=4096)([video])
    assert row["num_dummy_images"] == 0 and row["num_dummy_videos"] == 0 and "pixel_values" not in row


# ------------------------------------------------------------------------------------------------ FLOPs


def test_batch_flops_count_video_patches_like_the_flop_counter(tiny):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from vlmctl.data.collate import PackedCollator
    from vlmctl.train.flops import CostModel
    from vlmctl.train.objectives import loss_sum

    _, processor, family, model = tiny
    sample = _samples()[0]
    batch = family.position_hook(model, model.config.image_token_id)(
        PackedCollator(processor, family, tokens_per_batch=4096, dummy_image=False)([sample]))
    cost = CostModel.from_model(model, family, {"vision", "projector", "llm"})
    terms = cost.batch_terms(batch)
    t, h, w = batch["video_grid_thw"][0].tolist()
    assert terms["vision"] > 0 and terms["projector"] > 0
    with FlopCounterMode(display=False) as counter:
        loss_sum(model, batch).backward()
    model.zero_grad(set_to_none=True)
    measured = counter.get_total_flops()
    expected = sum(terms.values()) + terms["llm_attention"]  # the counter computes the causal half too
    assert abs(expected - measured) / measured < 0.03, (expected, measured, terms)
    # the vision term is per patch (t * h * w of them, each embedding two frames), not per frame
    no_video = {k: v for k, v in batch.items() if k not in ("video_grid_thw", "pixel_values_videos")}
    assert cost.batch_terms(no_video)["vision"] == 0
    per_patch = terms["vision"] / (t * h * w)
    assert per_patch == pytest.approx(cost.batch_terms({**batch, "video_grid_thw": torch.tensor([[2 * t, h, w]])})["vision"] / (2 * t * h * w))
