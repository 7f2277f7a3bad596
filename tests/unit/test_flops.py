"""The cost model (vlmctl.train.flops) against torch's FLOP counter on real forward + backward passes.

`FlopCounterMode` counts every matmul of the eager attention in full, while the cost model charges the causal
language-model attention at half the s^2 scores. Every comparison below is therefore made against the formula with
the causal half put back: measured == batch_flops + llm_attention term (i.e. the formula with causal=False).
"""

from __future__ import annotations

import dataclasses
import io

import pytest

from vlmctl.train.flops import TERMS, CostModel, mfu

ALL = {"vision", "projector", "llm"}
TEXTS = ["What is in these two pictures? A red square and a blue circle on a white table, next to a yellow vehicle."] * 20
ANSWER = " ".join(["The first picture shows a red square next to a blue circle, the second a yellow vehicle."] * 6)


def _png(width: int, height: int, color) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def _sample(i: int, sizes: list[tuple[int, int]], answer: str = ANSWER):
    from vlmctl.data.sample import Sample

    user = [{"type": "image", "index": k} for k in range(len(sizes))] + [{"type": "text", "text": TEXTS[0]}]
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    return Sample(id=f"s{i}", messages=messages, images=[_png(w, h, (40 * k, 90, 200)) for k, (w, h) in enumerate(sizes)])


# Two images of different sizes; (168, 280) px -> a 20 x 12 patch grid whose 112 px windows are partly cut off.
SIZES = [(168, 280), (224, 112)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(model, processor, family): the tiny Qwen2.5-VL preset's processor and a wider random model with its token
    ids (hidden 256, 3 layers, vocabulary 4096, so that attention and the head are not negligible), eager
    attention, fp32; two of its four vision blocks attend over the whole image."""
    import torch
    import transformers

    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_processor
    from vlmctl.families import detect_family, get_family

    out = tmp_path_factory.mktemp("flops") / "model"
    build_model(ModelSection(preset="tiny-qwen2.5-vl", init="random", output_dir=out), tokenizer_texts=TEXTS + [ANSWER] * 5)
    processor = load_processor(out)
    config = transformers.AutoConfig.from_pretrained(out).to_dict()
    config["text_config"].update(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
                                 layer_types=None)
    config["vision_config"].update(hidden_size=128, intermediate_size=256, depth=4, num_heads=2, out_hidden_size=256,
                                   fullatt_block_indexes=[1, 3])
    cfg = type(transformers.AutoConfig.from_pretrained(out)).from_dict(config)
    torch.manual_seed(0)
    model = getattr(transformers, get_family(detect_family(cfg)).model_class)(cfg)
    model.set_attn_implementation("eager")
    return model, processor, get_family(detect_family(cfg))


def _set_trainable(model, family, trainable: set[str]) -> None:
    from vlmctl.families import part_of_parameter

    for name, p in model.named_parameters():
        p.requires_grad_(part_of_parameter(name, family) in trainable)


def _measure(model, batch, trainable: bool):
    """FLOPs counted by torch over the trainer's loss (`objectives.loss_sum`: logits only where a label is) and, when
    something is trained, its backward pass; also the attention matmuls alone (aten.bmm: linear layers use mm)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from vlmctl.train.objectives import loss_sum

    with FlopCounterMode(display=False) as counter:
        loss = loss_sum(model, batch)
        if trainable:
            loss.backward()
    model.zero_grad(set_to_none=True)
    bmm = counter.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0)
    return counter.get_total_flops(), bmm


def _packed(processor, family, model, samples):
    """The trainer's packed row of `samples`, with the position ids its batch hook sets (Qwen's mRoPE)."""
    from vlmctl.data.collate import PackedCollator

    row = PackedCollator(processor, family, tokens_per_batch=100_000)(samples)
    hook = family.position_hook(model, model.config.image_token_id)
    return hook(row) if hook is not None else row


