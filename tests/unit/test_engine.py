"""`vlmctl.inference.engine`: greedy answers equal transformers' `generate` token for token for every family that
generates; continuous batching admits a request while others decode; rows with different settings in one batch each
get what they asked; cancellation frees a slot; sampling depends on a row's own seed only; the decode attention
equals sdpa."""

from __future__ import annotations

import io
import math

import pytest
import torch

from audio_data import wav
from video_data import moving_square
from vlmctl.families.registry import FAMILIES
from vlmctl.families.spec import FamilySpec
from vlmctl.inference import GenerationRequest, load_for_generation
from vlmctl.inference.engine import DecodeEngine
from vlmctl.inference.generation import _model_inputs
from vlmctl.inference.prompt import render_request
from vlmctl.inference.sampling import SamplingParams, sample, uniform_noise

TEXTS = ["What color is the square?", "Name a primary color.", "How many sides?", "Describe the sound.", "What moves?"]


def png(rgb, side: int = 32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), rgb).save(buf, format="PNG")
    return buf.getvalue()


def requests_for(family) -> list[GenerationRequest]:
    """Three requests in the modalities `family` takes: an image each (where it takes images), an audio clip in the
    second (or in each, for audio-only families), a video in the third (where it takes videos)."""
    out = []
    for i, text in enumerate(TEXTS[:3]):
        parts, media = [], {}
        if "image" in family.modalities:
            parts.append({"type": "image", "index": 0})
            media["images"] = [png((i * 60, 30, 200 - i * 40))]
        if "audio" in family.modalities and (i == 1 or "image" not in family.modalities):
            parts.append({"type": "audio", "index": 0})
            media["audios"] = [wav(0.5 + 0.25 * i)]
        if "video" in family.modalities and i == 2:
            parts.append({"type": "video", "index": 0})
            media["videos"] = [moving_square(frames=4)]
        out.append(GenerationRequest(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                                     id=str(i), **media))
    return out


def sharpen(model, seed: int = 1, scale: float = 0.3, embeddings: bool = True) -> None:
    """Random weights of a larger scale: a tiny random model's next token then depends on its context (with the
    init's small weights every answer is one token repeated, which would compare nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and (embeddings or "embed" not in name):
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def hf_greedy(model, processor, family, request, max_new_tokens: int, eos: set[int], **kwargs) -> list[int]:
    """transformers' `generate` on one request alone: the tokens before its first end-of-sequence token."""
    rendered = render_request(request, processor, family)
    inputs = _model_inputs(model, processor, [rendered.text], rendered.images, rendered.audios, rendered.videos)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=processor.tokenizer.pad_token_id, **kwargs)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    return next((ids[:k] for k, t in enumerate(ids) if t in eos), ids)


@pytest.fixture(scope="module")
def llava(tiny_models):
    model, processor = load_for_generation(tiny_models("tiny"), device="cpu", dtype="fp32")
    sharpen(model)
    return model, processor


GENERATING = sorted(name for name, f in FAMILIES.items() if f.tiny_preset)


# families whose language model takes only embeddings, positions and a padding mask: their prefill is bucketed
PADDED = {"idefics2", "idefics3", "llava", "llava_next", "mistral3", "qwen2_5_omni", "qwen2_5_vl", "qwen2_audio", "qwen2_vl",
          "smolvlm"}


@pytest.mark.parametrize("padded", [False, True], ids=["chunked", "bucketed"])
@pytest.mark.parametrize("name", GENERATING)
def test_greedy_answers_equal_generate_token_for_token(name, padded, tiny_models):
    """Two slots for three requests (the third joins when a slot frees), prompts prefilled two at a time (padded)
    in chunks of 16 tokens where the family's arguments allow, or (`bucketed`) padded to a (rows, length) bucket
    as CUDA graphs replay them, the padded rows in the scratch slot: every answer is `generate`'s, fp32."""
    family = FAMILIES[name]
    model, processor = load_for_generation(tiny_models(family.tiny_preset), device="cpu", dtype="fp32")
    if padded:
        engine = DecodeEngine(model, processor, max_slots=3, max_length=2048)
        engine.runner.pad_prefill = True  # what CUDA graphs turn on, run eagerly
    else:
        engine = DecodeEngine(model, processor, max_slots=2, max_length=2048, prefill_chunk=16)
    requests = requests_for(family)
    for scale, embeddings in ((0.3, True), (0.05, True), (0.05, False)):  # Gemma scales its embeddings: smaller weights
        sharpen(model, scale=scale, embeddings=embeddings)
        expected = [hf_greedy(model, processor, family, r, 8, engine.eos) for r in requests]
        if len({t for e in expected for t in e}) > 2:
            break
    assert len({t for e in expected for t in e}) > 2, expected  # answers of varied tokens: the comparison says something
    done = engine.generate(requests, SamplingParams(max_tokens=8))
    assert all(r.error is None for r in done), [r.error for r in done]
    assert [r.completions[0].token_ids for r in done] == expected
    assert engine.prefills < len(requests) or "image" not in family.modalities or engine.steps > 0
    if padded and name in PADDED:
        assert engine.runner.padded_prefills > 0


