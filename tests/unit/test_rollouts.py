"""`vlmctl.train.rollouts.generate_rollouts`: G answers per prompt in one batch, split back into prompt and
completion token ids."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from vlmctl.errors import UsageError
from vlmctl.inference import GenerationRequest, generate, load_for_generation
from vlmctl.train.rollouts import generate_rollouts

TEXTS = ["What color is the square?", "Name a primary color.", "How many sides?", "red blue green"]


def request(text: str, rgb=None) -> GenerationRequest:
    from PIL import Image

    parts, images = [], []
    if rgb:
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), rgb).save(buf, format="PNG")
        parts, images = [{"type": "image", "index": 0}], [buf.getvalue()]
    return GenerationRequest(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], images=images)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    folder: Path = tmp_path_factory.mktemp("rollouts") / "tiny"
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder, dtype="fp32"), tokenizer_texts=TEXTS * 5)
    return load_for_generation(folder, device="cpu", dtype="fp32")


def test_greedy_rollouts_are_the_generate_answers_repeated_per_group(loaded):
    model, processor = loaded
    requests = [request(TEXTS[0], (200, 30, 30)), request(TEXTS[2])]
    expected = [g.text for g in generate(model, processor, requests, batch_size=1, max_new_tokens=6)]
    model.train()
    out = generate_rollouts(model, processor, requests, group_size=3, max_new_tokens=6, temperature=0.0)
    assert model.training  # its mode is given back
    assert out.prompt_index == [0, 0, 0, 1, 1, 1]
    assert out.texts == [expected[0]] * 3 + [expected[1]] * 3
    tok = processor.tokenizer
    for i, (prompt, completion) in enumerate(zip(out.prompt_ids, out.completion_ids)):
        assert 1 <= len(completion) <= 6
        assert out.finished[i] == (completion[-1] in {tok.eos_token_id, *([model.generation_config.eos_token_id] if
                                                                            isinstance(model.generation_config.eos_token_id, int) else [])})
    from vlmctl.inference.prompt import render_request

    text_only = render_request(requests[1], processor).text  # no left padding kept, nothing added
    assert out.prompt_ids[3] == tok(text_only, add_special_tokens=False)["input_ids"]
    image_token = tok.convert_tokens_to_ids(processor.image_token)
    assert out.prompt_ids[0].count(image_token) > 1 and image_token not in out.prompt_ids[3]  # visual tokens kept
    assert out.completion_tokens == sum(len(c) for c in out.completion_ids)


def test_sampled_rollouts_of_a_group_differ_and_follow_the_seed(loaded):
    model, processor = loaded
    torch.manual_seed(0)
    first = generate_rollouts(model, processor, [request(TEXTS[1])], group_size=4, max_new_tokens=8, temperature=1.5)
    torch.manual_seed(0)
    again = generate_rollouts(model, processor, [request(TEXTS[1])], group_size=4, max_new_tokens=8, temperature=1.5)
    assert first.completion_ids == again.completion_ids
    assert len({tuple(c) for c in first.completion_ids}) > 1  # a random tiny model at temperature 1.5 varies


def test_bad_settings_are_refused_with_the_key_to_fix(loaded):
    with pytest.raises(UsageError, match="group_size"):
        generate_rollouts(*loaded, [request(TEXTS[0])], group_size=0, max_new_tokens=4)
    with pytest.raises(UsageError, match="top_p"):
        generate_rollouts(*loaded, [request(TEXTS[0])], group_size=2, max_new_tokens=4, top_p=0.0)


def test_extra_requests_run_in_the_batch_and_are_left_out(loaded):
    model, processor = loaded
    requests = [request(TEXTS[2])]
    plain = generate_rollouts(model, processor, requests, group_size=2, max_new_tokens=5, temperature=0.0)
    padded = generate_rollouts(model, processor, requests, group_size=2, max_new_tokens=5, temperature=0.0,
                               extra_requests=[request(".", (0, 0, 0))])
    assert padded.prompt_index == [0, 0] and len(padded.completion_ids) == 2
    assert padded.prompt_ids == plain.prompt_ids  # the extra row's left padding is not kept
    assert padded.texts == plain.texts


def test_media_placeholders_are_never_sampled(loaded):
    """A completion is trained on after its prompt: an image token in it would ask for image features it lacks."""
    model, processor = loaded
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)

    def favour_image_token(module, args, out):
        out[..., image_token] += 100.0
        return out

    handle = model.lm_head.register_forward_hook(favour_image_token)
    try:
        with torch.no_grad():  # the hook makes the image token every position's most likely one
            assert int(model(input_ids=torch.tensor([[1, 2, 3]])).logits[0, -1].argmax()) == image_token
        out = generate_rollouts(model, processor, [request(TEXTS[0], (0, 200, 0))], group_size=2, max_new_tokens=4, temperature=0.0)
    finally:
        handle.remove()
    assert all(ids and image_token not in ids for ids in out.completion_ids)


def test_a_model_trained_with_the_varlen_kernel_generates_its_padded_rollouts_with_sdpa(loaded):
    from vlmctl.train import kernels

    model, processor = loaded
    requests = [request(TEXTS[0], (200, 30, 30)), request(TEXTS[2])]
    expected = generate_rollouts(model, processor, requests, group_size=2, max_new_tokens=4, temperature=0.0).texts
    kernels.register_varlen_attention()
    text_config = model.config.get_text_config()
    before = model.config._attn_implementation_internal, text_config._attn_implementation_internal
    text_config._attn_implementation_internal = kernels.VARLEN_NAME  # as a packed GPU run sets it (batch size 1 only)
    try:
        got = generate_rollouts(model, processor, requests, group_size=2, max_new_tokens=4, temperature=0.0).texts
        assert text_config._attn_implementation_internal == kernels.VARLEN_NAME  # given back for training
    finally:
        model.config._attn_implementation_internal, text_config._attn_implementation_internal = before
    assert got == expected


def sharpened(model):
    """Larger random weights: answers that vary with the prompt and end at an end-of-sequence token now and then."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def test_the_rollout_engine_gives_the_rollouts_of_generate_on_a_replica_of_the_policy(tmp_path_factory):
    """Greedy: the engine's rollouts (a replica of the policy, its weights copied by `refresh`) are
    `generate_rollouts`' token for token, prompts and all; after a weight update, `refresh` brings the replica along.
    Sampled: the same torch seed draws the same rollouts; each token's log-probability is the trainer's (logits over
    the temperature, a forward over prompt + completion)."""
    from vlmctl.config import ModelSection
    from vlmctl.inference.prompt import model_family
    from vlmctl.models.build import build_model
    from vlmctl.train.rollouts import RolloutEngine

    folder: Path = tmp_path_factory.mktemp("rollout-engine") / "tiny"
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder, dtype="fp32"), tokenizer_texts=TEXTS * 5)
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    sharpened(model)
    family = model_family(model)
    requests = [request(TEXTS[0], (200, 30, 30)), request(TEXTS[2])]
    sampler = RolloutEngine(processor, family, max_slots=6)
    assert sampler.refresh(model) and sampler.replica is not model
    mine = sampler.generate(requests, group_size=3, max_new_tokens=8, temperature=0.0)
    theirs = generate_rollouts(model, processor, requests, group_size=3, max_new_tokens=8, temperature=0.0)
    assert (mine.completion_ids, mine.prompt_ids, mine.finished, mine.texts) == (
        theirs.completion_ids, theirs.prompt_ids, theirs.finished, theirs.texts)
    assert mine.how.startswith("vlmctl engine") and len(set(map(tuple, mine.completion_ids))) == 2
    with torch.no_grad():  # a training step changes the policy: the next phase's rollouts follow it
        for p in model.parameters():
            p.mul_(0.5)
    assert sampler.refresh(model)
    after = sampler.generate(requests, group_size=3, max_new_tokens=8, temperature=0.0)
    assert after.completion_ids == generate_rollouts(model, processor, requests, group_size=3, max_new_tokens=8,
                                                     temperature=0.0).completion_ids
    torch.manual_seed(5)
    sampled = sampler.generate(requests, group_size=3, max_new_tokens=8, temperature=1.3)
    torch.manual_seed(5)
    again = sampler.generate(requests, group_size=3, max_new_tokens=8, temperature=1.3)
    assert sampled.completion_ids == again.completion_ids and len(set(map(tuple, sampled.completion_ids))) > 2
    from vlmctl.inference.generation import _model_inputs
    from vlmctl.inference.prompt import render_request

    for i in (0, 4):
        rendered = render_request(requests[sampled.prompt_index[i]], processor, family)
        inputs = _model_inputs(model, processor, [rendered.text], rendered.images)
        ids = torch.cat([inputs["input_ids"], torch.tensor([sampled.completion_ids[i]])], dim=1)
        with torch.no_grad():
            logits = model(**{**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}).logits[0].float()
        n, k = inputs["input_ids"].shape[1], len(sampled.completion_ids[i])
        expected = torch.log_softmax(logits[n - 1: n - 1 + k] / 1.3, -1).gather(1, torch.tensor(sampled.completion_ids[i])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(sampled.logprobs[i]), expected, atol=1e-4)
