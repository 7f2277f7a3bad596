"""Video for LLaVA-OneVision on the tiny random-init preset: the video-token rule against the real processor, the
torchvision-free video processor (values, saved as transformers' class and read back), a built folder that vanilla
transformers' model class runs on a clip (forward and generate), and video samples through the padded and packed
collators into a training step (finite loss, vision-tower gradients, packed = padded)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("av")

from video_data import moving_square, png_bytes  # noqa: E402

from vlmctl.config.data import DataVideo  # noqa: E402
from vlmctl.data.modalities.video import decode_clip, normalize_video  # noqa: E402
from vlmctl.data.sample import Sample  # noqa: E402

TEXTS = ["What moves in the video? A red square moves to the right. What color is the picture? Green."] * 20
FRAMES = 4  # min_frames = max_frames: every clip keeps as many frames (one 5-D tensor per batch)


def _clip(frames: int, width: int, height: int, fps: int) -> bytes:
    settings = DataVideo(fps=fps, min_frames=FRAMES, max_frames=FRAMES, min_pixels=16, max_pixels=width * height)
    return normalize_video(moving_square(frames=frames, width=width, height=height, fps=fps), settings).data


def _turns(*user_parts, answer: str = "A red square moves to the right.") -> list[dict]:
    return [{"role": "user", "content": list(user_parts)}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def _video_feature_rows(out) -> int:
    """The visual tokens the model made of its video: `video_hidden_states` (tokens, dim) before transformers 5.24,
    `video_outputs.pooler_output` (videos, tokens, dim) since (where `video_hidden_states` is deprecated)."""
    outputs = getattr(out, "video_outputs", None)
    features = outputs.pooler_output if outputs is not None else out.video_hidden_states
    return features.reshape(-1, features.shape[-1]).shape[0]


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, processor, family, model): the tiny LLaVA-OneVision preset built by `model build`, loaded
    back in fp32 with eager attention."""
    import torch

    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_model

    out = tmp_path_factory.mktemp("video-llava-ov") / "model"
    build_model(ModelSection(preset="tiny-llava-onevision", init="random", output_dir=out), tokenizer_texts=TEXTS)
    torch.manual_seed(0)
    model, processor, family = load_model(out, dtype="fp32")
    model.set_attn_implementation("eager")
    return out, processor, family, model


# ------------------------------------------------------------------------------------------------ processor


def test_video_token_rule_matches_the_real_processor(tiny):
    import numpy as np

    from vlmctl.families.llava_onevision import llava_onevision_video_tokens

    folder, processor, family, model = tiny
    assert family.prompt("video") == "<video>" and processor.num_image_tokens == 16  # 4 x 4 patches per 32 px tile
    video_id = processor.tokenizer.convert_tokens_to_ids("<video>")
    assert video_id == model.config.video_token_id
    seen = set()
    for frames, w, h in [(1, 32, 32), (2, 64, 48), (4, 20, 90), (7, 33, 17)]:
        clip = np.zeros((frames, h, w, 3), np.uint8)
        batch = processor(text=["<video>hi"], videos=[clip], return_tensors="pt")
        actual = int((batch["input_ids"] == video_id).sum())
        assert family.num_video_tokens(frames, w, h, processor) == actual == frames * 2 * 2 + 1, (frames, w, h)
        assert family.num_video_tokens(frames, w, h, model.config) == actual  # from the config: (32 / 8)**2 per frame
        seen.add(actual)
    assert len(seen) == 4
    # the saved settings (what `data prepare` counts from, without transformers) give the same count
    saved = json.loads((folder / "processor_config.json").read_text())
    assert family.num_video_tokens(3, 64, 48, saved) == 13
    # llava-onevision-qwen2-0.5b-ov-hf: 27 x 27 features per frame, pooled to 14 x 14
    assert llava_onevision_video_tokens(8, 640, 480, {"vision_config": {"image_size": 384, "patch_size": 14}}) == 8 * 196 + 1