def test_a_request_submitted_while_others_decode_starts_within_two_steps(llava):
    engine = DecodeEngine(*llava, max_slots=4, max_length=512)
    prompts = requests_for(FAMILIES["llava"])
    first = [engine.submit(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts[:2]]
    for _ in range(3):
        engine.step()
    assert engine.running == 2 and engine.steps == 3
    late = engine.submit(prompts[2], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    assert late.admitted_step is not None and late.admitted_step - late.submitted_step <= 2
    assert engine.running == 3  # decoding beside the first two, which are not done
    assert not any(r.finished for r in first)
    while engine.busy:
        engine.step()
    assert all(len(r.completions[0].token_ids) == 12 for r in [*first, late])


def test_rows_with_different_settings_in_one_batch_each_get_what_they_asked(llava):
    """Greedy, seeded sampling, a stop string, a short max_tokens and log-probs side by side: each row's answer is
    the one it gets alone."""
    model, processor = llava
    prompt = requests_for(FAMILIES["llava"])[0]
    greedy = DecodeEngine(model, processor, max_slots=1).generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    text = greedy[0].completions[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2].strip() or text[-1]
    settings = [SamplingParams(max_tokens=10, ignore_eos=True),
                SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
                SamplingParams(max_tokens=10, stop=(stop,), ignore_eos=True),
                SamplingParams(max_tokens=3, ignore_eos=True),
                SamplingParams(max_tokens=10, logprobs=2, ignore_eos=True)]
    together = DecodeEngine(model, processor, max_slots=5).generate([prompt] * 5, settings)
    alone = [DecodeEngine(model, processor, max_slots=1).generate([prompt], [s])[0] for s in settings]
    assert [r.completions[0].token_ids for r in together] == [r.completions[0].token_ids for r in alone]
    greedy_ids = greedy[0].completions[0].token_ids
    assert together[0].completions[0].token_ids == greedy_ids
    assert together[1].completions[0].token_ids != greedy_ids  # sampling at 0.8 leaves the argmax somewhere
    cut = together[2].completions[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and text.startswith(cut.text)
    short = together[3].completions[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"
    scored = together[4].completions[0]
    assert len(scored.logprobs) == 10 and all(len(top) == 2 for _, _, top in scored.logprobs)
    # each log-prob is the raw distribution's, as a forward over the whole answer gives it
    rendered = render_request(prompt, processor)
    inputs = _model_inputs(model, processor, [rendered.text], rendered.images)
    ids = torch.cat([inputs["input_ids"], torch.tensor([scored.token_ids])], dim=1)
    with torch.inference_mode():
        logits = model(**{**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}).logits[0].float()
    n = inputs["input_ids"].shape[1]
    expected = torch.log_softmax(logits[n - 1 : n - 1 + 10], dim=-1).gather(1, torch.tensor(scored.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp for _, lp, _ in scored.logprobs]), expected, atol=1e-4)
    assert [t for t, _, _ in scored.logprobs] == scored.token_ids


def test_overlapped_steps_give_what_steps_one_at_a_time_give(llava):
    """A step launched before the tokens of the one before it are taken changes no answer: rows of different
    lengths, samplers, a stop string and rows that run into the end of the cache, more requests than slots (a slot
    freed one step late goes to the next request), against the same engine taking every step's tokens at once."""
    model, processor = llava
    prompts = requests_for(FAMILIES["llava"])
    probe = DecodeEngine(model, processor, max_slots=1, max_length=512, overlap=False)
    text = probe.generate([prompts[0]], SamplingParams(max_tokens=10, ignore_eos=True))[0].completions[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2].strip() or text[-1]
    length = probe.generate([prompts[1]], SamplingParams(max_tokens=1))[0].prompt_tokens
    settings = [SamplingParams(max_tokens=9, ignore_eos=True),
                SamplingParams(max_tokens=14, temperature=0.9, top_p=0.8, seed=5, ignore_eos=True),
                SamplingParams(max_tokens=10, stop=(stop,), ignore_eos=True),
                SamplingParams(max_tokens=64, ignore_eos=True),  # ends at the cache's end
                SamplingParams(max_tokens=2, ignore_eos=True),
                SamplingParams(max_tokens=64, temperature=1.0, seed=9, ignore_eos=True)]
    order = [prompts[i] for i in (1, 2, 0, 1, 2, 0)]  # the stop string's row asks what the probe answered
    answers = {}
    for overlap in (False, True):
        engine = DecodeEngine(model, processor, max_slots=3, max_length=length + 20, strict_context=False, overlap=overlap)
        done = engine.generate(order, settings)
        assert all(r.error is None for r in done), [r.error for r in done]
        answers[overlap] = [(c.token_ids, c.finish_reason) for r in done for c in r.completions]
        assert engine.overlapped > 0 if overlap else engine.overlapped == 0
        assert engine._pending is None and all(s is None for s in engine.slots)
    assert answers[True] == answers[False]
    assert {reason for _, reason in answers[True]} == {"length", "stop"}
    assert max(len(ids) for ids, _ in answers[True]) < 64  # the cache's end stopped the long rows


def test_first_tokens_read_after_the_next_launch_give_what_reading_them_at_admission_gives(llava):
    """First tokens left on the device for the next step and read back after its launch (`defer_first`) change no
    answer: a row its first token ends (a stop token, `max_tokens=1`), a row that frees its slot at once for the
    next request, two choices of one request, sampled rows, against the engine reading each first token at
    admission. Rows asking for log-probs or a repetition penalty keep the read at admission; each request's
    first token is taken in the step that admits it."""
    model, processor = llava
    prompts = requests_for(FAMILIES["llava"])
    opening = DecodeEngine(model, processor, max_slots=1).generate([prompts[0]], SamplingParams(max_tokens=1))
    token = opening[0].completions[0].token_ids[0]
    settings = [SamplingParams(max_tokens=8, ignore_eos=True),
                SamplingParams(max_tokens=8, stop_token_ids=(token,), ignore_eos=True),  # ends at its first token
                SamplingParams(max_tokens=1, ignore_eos=True),
                SamplingParams(max_tokens=9, temperature=0.9, seed=4, ignore_eos=True),
                SamplingParams(max_tokens=6, logprobs=1, ignore_eos=True),
                SamplingParams(max_tokens=6, repetition_penalty=1.3, ignore_eos=True)]
    order = [prompts[1], prompts[0], prompts[2], prompts[0], prompts[1], prompts[2]]
    answers = {}
    for defer in (False, True):
        engine = DecodeEngine(model, processor, max_slots=4, max_length=512)
        engine.defer_first = defer
        done = [engine.submit(p, q, n=2 if i == 3 else 1) for i, (p, q) in enumerate(zip(order, settings))]
        while engine.busy:
            engine.step()
        engine.settle()
        assert all(r.error is None for r in done), [r.error for r in done]
        answers[defer] = [(c.token_ids, c.finish_reason) for r in done for c in r.completions]
        assert not engine._firsts and engine._pending is None and all(s is None for s in engine.slots)
        assert (engine.deferred_first > 0) == defer and engine.deferred_first < engine.prefills
        single = engine.submit(prompts[2], SamplingParams(max_tokens=5, ignore_eos=True))
        engine.step()
        assert single.completions[0].generated == 1 and single.first_token_at is not None
        while engine.busy:
            engine.step()
    assert answers[True] == answers[False]
    assert answers[True][1] == ([], "stop") and len(answers[True][2][0]) == 1
    assert len({ids[0] for ids, _ in answers[True] if ids}) > 1  # first tokens that differ: their order is checked


def test_a_cancelled_row_frees_its_slot_and_sends_nothing_more(llava):
    engine = DecodeEngine(*llava, max_slots=1, max_length=512)
    prompts = requests_for(FAMILIES["llava"])
    events = []
    long = engine.submit(prompts[0], SamplingParams(max_tokens=50, ignore_eos=True), on_event=events.append)
    engine.step()
    engine.step()
    waiting = engine.submit(prompts[1], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert waiting.admitted_step is None  # the only slot is taken
    engine.cancel(long)
    seen, generated = len(events), long.completions[0].generated
    engine.step()
    assert waiting.admitted_step is not None and engine.slots[0].request is waiting
    while engine.busy:
        engine.step()
    # one event after the cancel, its end (a caller waiting for the answer is let go), and no text
    assert long.finished and events[seen:] == [("error", 499, long.error[1], "client_closed")], events[seen:]
    assert not any(e[0] == "end" for e in events)
    assert long.completions[0].generated == generated  # the step in flight at the cancel hands it nothing
    assert len(waiting.completions[0].token_ids) == 4


def test_choices_share_one_prefill_and_sample_apart(llava):
    engine = DecodeEngine(*llava, max_slots=4, max_length=512)
    prompt = requests_for(FAMILIES["llava"])[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6), n=3)[0]
    assert engine.prefills == 1 and len({tuple(c.token_ids) for c in greedy.completions}) == 1
    sampled = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True), n=3)[0]
    again = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True), n=3)[0]
    assert [c.token_ids for c in sampled.completions] == [c.token_ids for c in again.completions]
    assert len({tuple(c.token_ids) for c in sampled.completions}) > 1