@pytest.mark.parametrize("trainable", [ALL, {"projector", "llm"}, {"projector"}], ids=["full", "finetune", "align"])
def test_batch_flops_match_the_flop_counter(qwen, trainable):
    # one sample with two images of different sizes + text, collated into a packed row as the trainer does; the
    # row holds one sample, so the eager kernel's T x T scores are the sample's own (no cross-sample waste)
    model, processor, family = qwen
    batch = _packed(processor, family, model, [_sample(0, SIZES)])
    assert batch["image_grid_thw"].tolist() == [[1, 20, 12], [1, 8, 16]]
    _set_trainable(model, family, trainable)
    measured, bmm = _measure(model, batch, trainable=True)
    cost = CostModel.from_model(model, family, trainable)
    terms = cost.batch_terms(batch)
    assert sum(terms.values()) == cost.batch_flops(batch)
    # the counter computes the full s^2 causal scores: add the masked half back (formula with causal=False)
    expected = cost.batch_flops(batch) + terms["llm_attention"]
    assert abs(expected - measured) / measured < 0.02, (expected, measured, terms)
    # attention alone: all of the counter's bmm FLOPs are attention's two matmuls
    assert abs(2 * terms["llm_attention"] + terms["vision_attention"] - bmm) / bmm < 0.02
    # the terms the check rests on are not negligible
    assert min(terms["lm_head"], terms["llm_attention"]) > 0.03 * measured and terms["vision_attention"] > 0.01 * measured


def test_vision_fixes_merger_per_merged_token_and_full_attention_blocks(qwen):
    # the vision tower + merger alone, forward: the merger runs once per merged token (spatial_merge_size^2
    # patches), and the fullatt_block_indexes blocks attend over the whole image, not over 64-patch windows
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model, processor, family = qwen
    batch = _packed(processor, family, model, [_sample(0, SIZES)])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
    measured = counter.get_total_flops()
    cost = CostModel.from_model(model, family, set())  # nothing trained: forward FLOPs
    terms = cost.batch_terms(batch)
    assert cost.vision.window * cost.vision.merge == 8 and cost.vision.full_layers == 2  # 64-patch windows
    new = terms["vision"] + terms["vision_attention"] + terms["projector"]
    assert abs(new - measured) / measured < 0.01, (new, measured)
    # the former errors, one at a time: each misses by more than the tolerance above
    patches = int(batch["image_grid_thw"].prod(-1).sum())
    per_patch_merger = terms["vision"] + terms["vision_attention"] + terms["projector"] * patches / batch["num_visual_tokens"]
    all_windowed = dataclasses.replace(cost, vision=dataclasses.replace(cost.vision, full_layers=0)).batch_terms(batch)
    windowed_full = all_windowed["vision"] + all_windowed["vision_attention"] + all_windowed["projector"]
    for old in (per_patch_merger, windowed_full):
        assert abs(old - measured) / measured > 0.03, (old, measured)


def test_packed_and_padded_batches_and_samples_cost_the_same(qwen):
    import torch

    from vlmctl.data.collate import Collator, PackedCollator

    model, processor, family = qwen
    samples = [_sample(0, SIZES), _sample(1, [(224, 224)], answer="A red square."), _sample(2, [(112, 168), (56, 56)])]
    cost = CostModel.from_model(model, family, ALL)
    packed = PackedCollator(processor, family, tokens_per_batch=100_000)(samples)
    padded = Collator(processor, family)(samples)
    assert padded["input_ids"].shape[0] == 3 and int((padded["attention_mask"] == 0).sum()) > 0  # real padding
    per_sample = []
    for s in samples:
        one = Collator(processor, family)([s])
        per_sample.append(cost.sample_flops(text_tokens=one["num_text_tokens"], labelled_tokens=one["num_label_tokens"],
                                            image_grids=one["image_grid_thw"].tolist()))
    assert cost.batch_flops(packed) == pytest.approx(cost.batch_flops(padded), rel=1e-12)
    assert cost.batch_flops(packed) == pytest.approx(sum(per_sample), rel=1e-12)
    # the packed row's attention is per sample, not over the whole row
    whole_row = cost.batch_terms({**packed, "seq_lens": None, "packed_cu_seqlens": None})
    assert whole_row["llm_attention"] > cost.batch_terms(packed)["llm_attention"]
    # packed_cu_seqlens alone give the same segments as seq_lens
    cu = {**packed, "seq_lens": None}
    assert cost.batch_flops(cu) == cost.batch_flops(packed)
    assert torch.equal(packed["packed_cu_seqlens"][1:] - packed["packed_cu_seqlens"][:-1], torch.tensor(packed["seq_lens"], dtype=torch.int32))


