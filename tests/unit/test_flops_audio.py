"""The cost model's audio tower (vlmctl.train.flops: `audio`, `audio_attention`, the projector over pooled rows)
against torch's FLOP counter on the tiny Qwen2-Audio preset's forward + backward, as tests/unit/test_flops.py checks
the vision tower.

The language-model head runs on the labelled positions only (the cost model's convention; Qwen2-Audio's own forward
takes no `logits_to_keep`), and the counter counts the causal attention's full s^2 scores: measured == batch_flops
+ llm_attention term, as in tests/unit/test_flops.py.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from audio_data import wav  # noqa: E402

from vlmctl.config.model import ModelSection  # noqa: E402
from vlmctl.data.modalities.audio import normalize_audio  # noqa: E402
from vlmctl.data.sample import Sample  # noqa: E402
from vlmctl.families import get_family, part_of_parameter  # noqa: E402
from vlmctl.train.flops import CostModel, batch_audio_frames  # noqa: E402

ALL = {"vision", "projector", "llm"}
SPEC = get_family("qwen2_audio")
TEXTS = ["What are these two tones? The first is low, the second is high and short.", "Transcribe the clip."] * 10


@pytest.fixture(scope="module")
def tiny():
    """(model, processor) of the tiny preset (2 s windows: 200 mel frames of 32 bins, 2 encoder layers), fp32,
    eager attention."""
    from vlmctl.models.build import make_model, make_processor, plan_build

    plan = plan_build(ModelSection(preset=SPEC.tiny_preset, init="random", dtype="fp32"))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    model = make_model(plan, processor)
    model.set_attn_implementation("eager")
    return model, processor


def _sample(sid: str, seconds: list[float], answer: str = "The first is low, the second is high and short.") -> Sample:
    clips = [normalize_audio(wav(s, 16_000, freq=220 * (k + 1))).data for k, s in enumerate(seconds)]
    user = [{"type": "audio", "index": k} for k in range(len(clips))] + [{"type": "text", "text": TEXTS[0]}]
    return Sample(sid, [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                  audios=clips)


def _batch(processor, samples, dummy: bool = True):
    from vlmctl.data.collate import Collator

    return Collator(processor, SPEC, dummy_image=dummy)(samples)


def _set_trainable(model, trainable: set[str]) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(part_of_parameter(name, SPEC) in trainable)


def _measure(model, batch, backward: bool):
    """FLOPs torch counts over the summed loss of the labelled positions (the head on those positions only, as the
    trainer's `logits_to_keep`) and its backward pass; also the attention matmuls alone (aten.bmm)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from vlmctl.data.collate import model_inputs

    labels = batch["labels"]
    assert labels.shape[0] == 1  # one row: no padding for the counter to count
    target = torch.nonzero(labels[0] != -100).squeeze(1)
    target = target[target > 0]
    with FlopCounterMode(display=False) as counter:
        hidden = model.model(**model_inputs(batch), use_cache=False).last_hidden_state
        loss = F.cross_entropy(model.lm_head(hidden[0, target - 1]).float(), labels[0, target], reduction="sum")
        if backward:
            loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops(), counter.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0)


@pytest.mark.parametrize("trainable", [ALL, {"projector", "llm"}, {"projector"}, set()], ids=["full", "finetune", "align", "frozen"])
def test_audio_batch_flops_match_the_flop_counter(tiny, trainable):
    # one sample with two clips of different lengths, collated as the trainer does (one padded row, no padding)
    import torch

    model, processor = tiny
    batch = _batch(processor, [_sample("a", [1.0, 0.6])])
    assert tuple(batch["input_features"].shape) == (2, 32, 200) and batch["feature_attention_mask"].sum(-1).tolist() == [100, 60]
    assert batch_audio_frames(batch) == [200, 200]  # every clip is padded to the 2 s window the encoder runs on
    _set_trainable(model, trainable)
    with torch.set_grad_enabled(bool(trainable)):
        measured, bmm = _measure(model, batch, backward=bool(trainable))
    cost = CostModel.from_model(model, SPEC, trainable)
    terms = cost.batch_terms(batch)
    assert cost.vision is None and cost.audio.window == 200 and cost.audio.pool == (2, 2) and len(cost.audio.stem) == 2
    assert terms["vision"] == terms["vision_attention"] == 0
    expected = sum(terms.values()) + terms["llm_attention"]  # the counter computes the full causal s^2 scores
    assert expected == pytest.approx(measured, rel=1e-3), (expected, measured, terms)
    # attention alone: the counter's bmm FLOPs are the encoder's (over 100 positions a clip) and the LLM's matmuls
    assert terms["audio_attention"] + 2 * terms["llm_attention"] == pytest.approx(bmm, rel=1e-3)
    # the audio tower is no rounding error: without it (the former count) the figure misses by far
    assert terms["audio"] + terms["audio_attention"] > 0.2 * measured and terms["projector"] > 0