def test_the_stand_in_video_processor_resizes_and_normalizes_like_the_images(tiny):
    import numpy as np
    import torch

    _, processor, _, _ = tiny
    video, improc = processor.video_processor, processor.image_processor
    assert type(video).stands_for == "LlavaOnevisionVideoProcessor"
    assert video.size == {"height": 32, "width": 32} and list(video.image_mean) == list(improc.image_mean)
    colour = np.array([200, 30, 90], np.uint8)
    clip = np.broadcast_to(colour, (3, 48, 64, 3)).copy()  # a flat colour: resizing keeps it exactly
    out = video(videos=[clip, clip], return_tensors="pt")["pixel_values_videos"]
    assert tuple(out.shape) == (2, 3, 3, 32, 32) and out.dtype == torch.float32
    expected = (colour / 255 - np.array(improc.image_mean)) / np.array(improc.image_std)
    assert torch.allclose(out[1, 2, :, 5, 7], torch.tensor(expected, dtype=torch.float32), atol=1e-5)
    # frames are seen as tiles: a frame the tile size gives the base view of the image processor's output
    frame = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    from PIL import Image

    tiles = improc(images=[Image.fromarray(frame)], return_tensors="pt")["pixel_values"][0]
    assert torch.allclose(video(videos=[frame[None]], return_tensors="pt")["pixel_values_videos"][0, 0], tiles[0], atol=1e-5)
    with pytest.raises(ValueError, match="does not sample frames"):
        video(videos=[clip], do_sample_frames=True)