def test_frozen_parts_count_forward_only(qwen):
    import torch

    model, processor, family = qwen
    batch = _packed(processor, family, model, [_sample(0, SIZES)])
    forward = CostModel.from_model(model, family, set())
    _set_trainable(model, family, set())
    with torch.no_grad():
        measured, _ = _measure(model, batch, trainable=False)
    assert abs(forward.batch_flops(batch) + forward.batch_terms(batch)["llm_attention"] - measured) / measured < 0.02
    full = CostModel.from_model(model, family, ALL).batch_terms(batch)
    fwd = forward.batch_terms(batch)
    frozen_vision = CostModel.from_model(model, family, {"projector", "llm"}).batch_terms(batch)
    # a frozen vision tower in front of everything trained: forward only
    assert frozen_vision["vision"] == fwd["vision"] and frozen_vision["vision_attention"] == fwd["vision_attention"]
    assert full["vision_attention"] == pytest.approx(3 * fwd["vision_attention"])
    assert all(full[k] == pytest.approx(3 * fwd[k]) for k in ("llm", "lm_head", "llm_attention"))
    # LoRA: the language model's weights get no gradient, its activations do (4 FLOPs per parameter per token)
    lora = CostModel.from_model(model, family, ALL, lora=True).batch_terms(batch)
    assert lora["llm"] == pytest.approx(2 * fwd["llm"]) and lora["lm_head"] == pytest.approx(2 * fwd["lm_head"])
    assert lora["llm_attention"] == full["llm_attention"] and lora["vision"] == full["vision"]


def test_cost_model_on_the_meta_device_equals_the_real_model(qwen):
    import torch

    model, _, family = qwen
    with torch.device("meta"):
        meta = type(model)(model.config)
    assert CostModel.from_model(meta, family, ALL) == CostModel.from_model(model, family, ALL)


def test_sample_flops_from_counts():
    import transformers

    from vlmctl.families import detect_family, get_family

    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1),
        vision_config=dict(depth=4, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[3], window_size=112, patch_size=14, spatial_merge_size=2))
    import torch

    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    cost = CostModel.from_model(model, get_family(detect_family(cfg)), ALL)
    base = dict(text_tokens=100, labelled_tokens=40)
    # a grid tiled by whole windows: the count alone gives the same cost; cut windows cost less than full ones
    assert cost.sample_flops(**base, image_patches=[256]) == cost.sample_flops(**base, image_grids=[(1, 16, 16)])
    assert cost.sample_flops(**base, image_patches=[240]) > cost.sample_flops(**base, image_grids=[(1, 20, 12)])
    terms = cost.sample_terms(**base, image_grids=[(1, 16, 16)])
    assert set(terms) == set(TERMS) and min(v for k, v in terms.items() if not k.startswith("audio")) > 0
    assert terms["audio"] == terms["audio_attention"] == 0  # no audio tower (tests/unit/test_flops_audio.py)
    assert cost.sample_terms(**base)["vision"] == 0  # no image, no vision tower
    # visual tokens: 256 patches / 2^2 merged, in the sequence and through the projector
    assert terms["llm"] == cost.sample_terms(text_tokens=164, labelled_tokens=40)["llm"]
    # sliding-window layers: equal to full attention up to the window, cheaper past it
    slid = dataclasses.replace(cost, llm_full_layers=0, llm_sliding_layers=2, sliding_window=128)
    assert slid.sample_terms(**base)["llm_attention"] == cost.sample_terms(**base)["llm_attention"]
    long = dict(text_tokens=1000, labelled_tokens=0)
    assert slid.sample_terms(**long)["llm_attention"] < cost.sample_terms(**long)["llm_attention"]


@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "idefics3"])
def test_sample_costs_are_sample_flops_for_many_samples_at_once(name):
    # the balancer's per-sample costs are the same formulas as sample_flops, vectorized: CLS positions (LLaVA),
    # windowless towers, pixel shuffle; the sliding-window variant checks the causal pairs' vectorized branch
    import numpy as np

    model, family, _ = _family_model(name)
    cost = CostModel.from_model(model, family, {"projector", "llm"})
    rng = np.random.default_rng(0)
    n = 50
    images = rng.integers(0, 4, n)
    per_image = rng.integers(1, 40, n)  # visual tokens per image
    visual = images * (per_image + cost.vision.keep_cls)
    text = rng.integers(1, 3000, n)
    labelled = rng.integers(0, text + 1)
    for model_cost in (cost, dataclasses.replace(cost, llm_sliding_layers=1, llm_full_layers=1, sliding_window=700)):
        got = model_cost.sample_costs(text + visual, visual, labelled, images)
        expected = [model_cost.sample_flops(text_tokens=int(t), labelled_tokens=int(lab), visual_tokens=int(v),
                                            image_patches=[int(p) * cost.vision.patches_per_token] * int(k))
                    for t, lab, v, p, k in zip(text, labelled, visual, per_image, images)]
        assert got.shape == (n,) and got == pytest.approx(expected, rel=1e-12)
    assert len(set(got.tolist())) > n // 2  # the draws give samples of different costs


