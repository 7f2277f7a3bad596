"""`vlmctl.inference.features`: the engine's own merge of Qwen2-VL / Qwen2.5-VL visual features gives the language
model exactly the embeddings the model's forward gives it (pictures of several sizes, a video, padded rows), checks
the placeholder count on the host, and is used by every prefill of those models' prompts with position ids."""

from __future__ import annotations

import pytest
import torch

from test_engine import png, requests_for, sharpen
from vlmctl.families.registry import FAMILIES
from vlmctl.inference import GenerationRequest, load_for_generation
from vlmctl.inference.engine import DecodeEngine
from vlmctl.inference.features import MERGES, merge_for, qwen_merge
from vlmctl.inference.prompt import render_request
from vlmctl.inference.sampling import SamplingParams

MERGED = sorted(name for name, f in FAMILIES.items() if f.prompt_merge)


def _batch(engine, family, processor):
    """The device and host tensors of a batch: `requests_for` (a picture each, a video in the third) and a prompt
    with two pictures of other sizes."""
    requests = requests_for(family) + [GenerationRequest(messages=[{"role": "user", "content": [
        {"type": "image", "index": 0}, {"type": "image", "index": 1}, {"type": "text", "text": "Which is larger?"}]}],
        images=[png((200, 10, 10), side=64), png((10, 10, 200), side=48)])]
    rendered = [render_request(r, processor, family) for r in requests]
    return engine._inputs(rendered)


@pytest.mark.parametrize("name", MERGED)
def test_the_merge_gives_the_language_model_what_the_forward_gives_it(name, tiny_models):
    """Same embeddings (fp32, exactly), positions and mask reach the language model with the engine's merge as
    with the model's own forward; a batch whose placeholders do not match its grids is refused, naming both
    counts; without position ids or host tokens the forward keeps its own path."""
    family = FAMILIES[name]
    model, processor = load_for_generation(tiny_models(family.tiny_preset), device="cpu", dtype="fp32")
    engine = DecodeEngine(model, processor, max_slots=4, max_length=2048)
    inputs, host = _batch(engine, family, processor)
    assert inputs.get("pixel_values_videos") is not None
    assert int(host["attention_mask"].sum(1).min()) < host["attention_mask"].shape[1]  # padded rows
    merged = qwen_merge(model, family, inputs, host)
    assert "pixel_values" not in merged and "input_ids" not in merged
    with torch.inference_mode():
        own = engine.runner._capture(inputs)
        ours = engine.runner._capture(merged)
    assert torch.equal(ours["inputs_embeds"], own["inputs_embeds"])
    assert torch.equal(ours["position_ids"], own["position_ids"])
    assert torch.equal(ours["attention_mask"], own["attention_mask"])
    # one placeholder of the first picture turned into text: the host's count says so before the tower runs
    broken = host["input_ids"].clone()
    row, col = (broken == model.config.image_token_id).nonzero()[0].tolist()
    broken[row, col] = processor.tokenizer.pad_token_id
    with pytest.raises(ValueError, match="image features and image tokens do not match: the prompt batch has"):
        qwen_merge(model, family, inputs, {**host, "input_ids": broken})
    assert qwen_merge(model, family, {k: v for k, v in inputs.items() if k != "position_ids"}, host) is None
    assert qwen_merge(model, family, inputs, {k: v for k, v in host.items() if k != "input_ids"}) is None


@pytest.mark.parametrize("name", MERGED)
def test_every_prefill_of_pictures_merges_in_the_engine_and_answers_as_before(name, tiny_models):
    """Greedy answers of picture and video prompts with the merge equal those without it (the model's forward
    merging), and each prefill of them counts as merged (`/health`'s `merged_prefills`)."""
    family = FAMILIES[name]
    model, processor = load_for_generation(tiny_models(family.tiny_preset), device="cpu", dtype="fp32")
    sharpen(model)
    answers = []
    for merge in (True, False):
        engine = DecodeEngine(model, processor, max_slots=2, max_length=2048)
        if not merge:
            engine.runner.merge = None
        done = engine.generate(requests_for(family), SamplingParams(max_tokens=8))
        assert all(r.error is None for r in done), [r.error for r in done]
        answers.append([r.completions[0].token_ids for r in done])
        assert engine.describe()["merged_prefills"] == (engine.prefills if merge else 0) and engine.prefills > 0
    assert answers[0] == answers[1] and len({t for a in answers[0] for t in a}) > 2


def test_only_families_that_name_a_merge_take_the_engines(tiny_models):
    """The families that name one name a known merge; Qwen3-VL hands its language model DeepStack features as well,
    so its forward keeps the merge, and so does LLaVA's."""
    assert MERGED and all(FAMILIES[name].prompt_merge in MERGES for name in MERGED)
    for preset, family in (("tiny-qwen3-vl", "qwen3_vl"), ("tiny", "llava")):
        model, _ = load_for_generation(tiny_models(preset), device="cpu", dtype="fp32")
        assert FAMILIES[family].prompt_merge is None and merge_for(model, FAMILIES[family]) is None
    model, _ = load_for_generation(tiny_models("tiny-qwen2.5-vl"), device="cpu", dtype="fp32")
    assert merge_for(model, FAMILIES["qwen2_5_vl"]) is not None