def test_the_context_is_refused_or_the_cache_grows(llava):
    model, processor = llava
    prompt = requests_for(FAMILIES["llava"])[0]
    strict = DecodeEngine(model, processor, max_slots=1, max_length=40)
    events = []
    strict.submit(prompt, SamplingParams(max_tokens=32), on_event=events.append)
    strict.step()
    assert events[-1][0] == "error" and events[-1][1] == 400 and events[-1][3] == "context_length_exceeded"
    growing = DecodeEngine(model, processor, max_slots=1, max_length=40, strict_context=False, max_context=4096)
    grown = growing.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    roomy = DecodeEngine(model, processor, max_slots=1, max_length=1024).generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert growing.max_length >= 64 and grown.completions[0].token_ids == roomy.completions[0].token_ids


def test_repetition_penalty_equals_transformers(llava):
    model, processor = llava
    prompt = requests_for(FAMILIES["llava"])[1]
    engine = DecodeEngine(model, processor, max_slots=1, max_length=512)
    mine = engine.generate([prompt], SamplingParams(max_tokens=12, repetition_penalty=1.5))[0].completions[0].token_ids
    theirs = hf_greedy(model, processor, FAMILIES["llava"], prompt, 12, engine.eos, repetition_penalty=1.5)
    assert mine == theirs