def test_frozen_trained_and_lora_audio_towers(tiny):
    # the tower is the family's `vision` part: forward only when frozen with nothing before it, 3x when trained
    # (its first convolution, reading mel features, needs no input gradient: 4 FLOPs per parameter per position)
    model, processor = tiny
    batch = _batch(processor, [_sample("a", [1.0])])
    fwd = CostModel.from_model(model, SPEC, set())
    full = CostModel.from_model(model, SPEC, ALL)
    frozen = CostModel.from_model(model, SPEC, {"projector", "llm"}).batch_terms(batch)
    f, t = fwd.batch_terms(batch), full.batch_terms(batch)
    assert frozen["audio"] == f["audio"] and frozen["audio_attention"] == f["audio_attention"]
    assert t["audio_attention"] == pytest.approx(3 * f["audio_attention"])
    first, second = fwd.audio.stem
    clip = fwd.audio.counts(200)
    assert clip == {"stem": [200, 100], "positions": 100, "pairs": 10_000, "rows": 50}
    assert t["audio"] - 3 * f["audio"] == pytest.approx(-2 * first[0] * 200)  # 4, not 6, per conv1 parameter
    assert full.audio_params + first[0] + second[0] == sum(
        p.numel() for n, p in model.named_parameters() if n.startswith(SPEC.vision_tower + ".") and p.ndim >= 2
        and "embed_positions" not in n)
    lora = CostModel.from_model(model, SPEC, ALL, lora=True).batch_terms(batch)
    assert lora["audio"] == t["audio"] and lora["llm"] == pytest.approx(2 * f["llm"])


def test_padded_batches_dummy_clips_and_samples_cost_the_same(tiny):
    model, processor = tiny
    cost = CostModel.from_model(model, SPEC, {"projector", "llm"})
    samples = [_sample("a", [1.0, 0.6]), _sample("b", [1.7], answer="Low."), _sample("c", [0.3])]
    batch = _batch(processor, samples)
    assert int((batch["attention_mask"] == 0).sum()) > 0 and batch["num_dummy_audios"] == 0  # real row padding
    per_sample = []
    for s in samples:
        one = _batch(processor, [s])
        clips = batch_audio_frames(one)
        assert cost.batch_flops(one) == pytest.approx(cost.sample_flops(
            text_tokens=one["num_text_tokens"], labelled_tokens=one["num_label_tokens"], audio_frames=clips,
            visual_tokens=one["num_visual_tokens"]), rel=1e-12)
        per_sample.append(cost.batch_flops(one))
    # the rows' padding costs nothing; the clips' padding to the window does (every clip costs one window)
    assert cost.batch_flops(batch) == pytest.approx(sum(per_sample), rel=1e-12)
    window = cost.batch_terms(_batch(processor, [samples[2]]))
    assert window["audio"] == pytest.approx(cost.batch_terms(_batch(processor, [samples[1]]))["audio"])
    # a micro-batch without audio gets the collator's dummy clip, which runs the tower once
    text_only = Sample("t", [{"role": "user", "content": [{"type": "text", "text": "Hi?"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}])
    dummy = _batch(processor, [text_only])
    assert dummy["num_dummy_audios"] == 1 and cost.batch_terms(dummy)["audio"] == pytest.approx(window["audio"])
    assert cost.batch_terms(_batch(processor, [text_only], dummy=False))["audio"] == 0


def test_audio_sample_costs_are_sample_flops_for_many_samples(tiny):
    import numpy as np

    model, _ = tiny
    cost = CostModel.from_model(model, SPEC, ALL)
    rng = np.random.default_rng(0)
    n = 40
    clips = rng.integers(0, 3, n)
    audio_tokens = clips * rng.integers(1, 50, n)
    text = rng.integers(1, 400, n)
    labelled = rng.integers(0, text + 1)
    got = cost.sample_costs(text + audio_tokens, audio_tokens, labelled, clips)
    expected = [cost.sample_flops(text_tokens=int(t), labelled_tokens=int(lab), visual_tokens=int(a), audio_frames=[200] * int(k))
                for t, lab, a, k in zip(text, labelled, audio_tokens, clips)]
    assert got.shape == (n,) and got == pytest.approx(expected, rel=1e-12)
    # a clip's default tokens: its pooled rows (a clip as long as the window), in the sequence
    base = cost.sample_terms(text_tokens=30, labelled_tokens=5, audio_frames=[200])
    assert base["llm"] == cost.sample_terms(text_tokens=80, labelled_tokens=5)["llm"]
    # a model without an audio tower ignores clips
    plain = dataclasses.replace(cost, audio=None)
    assert plain.sample_terms(text_tokens=30, labelled_tokens=5, audio_frames=[200])["audio"] == 0


def test_audio_cost_model_on_the_meta_device_equals_the_real_model(tiny):
    import torch

    model, _ = tiny
    with torch.device("meta"):
        meta = type(model)(model.config)
    assert CostModel.from_model(meta, SPEC, ALL) == CostModel.from_model(model, SPEC, ALL)
