"""Packing: bin planning, and numerical equivalence of packed vs one-by-one training (llava and qwen2_5_vl)."""

from __future__ import annotations

import random

import pytest
import torch

from vlmctl.data.packing import first_fit_decreasing, pack_samples
from vlmctl.families.qwen_vl import packed_mrope_positions
from vlmctl.train.kernels import per_sample_sums, token_losses


@pytest.mark.parametrize("lookahead", [1, 7, 64, 10_000])
def test_ffd_bins_cover_every_item_once_within_budget(lookahead):
    rng = random.Random(lookahead)
    items = [(i, rng.randint(1, 700)) for i in range(500)] + [(500, 2000)]  # one oversize item
    lengths = dict(items)
    bins = list(first_fit_decreasing(items, budget=1024, lookahead=lookahead))
    keys = [k for b in bins for k in b]
    assert sorted(keys) == list(range(501))
    for b in bins:
        total = sum(lengths[k] for k in b)
        assert total <= 1024 or (len(b) == 1 and lengths[b[0]] > 1024)
    assert bins == list(first_fit_decreasing(items, budget=1024, lookahead=lookahead))  # deterministic


def test_ffd_with_lookahead_packs_nearly_as_tight_as_the_bound():
    rng = random.Random(0)
    items = [(i, rng.randint(50, 600)) for i in range(2000)]
    lower_bound = -(-sum(n for _, n in items) // 2048)
    streamed = list(first_fit_decreasing(items, budget=2048, lookahead=256))
    assert len(streamed) <= 1.05 * lower_bound + 2


def test_ffd_rejects_bad_budget():
    with pytest.raises(ValueError):
        list(first_fit_decreasing([(0, 1)], budget=0))


def _sample(rng, vocab, n_text, image_tokens, image_token_id):
    ids = [image_token_id] * image_tokens + [rng.randrange(5, vocab) for _ in range(n_text)]
    labels = [-100] * (image_tokens + n_text // 2) + ids[image_tokens + n_text // 2:]
    return torch.tensor(ids), torch.tensor(labels)


def _one_by_one(model, samples):
    sums, grads = [], None
    for s in samples:
        batch = {k: v for k, v in s.items() if k not in ("mm_token_type_ids",)}
        batch = {"input_ids": s["input_ids"][None], "labels": s["labels"][None], **{k: v for k, v in batch.items() if k in ("pixel_values", "image_grid_thw")}}
        if "mm_token_type_ids" in s:
            batch["mm_token_type_ids"] = s["mm_token_type_ids"][None]
        losses, _ = token_losses(model, batch)
        sums.append(losses.sum())
    total = torch.stack(sums).sum()
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return torch.stack(sums).detach(), grads


def _check_equivalence(model, samples, extra=None):
    ref_sums, ref_grads = _one_by_one(model, samples)
    packed = pack_samples(samples)
    seq_lens = packed.pop("seq_lens")
    if extra is not None:
        extra(packed, seq_lens)
    losses, index = token_losses(model, packed)
    sums, counts = per_sample_sums(losses, index, seq_lens)
    sums.sum().backward()
    torch.testing.assert_close(sums.detach(), ref_sums, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [int((s["labels"][1:] != -100).sum()) for s in samples]
    for name, p in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_llava_matches_one_by_one(attn):
    from transformers import LlavaConfig, LlavaForConditionalGeneration, Qwen2Config, SiglipVisionConfig

    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    text = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=3, vision_feature_select_strategy="full", vision_feature_layer=-1)
    model = LlavaForConditionalGeneration(cfg).float()
    model.set_attn_implementation(attn)
    rng = random.Random(0)
    samples = []
    for n_text, with_image in [(20, True), (7, False), (33, True), (12, True)]:
        ids, labels = _sample(rng, 128, n_text, 16 if with_image else 0, 3)
        s = {"input_ids": ids, "labels": labels}
        if with_image:
            s["pixel_values"] = torch.randn(1, 3, 32, 32)
        samples.append(s)
    _check_equivalence(model, samples)


def test_packed_qwen2_5_vl_matches_one_by_one_with_mrope():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=160, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1], in_chans=3)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=151, video_token_id=152,
                           vision_start_token_id=150, vision_end_token_id=153)
    model = Qwen2_5_VLForConditionalGeneration(cfg).float()
    model.set_attn_implementation("sdpa")
    rng = random.Random(1)
    samples = []
    for n_text, grid in [(15, (1, 4, 4)), (9, None), (21, (1, 4, 8)), (6, (1, 8, 4))]:
        n_img = grid[1] * grid[2] // 4 if grid else 0
        body = [rng.randrange(5, 140) for _ in range(n_text)]
        ids = ([150] + [151] * n_img + [153] if grid else []) + body
        labels = [-100] * (len(ids) - n_text // 2) + ids[len(ids) - n_text // 2:]
        s = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
             "mm_token_type_ids": torch.tensor([1 if t == 151 else 0 for t in ids])}
        if grid:
            s["pixel_values"] = torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * 4 * 4)
            s["image_grid_thw"] = torch.tensor([grid])
        samples.append(s)

    def add_mrope(packed, seq_lens):
        packed["position_ids"] = packed_mrope_positions(
            model.model.get_rope_index, packed["input_ids"], packed["mm_token_type_ids"], seq_lens, image_grid_thw=packed["image_grid_thw"])
        assert packed["position_ids"].shape == (4, 1, sum(seq_lens))
        # visual positions restart per sample: the third sample's 3-D positions equal its unpacked ones
        start = seq_lens[0] + seq_lens[1]
        alone, _ = model.model.get_rope_index(input_ids=samples[2]["input_ids"][None], mm_token_type_ids=samples[2]["mm_token_type_ids"][None],
                                              image_grid_thw=samples[2]["image_grid_thw"])
        assert torch.equal(packed["position_ids"][1:, :, start:start + seq_lens[2]], alone)

    _check_equivalence(model, samples, extra=add_mrope)


def test_token_losses_need_no_full_logits():
    """The model is asked for logits at the labelled positions only."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000))
    seen = {}
    model.lm_head.register_forward_hook(lambda m, i, o: seen.update(shape=tuple(i[0].shape)))
    ids = torch.randint(0, 1000, (1, 50))
    labels = torch.full_like(ids, -100)
    labels[0, 40:45] = ids[0, 40:45]
    losses, index = token_losses(model, {"input_ids": ids, "labels": labels})
    assert seen["shape"] == (1, 5, 32)  # the head sees the 5 labelled positions' hidden states only
    assert index.tolist() == [40, 41, 42, 43, 44]
    full = model(input_ids=ids).logits[0]
    ref = torch.nn.functional.cross_entropy(full[39:44], ids[0, 40:45], reduction="none")
    torch.testing.assert_close(losses, ref)