def test_a_rows_draws_depend_on_its_seed_and_step_only():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    args = dict(temperature=torch.full((3,), 1.0), top_p=torch.ones(3), top_k=torch.zeros(3, dtype=torch.long))
    seeds, steps = torch.tensor([11, 12, 13]), torch.tensor([0, 5, 9])
    together = sample(logits, **args, seeds=seeds, steps=steps)
    for i in range(3):
        alone = sample(logits[i:i + 1], temperature=torch.ones(1), top_p=torch.ones(1), top_k=torch.zeros(1, dtype=torch.long),
                       seeds=seeds[i:i + 1], steps=steps[i:i + 1])
        assert alone.item() == together[i].item()
    noise = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 1000)
    assert (noise > 0).all() and (noise < 1).all() and not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])


def test_draws_follow_the_filtered_softmax():
    """20,000 draws over 5 tokens: frequencies within 0.015 of the probabilities; top-k and top-p leave out what they
    should (transformers' rules: top-k, then the smallest set reaching top_p)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 20_000
    rows = logits.expand(n, -1)
    ones = torch.ones(n)
    draws = sample(rows, ones, ones, torch.zeros(n, dtype=torch.long), torch.full((n,), 5), torch.arange(n))
    freq = torch.bincount(draws, minlength=5).float() / n
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.015)
    top2 = sample(rows, ones, ones, torch.full((n,), 2), torch.full((n,), 5), torch.arange(n))
    assert set(top2.tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    nucleus = sample(rows, ones, torch.full((n,), float(p[0] + p[1] - 0.01)), torch.zeros(n, dtype=torch.long),
                     torch.full((n,), 5), torch.arange(n))
    assert set(nucleus.tolist()) == {0, 1}
    greedy = sample(rows, torch.zeros(n), ones, torch.zeros(n, dtype=torch.long), torch.full((n,), 5), torch.arange(n))
    assert set(greedy.tolist()) == {0}


def test_sampling_settings_are_checked():
    from vlmctl.errors import UsageError

    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1}, {"repetition_penalty": 0}):
        with pytest.raises(UsageError):
            SamplingParams(**bad)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_decode_attention_equals_eager_attention(softcap):
    """One query token per row, 8 heads over 2 key/value heads, a per-row mask: the grouped product equals
    attention with repeated key/value heads."""
    from vlmctl.inference.runner import decode_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 3, 8, 2, 11, 16
    q = torch.randn(batch, heads, 1, dim)
    k, v = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    allowed = torch.arange(length)[None, :] <= torch.tensor([4, 10, 0])[:, None]  # [B, L]
    mask = torch.zeros(batch, length).masked_fill(~allowed, float("-inf")).repeat_interleave(kv_heads, 0)[:, None, None, :]
    out, _ = decode_attention(None, q, k, v, mask, scaling=0.25, softcap=softcap)
    kk, vv = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = (q @ kk.transpose(2, 3)) * 0.25
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    expected = (scores.softmax(-1) @ vv).transpose(1, 2)  # [B, 1, H, D]
    assert out.shape == (batch, 1, heads, dim)
    assert torch.allclose(out, expected, atol=1e-5)


def test_engine_says_how_it_decodes(llava):
    engine = DecodeEngine(*llava, max_slots=2)
    info = engine.describe()
    assert info["decode"] == "eager" and info["decode_reason"] == "not a CUDA device" and info["slots"] == 2
    assert not math.isnan(engine.max_length)


def _rotate_halves(q, k, cos, sin, unsqueeze_dim=1):
    """RoPE written apart from transformers' (the halves rotated explicitly): what liger's kernel computes."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def turn(x):
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        c, s = cos[..., :half], sin[..., :half]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    return turn(q), turn(k)


