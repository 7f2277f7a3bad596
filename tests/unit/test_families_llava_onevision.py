"""The LLaVA-OneVision family module: module paths and layer classes on the real class, the anyres visual-token
rule (with its `anyres_max_N` cap) against the real processor and from a config, and the tiles kept per image."""

from __future__ import annotations

from vlmctl.config.model import ModelSection
from vlmctl.families import get_family
from vlmctl.families.llava_onevision import llava_onevision_tokens

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import decoder_layer_classes, vision_layer_classes
    from vlmctl.models.build import instantiate, plan_build

    spec = get_family("llava_onevision")
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == spec.model_class
    for path in (spec.vision_tower, *spec.projector, spec.language_model, spec.lm_head):
        model.get_submodule(path)
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == list(spec.decoder_layer_classes)
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == list(spec.vision_layer_classes)
    assert model.config.vision_aspect_ratio == "anyres_max_2"


def _processor():
    from vlmctl.models.build import make_processor, plan_build

    spec = get_family("llava_onevision")
    return spec, make_processor(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), tokenizer_texts=TEXTS)


def test_visual_token_rule_matches_the_real_processor():
    from PIL import Image

    spec, processor = _processor()
    assert (processor.num_image_tokens, processor.vision_aspect_ratio) == ((32 // 8) ** 2, "anyres_max_2")
    assert processor.image_processor.image_grid_pinpoints[-1] == [96, 32]
    image_id = processor.tokenizer.convert_tokens_to_ids(spec.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    seen = set()
    for w, h in [(64, 64), (100, 60), (37, 211), (300, 200), (20, 20), (30, 90)]:
        batch = processor(images=[Image.new("RGB", (w, h))], text=[text], return_tensors="pt")
        actual = int((batch["input_ids"] == image_id).sum())
        assert spec.num_visual_tokens(w, h, processor) == actual, (w, h)
        seen.add(actual)
    assert len(seen) > 2


def test_visual_token_rule_from_a_config():
    # llava-onevision-qwen2-0.5b-ov-hf: SigLIP 384 px tiles of 27 x 27 patches, anyres_max_9, `full` strategy.
    config = {"vision_config": {"image_size": 384, "patch_size": 14}}
    assert llava_onevision_tokens(384, 384, config) == 27 * 27 + 27 + 729  # one tile: 27 x 27 + newlines + base
    # 2304 x 2304 is 6 x 6 tiles: 162 x 162 features, shrunk by sqrt(162**2 / (9 * 27**2)) = 2 to 81 x 81
    assert llava_onevision_tokens(2304, 2304, config) == 81 * 81 + 81 + 729


def test_processor_outputs_keep_the_tiles_of_each_image():
    from PIL import Image

    spec, processor = _processor()
    text = "<image><image>hi"
    images = [Image.new("RGB", (64, 64)), Image.new("RGB", (37, 211))]
    flat = processor(images=images, text=[text], return_tensors="pt")  # a flat list: single images, each tiled
    assert flat["batch_num_images"].tolist() == [1, 1]
    assert tuple(spec.processor_outputs(flat, processor)["pixel_values"].shape) == (5 + 4, 3, 32, 32)
    nested = processor(images=[images], text=[text], return_tensors="pt")  # one multi-image sample: a view each
    assert nested["batch_num_images"].tolist() == [2]
    assert tuple(spec.processor_outputs(nested, processor)["pixel_values"].shape) == (2, 3, 32, 32)


def test_video_modality_token_rule_and_stand_in_video_processor():
    import pickle

    import numpy as np

    from vlmctl.families.llava_onevision import llava_onevision_video_tokens

    spec, processor = _processor()
    assert spec.prompt("video") == "<video>" and spec.video_processor_class == "LlavaOnevisionVideoProcessor"
    # 4 x 4 features per 32 px frame, pooled 2 x 2 to 2 x 2, plus one newline per clip; the frame size does not matter
    assert [spec.num_video_tokens(f, 640, 480, processor) for f in (1, 2, 8)] == [5, 9, 33]
    assert llava_onevision_video_tokens(2, 1, 1, {"vision_config": {"image_size": 384, "patch_size": 14}}) == 2 * 14 * 14 + 1
    video = processor.video_processor  # the torchvision-free stand-in here (no torchvision on CPU test machines)
    clip = np.zeros((2, 40, 24, 3), np.uint8)
    assert tuple(video(videos=[clip], return_tensors="pt")["pixel_values_videos"].shape) == (1, 2, 3, 32, 32)
    copy = pickle.loads(pickle.dumps(video))  # DataLoader workers get the processor by pickling
    assert copy.size == video.size and type(copy) is type(video)