def _family_model(name: str):
    """A tiny random model of family `name` from a transformers config, eager attention, and one sample's inputs."""
    import torch
    import transformers

    from vlmctl.families import get_family

    text = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096)
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    qwen_ids = dict(image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003)
    if name == "qwen2_vl":
        cfg = transformers.Qwen2VLConfig(text_config=dict(text, rope_parameters=mrope), **qwen_ids, vision_config=dict(
            depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2))
    elif name == "qwen3_vl":
        cfg = transformers.Qwen3VLConfig(text_config=dict(text, head_dim=32, rope_parameters=dict(mrope, mrope_interleaved=True)),
                                         **qwen_ids, vision_config=dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=2,
                                         out_hidden_size=128, patch_size=16, spatial_merge_size=2,
                                         num_position_embeddings=64, deepstack_visual_indexes=[1]))
    elif name == "llava":
        cfg = transformers.LlavaConfig(
            vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=2, image_size=56, patch_size=14),
            text_config=dict(text, model_type="qwen2"), image_token_id=1000, image_seq_length=16, vision_feature_layer=-2,
            vision_feature_select_strategy="default")
    else:
        cfg = transformers.Idefics3Config(
            vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                               image_size=64, patch_size=16),
            text_config=dict(text, model_type="llama", head_dim=32), image_token_id=1000, scale_factor=2)
    torch.manual_seed(0)
    model = getattr(transformers, get_family(name).model_class)(cfg)
    model.set_attn_implementation("eager")
    text_ids = list(range(10, 250))
    if name.startswith("qwen"):
        patch = cfg.vision_config.patch_size
        grids = [(1, 12, 8), (1, 4, 6)]
        ids = [5] + [1002] + [1000] * 24 + [1003] + [1002] + [1000] * 6 + [1003] + text_ids
        ids = torch.tensor([ids])
        inputs = dict(input_ids=ids, mm_token_type_ids=(ids == 1000).long(), image_grid_thw=torch.tensor(grids),
                      pixel_values=torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * patch * patch))
    elif name == "llava":
        inputs = dict(input_ids=torch.tensor([[5] + [1000] * 16 + [6] + [1000] * 16 + text_ids]),
                      pixel_values=torch.randn(2, 3, 56, 56))
    else:  # two real tiles and one all-zero padding image, which the model skips
        pixels = torch.zeros(1, 3, 3, 64, 64)
        pixels[0, :2] = torch.randn(2, 3, 64, 64)
        inputs = dict(input_ids=torch.tensor([[5] + [1000] * 8 + text_ids]), pixel_values=pixels,
                      pixel_attention_mask=torch.ones(1, 3, 64, 64, dtype=torch.bool))
    labels = inputs["input_ids"].clone()
    labels[:, :-120] = -100
    return model, get_family(name), {**inputs, "attention_mask": torch.ones_like(inputs["input_ids"]), "labels": labels}


@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "qwen3_vl", "idefics3"])
def test_every_family_matches_the_flop_counter(name):
    # one unpadded row per family (LLaVA's unused last vision layer, Idefics3's pixel shuffle and padding images,
    # Qwen3-VL's deepstack mergers); the loss on labelled positions only, as the trainer computes it for packed rows
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    model, family, batch = _family_model(name)
    labels = batch["labels"]
    target = torch.nonzero(labels[0] != -100).squeeze(1)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    for trainable in (ALL, {"projector"}):
        _set_trainable(model, family, trainable)
        with FlopCounterMode(display=False) as counter:
            logits = model(**inputs, logits_to_keep=target - 1, use_cache=False).logits[0]
            F.cross_entropy(logits.float(), labels[0, target], reduction="sum").backward()
        model.zero_grad(set_to_none=True)
        cost = CostModel.from_model(model, family, trainable)
        terms = cost.batch_terms(batch)
        expected = sum(terms.values()) + terms["llm_attention"]  # causal=False, as counted
        measured = counter.get_total_flops()
        assert abs(expected - measured) / measured < 0.02, (name, sorted(trainable), expected, measured, terms)
        assert terms["projector"] > 0 and terms["vision"] > 0