def _interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """RoPE over interleaved pairs (GPT-J's layout): not what a rotate-half model computes."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def turn(x):
        a, b = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., 0::2], sin[..., 0::2]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)

    return turn(q), turn(k)


def test_rope_is_routed_only_where_the_candidate_gives_the_models_result(tiny_models, monkeypatch):
    """`route_rope` replaces Qwen2.5-VL's `apply_rotary_pos_emb` by a candidate that computes the same rotation (the
    model's logits stay the same and every layer calls it), refuses one that rotates interleaved pairs, skips a
    module routed before and a function of another signature."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as qwen

    from vlmctl.families.spec import _find_prefix
    from vlmctl.inference.runner import route_rope

    monkeypatch.setattr(qwen, "apply_rotary_pos_emb", qwen.apply_rotary_pos_emb)  # restored after the test
    model, processor = load_for_generation(tiny_models("tiny-qwen2.5-vl"), device="cpu", dtype="fp32")
    sharpen(model)
    family = FAMILIES["qwen2_5_vl"]
    lm = model.get_submodule(_find_prefix(model, family.language_model))
    config = model.config.get_text_config()
    rendered = render_request(requests_for(family)[0], processor, family)
    inputs = _model_inputs(model, processor, [rendered.text], rendered.images)
    with torch.no_grad():
        before = model(**inputs).logits

    assert route_rope(lm, _interleaved, config, torch.device("cpu"), torch.float32) == []
    assert qwen.apply_rotary_pos_emb.__module__ == qwen.__name__

    calls = []

    def counted(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(q.shape)
        return _rotate_halves(q, k, cos, sin, unsqueeze_dim)

    assert route_rope(lm, counted, config, torch.device("cpu"), torch.float32) == ["modeling_qwen2_5_vl"]
    calls.clear()
    with torch.no_grad():
        after = model(**inputs).logits
    assert len(calls) == config.num_hidden_layers
    assert torch.allclose(after, before, atol=1e-4)
    assert route_rope(lm, counted, config, torch.device("cpu"), torch.float32) == []  # routed once

    monkeypatch.setattr(qwen, "apply_rotary_pos_emb", lambda q, k, cos, sin, position_ids=None, unsqueeze_dim=1: (q, k))
    assert route_rope(lm, _rotate_halves, config, torch.device("cpu"), torch.float32) == []


def test_a_streamed_token_whose_text_is_held_back_still_sends_a_delta(llava, monkeypatch):
    """Each streamed token sends one delta: its new text, or an empty one while its text is held back (here all of
    it, as a partial character or a stop string's start would be); the deltas add up to the final text."""
    from vlmctl.inference.engine import _Choice

    engine = DecodeEngine(*llava, max_slots=1, max_length=512)
    prompt = requests_for(FAMILIES["llava"])[0]
    whole = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].completions[0].text
    monkeypatch.setattr(_Choice, "_safe", lambda self, text: "")
    events = []
    request = engine.submit(prompt, SamplingParams(max_tokens=10, ignore_eos=True), on_event=events.append, stream=True)
    while not request.finished:
        engine.step()
    deltas = [e[2] for e in events if e[0] == "delta"]
    assert len(deltas) == 10  # nine held back (empty), the last with the whole text at the finish
    assert deltas[:9] == [""] * 9 and "".join(deltas) == request.completions[0].text == whole and whole