def test_the_built_folder_takes_video_in_transformers(tiny):
    import torch
    from transformers import AutoConfig, LlavaOnevisionForConditionalGeneration

    folder, processor, family, _ = tiny
    saved = json.loads((folder / "processor_config.json").read_text())
    assert saved["video_processor"]["video_processor_type"] == "LlavaOnevisionVideoProcessor"  # torchvision loads the real one
    assert saved["video_processor"]["size"] == {"height": 32, "width": 32}
    assert AutoConfig.from_pretrained(folder).video_token_id == processor.video_token_id
    frames = decode_clip(_clip(8, 64, 48, 8)).frames
    assert frames.shape[0] == FRAMES
    # the data pipeline writes the video part as the family's prompt (`VideoUnit.template_part`); vlmctl's ChatML
    # template (random-init presets) writes the same for a video part
    messages = [{"role": "user", "content": [_text(family.prompt("video")), _text("What moves?")]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text.count("<video>") == 1
    as_part = [{"role": "user", "content": [{"type": "video"}, _text("What moves?")]}]
    assert processor.apply_chat_template(as_part, add_generation_prompt=True) == text
    inputs = processor(text=[text], videos=[frames], return_tensors="pt")
    assert tuple(inputs["pixel_values_videos"].shape) == (1, FRAMES, 3, 32, 32)
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(out.logits).all()
    assert _video_feature_rows(out) == family.num_video_tokens(FRAMES, 64, 48, processor)
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3


# ------------------------------------------------------------------------------------------------ training


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _samples() -> list[Sample]:
    slow, fast = _clip(8, 64, 48, 4), _clip(12, 48, 48, 12)
    return [
        Sample("video", _turns({"type": "video", "index": 0}, _text("What moves?")), videos=[slow]),
        Sample("text", _turns(_text("What color is the picture?"), answer="Green.")),
        Sample("both", _turns({"type": "image", "index": 0}, {"type": "video", "index": 0}, _text("What moves?")),
               images=[png_bytes(40)], videos=[fast]),
    ]


def test_video_samples_train_padded_and_packed(tiny):
    import torch

    from vlmctl.data.collate import Collator, PackedCollator, encode_sample
    from vlmctl.train.objectives import loss_sum

    _, processor, family, model = tiny
    samples = _samples()
    enc = encode_sample(samples[0], processor, family)
    assert tuple(enc.media_inputs["video"]["pixel_values_videos"].shape) == (1, FRAMES, 3, 32, 32)
    video_id = processor.tokenizer.convert_tokens_to_ids("<video>")
    assert int((enc.input_ids == video_id).sum()) == family.num_video_tokens(FRAMES, 64, 48, processor)
    padded = Collator(processor, family, dummy_image=False)(samples)
    packed = PackedCollator(processor, family, tokens_per_batch=4096, dummy_image=False)(samples)
    assert tuple(padded["pixel_values_videos"].shape) == (2, FRAMES, 3, 32, 32)
    assert torch.equal(packed["pixel_values_videos"], padded["pixel_values_videos"])
    model.train()
    model.zero_grad(set_to_none=True)
    loss_padded = loss_sum(model, padded)
    loss_padded.backward()
    g_padded = _grads(model)
    model.zero_grad(set_to_none=True)
    loss_packed = loss_sum(model, packed)
    loss_packed.backward()
    g_packed = _grads(model)
    model.zero_grad(set_to_none=True)
    assert torch.isfinite(loss_padded) and loss_padded.item() > 0
    vision = [n for n in g_padded if n.startswith(family.vision_tower + ".")]
    assert vision and all(g_padded[n].abs().sum() > 0 for n in vision if "embeddings.patch_embedding" in n)
    assert any("embeddings.patch_embedding" in n for n in vision)
    assert packed["num_label_tokens"] == padded["num_label_tokens"]
    assert loss_packed.item() == pytest.approx(loss_padded.item(), rel=1e-5)
    for name in g_padded:
        assert torch.allclose(g_packed[name], g_padded[name], rtol=1e-4, atol=1e-6), name


def test_a_batch_of_clips_with_different_frame_counts_is_refused(tiny):
    from vlmctl.data.collate import Collator
    from vlmctl.errors import DataError

    _, processor, family, _ = tiny
    long = normalize_video(moving_square(frames=8, width=32, height=32, fps=8),
                           DataVideo(fps=8, min_frames=6, max_frames=6, min_pixels=16, max_pixels=1024)).data
    samples = [_samples()[0], Sample("long", _turns({"type": "video", "index": 0}, _text("What moves?")), videos=[long])]
    with pytest.raises(DataError, match="different frame") as err:
        Collator(processor, family, dummy_image=False)(samples)
    assert "min_frames" in err.value.hint


# ------------------------------------------------------------------------------------------------ compose mode


def test_compose_mode_builds_llava_onevision_that_takes_images_and_video(tmp_path):
    """`model.family: llava_onevision` with a composed model (the tiny preset's SigLIP + Qwen2, as `model.vision` +
    `model.llm` would give): the class vanilla transformers loads, anyres tiles of the encoder's size, and a clip
    through the saved processor."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmctl.config import ModelSection
    from vlmctl.families import compose_family
    from vlmctl.models import build_model, load_model
    from vlmctl.models.build import plan_build

    assert plan_build(ModelSection(preset="tiny", init="random")).family.name == "llava"  # the default layout stays LLaVA
    result = build_model(ModelSection(preset="tiny", init="random", family="llava_onevision", output_dir=tmp_path / "m"),
                         tokenizer_texts=TEXTS)
    assert result.family == "llava_onevision"
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["LlavaOnevisionForConditionalGeneration"]
    assert config["image_grid_pinpoints"][0] == [64, 64] and config["vision_aspect_ratio"] == "anyres_max_9"
    model, processor, family = load_model(tmp_path / "m", dtype="fp32")
    assert family.name == "llava_onevision" and processor.num_image_tokens == 64  # 64 px tiles of 8 px patches
    frames = decode_clip(_clip(8, 64, 48, 8)).frames
    text = processor.apply_chat_template([{"role": "user", "content": [_text(family.prompt("video")), _text("What moves?")]}],
                                         add_generation_prompt=True)
    inputs = processor(text=[text], videos=[frames], return_tensors="pt")
    vanilla = AutoModelForImageTextToText.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    with torch.no_grad():
        out = vanilla(**inputs)
        generated = vanilla.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert _video_feature_rows(out) == family.num_video_tokens(FRAMES, 64, 48, processor)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3
    # an image through the anyres tiles: the count the family's rule gives
    from PIL import Image

    image = Image.new("RGB", (130, 64), "red")
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, _text("Color?")]}], add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    assert int((inputs["input_ids"] == vanilla.config.image_token_id).sum()) == family.num_visual_tokens(130, 64, processor)
    with torch.no_grad():
        assert torch.isfinite(vanilla(**inputs).logits).all()
    # a family that does not compose, or a connector this layout does not hold, is refused by name
    from vlmctl.errors import ModelError

    with pytest.raises(ModelError, match="model.family=qwen2_5_vl does not compose"):
        compose_family("mlp2x_gelu", "qwen2_5_vl")
    with pytest.raises(ModelError, match="holds no model.projector=perceiver"):
        compose_family("perceiver", "llava_onevision")
