"""The Gemma 3 family module: module paths and layer classes on the real class, the visual-token rule against the
real processor, and why the family trains on padded batches (`supports_packing=False`)."""

from __future__ import annotations

import io

from vlmctl.config.model import ModelSection
from vlmctl.families import get_family

TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import decoder_layer_classes, vision_layer_classes
    from vlmctl.models.build import instantiate, plan_build

    spec = get_family("gemma3")
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == spec.model_class
    for path in (spec.vision_tower, *spec.projector, spec.language_model, spec.lm_head):
        model.get_submodule(path)
    assert [c.__name__ for c in decoder_layer_classes(model, spec)] == list(spec.decoder_layer_classes)
    assert [c.__name__ for c in vision_layer_classes(model, spec)] == list(spec.vision_layer_classes)
    assert model.config.text_config.layer_types == ["sliding_attention"] * 2


def test_visual_token_rule_matches_the_real_processor():
    from PIL import Image

    from vlmctl.models.build import make_processor, plan_build

    spec = get_family("gemma3")
    plan = plan_build(ModelSection(preset=spec.tiny_preset, init="random"))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    tok = processor.tokenizer
    assert (tok.boi_token, tok.eoi_token, tok.image_token) == ("<start_of_image>", "<end_of_image>", spec.image_token)
    image_id = tok.convert_tokens_to_ids(spec.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    assert spec.image_prompt in text and spec.image_token not in text
    for w, h in [(64, 64), (300, 200), (37, 211)]:
        batch = processor(images=[Image.new("RGB", (w, h))], text=[text], return_tensors="pt")
        assert spec.num_visual_tokens(w, h, processor) == int((batch["input_ids"] == image_id).sum()) == 4
        assert int(batch["token_type_ids"].sum()) == 4  # the image tokens, attended bidirectionally
    assert spec.fixed_image_tokens
    assert spec.num_visual_tokens(896, 896, {"vision_config": {}, "mm_tokens_per_image": 256}) == 256


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 40, 40)).save(buf, "PNG")
    return buf.getvalue()


def test_packed_rows_would_leak_image_attention_across_samples():
    # An image sample and a text-only sample in one packed row: the sliding-window layers look image blocks up by
    # in-sample position, so the text sample's first tokens attend as if they were the other sample's image. The
    # padded batch is right (equal to the samples one by one); hence supports_packing=False.
    import torch

    from vlmctl.data.collate import Collator, PackedCollator
    from vlmctl.data.sample import Sample
    from vlmctl.models.build import make_model, make_processor, plan_build
    from vlmctl.train.objectives import loss_sum

    spec = get_family("gemma3")
    assert not spec.supports_packing
    plan = plan_build(ModelSection(preset=spec.tiny_preset, init="random", dtype="fp32"))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    model = make_model(plan, processor).eval()
    # random init: the projector is drawn, not transformers' zeros, so images reach the loss from the first step
    assert model.get_submodule(spec.projector[0]).mm_input_projection_weight.abs().sum() > 0
    answer = {"role": "assistant", "content": [{"type": "text", "text": "red"}]}
    samples = [
        Sample(id="img", images=[_png(64, 64)], messages=[
            {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What color?"}]}, answer]),
        Sample(id="txt", messages=[{"role": "user", "content": [{"type": "text", "text": "How many circles are there?"}]}, answer]),
    ]
    with torch.no_grad():
        one_by_one = sum(float(loss_sum(model, Collator(processor, spec, dummy_image=False)([s]))) for s in samples)
        padded = float(loss_sum(model, Collator(processor, spec)(samples)))
        packed = float(loss_sum(model, PackedCollator(processor, spec, tokens_per_batch=512)(samples)))
    # padded: float noise (~1e-7 of the loss); packed: the leak, thousands of times more
    assert abs(padded - one_by_one) < 1e-5 * one_by_one
    assert abs(packed - one_by_one) > 1e-4 * one_by_one