@pytest.mark.parametrize("interval", [1, 4])
def test_a_stream_interval_sends_the_first_token_then_every_nth_and_the_same_text(llava, interval):
    """`stream_interval`: a streamed choice sends a delta at its first token, then at every `interval`-th, and one at
    its end; the deltas join to the text every token's deltas give, which is the unstreamed answer."""
    prompt = requests_for(FAMILIES["llava"])[0]
    whole = DecodeEngine(*llava, max_slots=1, max_length=512).generate(
        [prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].completions[0].text
    engine = DecodeEngine(*llava, max_slots=1, max_length=512, stream_interval=interval)
    events = []
    request = engine.submit(prompt, SamplingParams(max_tokens=10, ignore_eos=True), on_event=events.append, stream=True)
    while not request.finished:
        engine.step()
    deltas = [e[2] for e in events if e[0] == "delta"]
    # tokens 1..9 stream at the due ones (the 10th finishes the row, and its delta is the rest of the text)
    due = [k for k in range(1, 10) if interval == 1 or k == 1 or k % interval == 0]
    assert len(deltas) == len(due) + 1
    assert "".join(deltas) == request.completions[0].text == whole and whole


def test_a_stream_interval_below_one_is_refused(llava):
    from vlmctl.errors import UsageError

    with pytest.raises(UsageError, match="stream interval"):
        DecodeEngine(*llava, max_slots=1, max_length=64, stream_interval=0)


def test_windowed_encoders_attend_with_the_varlen_kernel_on_cuda_in_16_bit(tiny_models, monkeypatch):
    """`encoder_varlen` switches Qwen2.5-VL's vision tower (per-window attention) to the varlen kernel's
    flash-named implementation in bf16 on CUDA, and leaves it alone off CUDA, in fp32, or without the kernel; LLaVA's
    tower (no windows) is never switched."""
    import vlmctl.train.kernels as kernels
    from vlmctl.inference.runner import encoder_varlen

    cuda = torch.device("cuda")
    for preset, family, dtype, device, has, expected in (
            ("tiny-qwen2.5-vl", "qwen2_5_vl", "bf16", cuda, True, ["vision_config"]),
            ("tiny-qwen2.5-vl", "qwen2_5_vl", "bf16", torch.device("cpu"), True, []),
            ("tiny-qwen2.5-vl", "qwen2_5_vl", "fp32", cuda, True, []),
            ("tiny-qwen2.5-vl", "qwen2_5_vl", "bf16", cuda, False, []),
            ("tiny", "llava", "bf16", cuda, True, [])):
        monkeypatch.setattr(kernels, "_has_varlen", lambda has=has: has)
        model, _ = load_for_generation(tiny_models(preset), device="cpu", dtype=dtype)
        assert encoder_varlen(model, FAMILIES[family], device) == expected
        vision = model.config.vision_config._attn_implementation
        assert (vision == kernels.VISION_VARLEN_NAME) == bool(expected), (preset, dtype, device, vision)


class _Replay:
    """A CUDA graph's stand-in on the CPU: replaying runs the captured step again (on the same buffers)."""

    replays = 0

    def __init__(self, run):
        self.run = run

    def replay(self):
        _Replay.replays += 1
        self.run()


def _answers(engine) -> list[list[int]]:
    """Greedy, seeded-sampled and greedy answers to three requests decoded together."""
    prompts = requests_for(FAMILIES["llava"])
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True)]
    requests = [engine.submit(p, q) for p, q in zip(prompts, params)]
    while engine.busy:
        engine.step()
    return [r.completions[0].token_ids for r in requests]


def test_warmup_captures_every_decode_bucket_before_requests_and_they_capture_none(llava):
    plain = DecodeEngine(*llava, max_slots=4, max_length=512)
    assert plain.warmup(300) == (0, pytest.approx(0.0, abs=1.0))  # no graphs on the CPU: nothing to capture
    want = _answers(plain)

    warm = DecodeEngine(*llava, max_slots=4, max_length=512)
    warm.runner.use_graphs, warm.runner._capture_run = True, _Replay  # graphs as on a GPU, replayed by the stand-in
    captured, _ = warm.warmup(300)  # rows of <= 300 positions: length buckets 128, 256 and 512 (the one covering 300)
    assert captured == 3 * 3 * 2 and set(warm.runner._graphs) == {
        (rows, length, greedy) for rows in (1, 2, 4) for length in (128, 256, 512) for greedy in (True, False)}
    assert warm.warmup(300)[0] == 0  # captured once
    _Replay.replays = 0
    assert _answers(warm) == want  # the captures left every buffer as it was
    assert warm.runner.captures == captured and _Replay.replays >= 10  # every step replayed a warm graph


def test_warmup_captures_the_prefill_buckets_so_requests_of_those_shapes_capture_none(llava):
    """With padded prefills on, the warm-up also prefills text prompts of each (rows, length) bucket twice: every
    bucket up to the engine's rows and the warm-up's length is captured before any request, requests of those
    shapes (pictures and all: the language model sees embeddings) capture nothing more, and their answers are those
    of an engine that was never warmed."""
    want = _answers(DecodeEngine(*llava, max_slots=4, max_length=512, prefill_graphs=True))
    warm = DecodeEngine(*llava, max_slots=4, max_length=512, prefill_graphs=True)
    warm.runner.use_graphs, warm.runner._capture_run = True, _Replay
    captured, _ = warm.warmup(128)
    prefill = {k[1:3] for k in warm.runner._graphs if k[0] == "prefill"}
    assert prefill == {(rows, width) for rows in (1, 2, 4) for width in (32, 64, 128)}
    assert captured == len(warm.runner._graphs) == 3 * 2 + 9  # decode: 3 row buckets x length 128 x greedy/sampled
    _Replay.replays = 0
    got = _answers(warm)
    assert got == want and warm.runner.captures == captured and warm.runner.prefill_graphs >= 1
    assert warm.prefills >= 2 * 9  # the warm-up's own prefills, twice per bucket