def test_mfu():
    assert mfu(4e15, 2.0, 1e15, 4) == pytest.approx(0.5)
    assert mfu(4e15, 2.0, None, 4) is None
    assert mfu(4e15, 0.0, 1e15, 4) is None


def test_a_4bit_packed_weight_counts_its_full_matrix():
    """bitsandbytes stores a 4-bit weight packed as (n, 1); its `quant_state.shape` is the matrix the FLOPs see."""
    import types

    import torch

    from vlmctl.train.flops import _param_counts

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision = torch.nn.Linear(2, 2, bias=False)
            self.proj = torch.nn.Linear(2, 2, bias=False)
            self.language_model = torch.nn.Linear(8, 16, bias=False)

        def get_output_embeddings(self):
            return None

    from vlmctl.families.encoders import image_encoder

    family = types.SimpleNamespace(vision_tower="vision", projector=["proj"], language_model="language_model",
                                   lm_head="lm_head", name="x", encoders={"image": image_encoder("vision")})
    model = Tiny()
    full = _param_counts(model, family)["llm_params"]
    packed = torch.nn.Parameter(torch.zeros(64, 1), requires_grad=False)
    packed.quant_state = types.SimpleNamespace(shape=torch.Size([16, 8]))
    model.language_model.weight = packed
    assert full == 128 and _param_counts(model, family)["llm_params"] == 128


def _tiny_preset_pass(name: str):
    """(cost model, batch, FLOPs torch counts) of one bench sample (one 224 px image, 40-80 answer tokens) of family
    `name`'s tiny preset through forward + backward, eager attention (and eager experts), every part trained."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from vlmctl.bench import WorkloadSpec, prepare, random_model
    from vlmctl.config.model import ModelSection
    from vlmctl.config.train import TrainSection
    from vlmctl.data.collate import Collator
    from vlmctl.families import get_family

    spec = get_family(name)
    plan = prepare(ModelSection(preset=spec.tiny_preset, init="random"), TrainSection(packing=False, strategy="ddp"),
                   WorkloadSpec(image_sizes=(224,), text_tokens=(40, 80)), steps=1, warmup=0, dp_size=1)
    torch.manual_seed(0)
    model = random_model(plan.model.plan, plan.model.processor, device="cpu", dtype=torch.float32)
    model.set_attn_implementation("eager")
    if getattr(model.config.get_text_config(), "num_experts_per_tok", None):
        model.set_experts_implementation("eager")  # a matmul per expert, which the FLOP counter sees
    batch = plan.workload.batch([0], Collator(plan.model.processor, plan.model.family, dummy_image=False))
    labels = batch["labels"]
    target = torch.nonzero(labels[0] != -100).squeeze(1)
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels" and not k.startswith("num_")}
    with FlopCounterMode(display=False) as counter:
        logits = model(**inputs, logits_to_keep=target - 1, use_cache=False).logits[0]
        F.cross_entropy(logits.float(), labels[0, target], reduction="sum").backward()
    return CostModel.from_model(model, spec, ALL), batch, counter.get_total_flops(), model


@pytest.mark.parametrize("name", ["gemma3", "internvl", "llava_next", "llava_onevision", "mistral3"])
def test_more_families_match_the_flop_counter(name):
    # the tiny presets of the families added after the four above, through the bench's own sample and collator
    cost, batch, measured, _ = _tiny_preset_pass(name)
    terms = cost.batch_terms(batch)
    expected = sum(terms.values()) + terms["llm_attention"]  # causal=False, as counted
    assert abs(expected - measured) / measured < 0.02, (name, expected, measured, terms)
    assert terms["vision"] > 0 and terms["projector"] > 0


def test_mixture_of_experts_counts_the_experts_a_token_runs():
    # the tiny Qwen3-VL-MoE preset (4 experts, 2 per token) with transformers' eager experts: the cost model charges
    # 2 of the 4 experts per token, as the counter counts them
    cost, batch, measured, model = _tiny_preset_pass("qwen3_vl_moe")
    text = model.config.get_text_config()
    assert (text.num_experts, text.num_experts_per_tok) == (4, 2)
    terms = cost.batch_terms(batch)
    expected = sum(terms.values()) + terms["llm_attention"]  # causal=False, as counted
    assert abs(expected - measured) / measured < 0.02, (expected, measured, terms)
    # every expert charged (the dense count) misses by far more than the tolerance
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = dataclasses.replace(cost, llm_params=cost.llm_params + routed // 2).batch_terms(batch)
    assert (sum(dense.values()) + dense["llm_attention"] - measured) / measured > 0.05