@pytest.mark.parametrize("name", GENERATING)
def test_the_prefill_warmup_fits_every_chat_template_and_warms_only_padded_prefills(name, tiny_models):
    """The warm-up's text prompt lands in each length window under every family's chat template; a family whose
    prefills run padded gets every (rows, length) bucket captured, any other family one prefill and no bucket."""
    from vlmctl.inference.prompt import render_request

    model, processor = load_for_generation(tiny_models(FAMILIES[name].tiny_preset), device="cpu", dtype="fp32")
    engine = DecodeEngine(model, processor, max_slots=2, max_length=512, prefill_graphs=True)
    for width in (32, 64, 128):
        prompt = engine._prompt_of(width)
        tokens = len(processor.tokenizer(render_request(prompt, processor, engine.family).text,
                                         add_special_tokens=False)["input_ids"])
        assert tokens <= width and (width == 32 or tokens > width // 2), (width, tokens)
    engine.runner.use_graphs, engine.runner._capture_run = True, _Replay
    engine.warmup(128)
    prefill = {k[1:3] for k in engine.runner._graphs if k[0] == "prefill"}
    if name in PADDED:
        assert prefill == {(rows, width) for rows in (1, 2) for width in (32, 64, 128)}
    else:
        assert not prefill and engine.prefills == 1


HOST_POSITIONS = sorted(name for name, f in FAMILIES.items()
                        if f.tiny_preset and type(f).prompt_positions is not FamilySpec.prompt_positions)


@pytest.mark.parametrize("name", HOST_POSITIONS)
def test_prompt_positions_on_the_host_are_the_ones_the_model_derives(name, tiny_models):
    """A prompt batch's position ids computed on the host (`FamilySpec.prompt_positions`) are the ones the model's
    forward derives on its own for the same tensors, rows of different lengths padded on the right; a prefill given
    them (and the host's padding mask) returns what it returns without them. Text-only prompts get their 1-D
    positions in the same three sections, and answer as transformers' `generate` does."""
    from vlmctl.inference.inputs import processor_inputs, to_model

    family = FAMILIES[name]
    model, processor = load_for_generation(tiny_models(family.tiny_preset), device="cpu", dtype="fp32")
    sharpen(model)
    engine = DecodeEngine(model, processor, max_slots=4, max_length=2048)
    assert engine._host_positions is not None
    rendered = [render_request(r, processor, family) for r in requests_for(family)[:2]]
    rendered[1] = render_request(GenerationRequest(messages=[{"role": "user", "content": [
        {"type": "image", "index": 0}, {"type": "text", "text": "A much longer question about the picture, in many words?"}]}],
        images=[png((10, 200, 30), side=64)]), processor, family)
    processor.tokenizer.padding_side = "right"
    host = processor_inputs(processor, [r.text for r in rendered], [i for r in rendered for i in r.images])
    lengths = host["attention_mask"].sum(dim=1).tolist()
    assert lengths[0] != lengths[1]  # one row is padded
    positions = engine._host_positions(host)
    with torch.inference_mode():
        own = engine.runner._capture(to_model(model, host))["position_ids"]
    assert positions.shape == own.shape and torch.equal(positions, own.to(positions.dtype))
    assert positions.amax() < positions.shape[-1] - 1  # the pictures' rows share positions: not a plain arange
    with torch.inference_mode():
        alone = engine.runner.prefill(to_model(model, host), [0, 1])
        given = engine.runner.prefill(to_model(model, {**host, "position_ids": positions}), [2, 3], {**host, "position_ids": positions})
    assert (given.positions, given.first, given.ends, given.tokens) == (alone.positions, alone.first, alone.ends, alone.tokens)
    assert torch.allclose(given.logits, alone.logits, atol=1e-5)
    # text-only prompts: 1-D positions in the three sections pictures give, so both share a padded prefill's shape;
    # the prefill and the greedy answers are the ones the language model's own positions give
    texts = [GenerationRequest(messages=[{"role": "user", "content": [{"type": "text", "text": t}]}]) for t in
             ("Name a color.", "Which shape has three sides and what color is it here?")]
    text_only = processor_inputs(processor, [render_request(r, processor, family).text for r in texts], [])
    lines = engine._host_positions(text_only)
    assert lines.shape[0] == positions.shape[0] and lines.shape[1:] == text_only["input_ids"].shape
    with torch.inference_mode():
        own = engine.runner.prefill(to_model(model, text_only), [0, 1])
        given = engine.runner.prefill(to_model(model, {**text_only, "position_ids": lines}), [2, 3],
                                      {**text_only, "position_ids": lines})
    assert (given.positions, given.first, given.ends, given.tokens) == (own.positions, own.first, own.ends, own.tokens)
    assert torch.allclose(given.logits, own.logits, atol=1e-5)
    padded = DecodeEngine(model, processor, max_slots=2, max_length=2048)
    padded.runner.pad_prefill = True  # what CUDA graphs turn on, run eagerly
    answers = padded.generate(texts, SamplingParams(max_tokens=8))
    assert [r.completions[0].token_ids for r in answers] == [hf_greedy(model, processor, family, r, 8, padded.eos) for r in texts]
    assert padded.runner.padded_prefills > 0 or name not in PADDED


@pytest.mark.parametrize("name", sorted(set(HOST_POSITIONS) & PADDED))
def test_picture_prompts_replay_the_prefill_graphs_of_the_text_warmup(name, tiny_models):
    """The warm-up's text prompts and picture prompts carry positions of one layout (three sections), so a picture
    prompt of a warmed (rows, length) bucket replays the graph the warm-up captured: nothing is captured for it and
    its first prefill is a replay."""
    family = FAMILIES[name]
    model, processor = load_for_generation(tiny_models(family.tiny_preset), device="cpu", dtype="fp32")
    warm = DecodeEngine(model, processor, max_slots=4, max_length=512, prefill_graphs=True)
    warm.runner.use_graphs, warm.runner._capture_run = True, _Replay
    warm.warmup(128)
    graphs, replays = set(warm.runner._graphs), warm.runner.prefill_graphs
    done = warm.generate(requests_for(family)[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(r.error is None for r in done)
    assert set(warm.runner._graphs) == graphs and warm.runner.prefill_graphs == replays + 1


COLLATING = sorted(name for name, f in FAMILIES.items() if f.tiny_preset and f.collate_prompts)


@pytest.mark.parametrize("name", COLLATING)
def test_prompts_processed_alone_batch_as_the_processor_batches_them(name, tiny_models):
    """For a family that says so (`FamilySpec.collate_prompts`), each prompt's processor tensors made alone and batched
    by `collate_inputs` are the processor's own tensors for the prompts together (right padding), or None where
    concatenation cannot give them (a modality only some prompts have); an engine fed such prepared prompts batches
    them at admission and answers as one that calls the processor."""
    from vlmctl.inference.inputs import collate_inputs, processor_inputs

    family = FAMILIES[name]
    model, processor = load_for_generation(tiny_models(family.tiny_preset), device="cpu", dtype="fp32")
    sharpen(model)
    requests = requests_for(family)
    rendered = [render_request(r, processor, family) for r in requests]
    alone = [processor_inputs(processor, [r.text], r.images, r.audios, r.videos) for r in rendered]
    processor.tokenizer.padding_side = "right"
    batched = []
    for group in ([0, 1, 2], [0, 1], [1, 2], [0, 0]):
        together = processor_inputs(processor, [rendered[i].text for i in group], [m for i in group for m in rendered[i].images],
                                    [m for i in group for m in rendered[i].audios], [m for i in group for m in rendered[i].videos])
        got = collate_inputs([alone[i] for i in group], processor.tokenizer.pad_token_id)
        if got is not None:
            batched.append(group)
            assert set(got) == set(together), group
            for key, value in together.items():
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), (group, key)
    assert len(batched) >= 2  # the family's flag means something for these prompts
    for group in ([0, 1, 2], batched[0]):  # an admission that falls back to the processor, and one that batches
        want = DecodeEngine(model, processor, max_slots=3, max_length=2048).generate([requests[i] for i in group],
                                                                                     SamplingParams(max_tokens=6))
        engine = DecodeEngine(model, processor, max_slots=3, max_length=2048)
        handles = [engine.submit(requests[i], SamplingParams(max_tokens=6), prepared=alone[i]) for i in group]
        while engine.busy:
            engine.step()
        assert [h.completions[0].token_ids for h in handles] == [r.completions[0].token_ids for r in want]
        assert engine.collated == (group in batched) and engine.prefills == 1


def test_collate_refuses_what_concatenation_cannot_batch():
    from vlmctl.inference.inputs import collate_inputs

    ids = lambda n: {"input_ids": torch.arange(1, n + 1)[None], "attention_mask": torch.ones(1, n, dtype=torch.long)}  # noqa: E731
    got = collate_inputs([ids(3), ids(5)], pad_token_id=0)
    assert got["input_ids"].tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]
    assert got["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert collate_inputs([ids(3), {**ids(2), "pixel_values": torch.zeros(1, 3)}], 0) is None  # a key one prompt lacks
    stacks = [{**ids(2), "pixel_values": torch.zeros(1, n, 3)} for n in (1, 2)]
    assert collate_inputs(stacks, 0) is None  # the processor would pad the picture counts
    assert collate_inputs([{**ids(2), "sizes": [1]}], 0) is None  # not a tensor
