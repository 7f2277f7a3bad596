"""Compute-balanced batching (`vlmctl.data.packing.balance_bins`, the samplers' `costs=`): against brute force on
small cases, and on a skewed synthetic set (images 224-896 px, 64-3072 text tokens) costed by a Qwen2.5-VL-7B-shaped
cost model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vlmctl.data.packing import balance_bins, first_fit_decreasing
from vlmctl.data.samplers import DistributedBatchSampler, PackedBatchSampler


@pytest.fixture(scope="module")
def cost_model():
    """The cost model of Qwen2.5-VL-7B's shape (built on the meta device), vision tower frozen."""
    import torch
    import transformers

    from vlmctl.families import detect_family, get_family
    from vlmctl.train.flops import CostModel

    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14, spatial_merge_size=2))
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    return CostModel.from_model(model, get_family(detect_family(cfg)), {"projector", "llm"})


def skewed(cost_model, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, FLOPs) of n samples: one square image of 224-896 px (64-1024 visual tokens) and 64-3072 text
    tokens, all labelled, or (every fourth) text only."""
    rng = np.random.default_rng(seed)
    side = rng.integers(224, 897, n) // 28
    images = (np.arange(n) % 4 != 3).astype(np.int64)
    visual = side * side * images
    text = rng.integers(64, 3073, n)
    return visual + text, cost_model.sample_costs(visual + text, visual, text, images)


def optimum(costs: np.ndarray, tokens: np.ndarray, bins: int, budget: int | None, size: int | None) -> float:
    """The smallest largest-group cost over every grouping (item 0 in group 0: groups are interchangeable)."""
    n = len(costs)
    assign = np.array(list(itertools.product(range(bins), repeat=n - 1)), dtype=np.int64).reshape(-1, n - 1)
    assign = np.concatenate([np.zeros((len(assign), 1), dtype=np.int64), assign], axis=1)
    member = assign[:, :, None] == np.arange(bins)[None, None, :]  # [groupings, items, groups]
    ok = np.ones(len(assign), dtype=bool)
    if budget is not None:
        ok &= ((member * tokens[None, :, None]).sum(1) <= budget).all(1)
    if size is not None:
        ok &= (member.sum(1) == size).all(1)
    return float((member * costs[None, :, None]).sum(1).max(1)[ok].min())


def max_over_mean(costs: np.ndarray, groups) -> float:
    loads = [costs[list(g)].sum() for g in groups]
    return max(loads) / np.mean(loads)


def check_grouping(groups, n: int, bins: int, tokens, budget=None, size=None) -> None:
    assert len(groups) == bins and sorted(i for g in groups for i in g) == list(range(n))
    assert all(budget is None or tokens[g].sum() <= budget for g in groups)
    assert all(size is None or len(g) == size for g in groups)


@pytest.mark.parametrize("constraint", ["budget", "size"])
def test_within_five_percent_of_the_brute_force_optimum_on_small_cases(cost_model, constraint):
    ratios, unbalanced = [], []
    for case in range(60):
        rng = np.random.default_rng(1000 + case)
        bins = int(rng.integers(2, 4))
        if constraint == "budget":
            n, size = int(rng.integers(6, 11)), None
        else:
            size = int(rng.integers(2, 4))
            n = bins * size
        tokens, flops = skewed(cost_model, n, seed=case)
        costs = np.rint(flops / 1e9).astype(np.int64)  # GFLOP, exact integers
        budget = int(np.ceil(tokens.sum() / bins * 1.15)) if constraint == "budget" else None
        # the sampler's own split to start from: first-fit decreasing by tokens, or consecutive runs of `size`
        start = (list(first_fit_decreasing(enumerate(tokens.tolist()), budget)) if budget else
                 [list(range(g * size, (g + 1) * size)) for g in range(bins)])
        if len(start) != bins:
            continue  # first-fit decreasing needs another group: not a step the sampler makes
        groups = balance_bins(tokens, costs, bins, budget=budget, size=size, start=start)
        check_grouping(groups, n, bins, tokens, budget, size)
        assert groups == balance_bins(tokens, costs, bins, budget=budget, size=size, start=start)  # deterministic
        best = optimum(costs, tokens, bins, budget, size)
        ratios.append(max(costs[g].sum() for g in groups) / best)
        unbalanced.append(max(costs[g].sum() for g in start) / best)
    assert len(ratios) >= 40
    assert max(ratios) <= 1.05 and np.mean(ratios) <= 1.01, (max(ratios), np.mean(ratios))
    assert np.mean(unbalanced) > np.mean(ratios)  # the starting split was not already optimal


def test_a_tight_budget_falls_back_on_the_starting_grouping():
    # LPT leaves no room for item 0, differencing pairs items 0 and 1 (11 tokens): only the start fits 10 tokens
    tokens, costs = np.array([6, 5, 5, 4]), np.array([1, 9, 9, 1])
    groups = balance_bins(tokens, costs, 2, budget=10, start=[[0, 3], [1, 2]])
    assert groups == [[1, 2], [0, 3]]
    with pytest.raises(ValueError, match="do not fit"):
        balance_bins(tokens, costs, 2, budget=10)


def _step_samples(sampler_kind, costs, steps: int, rank_count: int, step_batches: int, lengths, weights=None):
    """Per optimizer step, every rank's micro-batches (sample indices), read from one sampler per rank."""
    ranks = [make_sampler(sampler_kind, lengths, r, rank_count, costs, step_batches, weights) for r in range(rank_count)]
    streams = [iter(s) for s in ranks]
    out = []
    for _ in range(steps):
        parts = [next(stream) for _ in range(step_batches) for stream in streams]
        out.append(parts)
    return out


def make_sampler(kind, lengths, rank, world_size, costs, step_batches, weights=None):
    if kind == "packed":
        return PackedBatchSampler(lengths, tokens_per_batch=8192, world_size=world_size, rank=rank, seed=3,
                                  weights=weights, costs=costs, step_batches=step_batches)
    return DistributedBatchSampler(lengths, micro_batch_size=4, world_size=world_size, rank=rank, seed=3,
                                   group_by_length=False, weights=weights, costs=costs, step_batches=step_batches)


@pytest.mark.parametrize("kind", ["packed", "padded"])
@pytest.mark.parametrize("world_size,step_batches", [(2, 1), (4, 1), (2, 3)])
def test_the_sampler_splits_each_step_by_cost_with_the_same_samples(cost_model, kind, world_size, step_batches):
    lengths, flops = skewed(cost_model, 600, seed=7)
    weights = np.where(np.arange(600) % 5 == 0, 2.0, 1.0)
    steps = 3 * make_sampler(kind, lengths, 0, world_size, None, step_batches, weights).batches_per_epoch // step_batches
    plain = _step_samples(kind, None, steps, world_size, step_batches, lengths, weights)
    balanced = _step_samples(kind, flops, steps, world_size, step_batches, lengths, weights)
    before, after = [], []
    for p, b in zip(plain, balanced):
        # the same samples (weighted ones drawn twice) in every step: the global batch and its loss are unchanged
        assert sorted(i for part in p for i in part) == sorted(i for part in b for i in part)
        for part in b:
            assert lengths[part].sum() <= 8192 if kind == "packed" else len(part) == 4
        before.append(max_over_mean(flops, p))
        after.append(max_over_mean(flops, b))
        assert after[-1] <= before[-1] * (1 + 1e-9)
    assert np.mean(after) < np.mean(before)
    if kind == "padded":  # without length grouping a padded step is far from balanced; by cost it nearly is
        assert np.mean(after) < 1.02 < 1.05 < np.mean(before)


def test_count_estimates_recover_visual_and_labelled_tokens_from_the_shards(tmp_path):
    # shards that record only num_tokens: 3 tokens per 10 characters + 12 template tokens per sample, and
    # 50-400 visual tokens per image; the fit recovers the split up to rounding
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.loader import ShardDataset
    from vlmctl.data.sample import Sample, arrow_schema

    rng = np.random.default_rng(0)
    rows, visual, labelled = [], [], []
    for i in range(200):
        question, answer = "q" * int(rng.integers(10, 400)), "a" * int(rng.integers(10, 1000))
        images = int(rng.integers(0, 3))
        per_image = rng.integers(50, 400, images)
        user = [{"type": "image", "index": k} for k in range(images)] + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        text = 0.3 * (len(question) + len(answer)) + 12
        rows.append(Sample(id=str(i), messages=messages, images=[b"x"] * images,
                           num_tokens=int(round(text + per_image.sum()))).to_row())
        visual.append(per_image.sum())
        labelled.append(text * len(answer) / (len(question) + len(answer)))
    (tmp_path / "train").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema()), tmp_path / "train" / "shard-00000.parquet")
    dataset = ShardDataset.from_dir(tmp_path / "train")
    counts = dataset.count_estimates(dataset.lengths)
    assert counts["images"].tolist() == [len(r["images"]) for r in rows]
    assert np.abs(counts["visual_tokens"] - np.asarray(visual)).max() <= 2
    assert np.abs(counts["labelled_tokens"] - np.asarray(labelled)).max() <= 2
    assert (counts["visual_tokens"][counts["images"] == 0] == 0).all()


def test_count_estimates_count_video_and_audio_clips_as_encoded_media(tmp_path):
    # videos and audio clips are encoded by a tower like images: their tokens are not text, and a sample holding
    # one counts one media item (before, a video's 300-900 tokens were taken as text and skewed the fit)
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.loader import ShardDataset
    from vlmctl.data.sample import Sample, arrow_schema

    rng = np.random.default_rng(1)
    rows, visual = [], []
    for i in range(120):
        question, answer = "q" * int(rng.integers(10, 400)), "a" * int(rng.integers(10, 400))
        kind = ["text", "image", "video", "audio"][i % 4]
        media = int(rng.integers(300, 900)) if kind != "text" else 0
        user = ([{"type": kind, "index": 0}] if kind != "text" else []) + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        stored = {"images": [b"x"]} if kind == "image" else {"videos": [b"x"]} if kind == "video" else \
            {"audios": [b"x"]} if kind == "audio" else {}
        rows.append(Sample(id=str(i), messages=messages, num_tokens=int(round(0.3 * (len(question) + len(answer)) + 12 + media)),
                           **stored).to_row())
        visual.append(media)
    (tmp_path / "train").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema()), tmp_path / "train" / "shard-00000.parquet")
    dataset = ShardDataset.from_dir(tmp_path / "train")
    counts = dataset.count_estimates(dataset.lengths)
    assert counts["images"].tolist() == [0 if i % 4 == 0 else 1 for i in range(120)]
    assert np.abs(counts["visual_tokens"] - np.asarray(visual)).max() <= 2


def test_count_estimates_split_the_media_tokens_by_modality_for_encoders_that_count_themselves(tmp_path):
    # an image + audio family whose encoders count themselves (Phi-4-multimodal): each encoder is charged the tokens
    # and items of its own modality, exactly where prepare recorded them (`media_tokens`), else split evenly
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.config.model import ModelSection
    from vlmctl.data.loader import ShardDataset
    from vlmctl.data.sample import Sample, arrow_schema
    from vlmctl.families import get_family
    from vlmctl.models.build import instantiate, plan_build
    from vlmctl.train.data import sample_costs
    from vlmctl.train.flops import CostModel

    kinds = [("text", 0, 0), ("image", 721, 0), ("audio", 0, 25), ("both", 721, 13), ("both", 289, 25)]
    rows = []
    for i, (kind, image, audio) in enumerate(kinds * 4):
        user = ([{"type": "image", "index": 0}] if image else []) + ([{"type": "audio", "index": 0}] if audio else [])
        messages = [{"role": "user", "content": user + [{"type": "text", "text": "q" * 40}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "a" * 40}]}]
        sample = Sample(id=str(i), messages=messages, images=[b"x"] * bool(image), audios=[b"y"] * bool(audio),
                        num_tokens=30 + image + audio)
        if i < len(kinds) * 3:  # the last ones were prepared without a processor
            sample.media_tokens = {"image": [image] if image else [], **({"audio": [audio]} if audio else {})}
        rows.append(sample.to_row())
    (tmp_path / "train").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema(("image", "audio"))), tmp_path / "train" / "shard-00000.parquet")
    dataset = ShardDataset.from_dir(tmp_path / "train")
    media = dataset.count_estimates(dataset.lengths)["media"]
    recorded = slice(0, len(kinds) * 3)
    assert media["image"]["tokens"][recorded].tolist() == [k[1] for k in kinds] * 3
    assert media["audio"]["tokens"][recorded].tolist() == [k[2] for k in kinds] * 3
    assert media["image"]["items"].tolist() == [int(k[1] > 0) for k in kinds] * 4
    assert media["audio"]["items"].tolist() == [int(k[2] > 0) for k in kinds] * 4
    guessed = media["image"]["tokens"][-2:] + media["audio"]["tokens"][-2:]  # "both" samples: halves of their media tokens
    assert np.abs(media["image"]["tokens"][-2:] - media["audio"]["tokens"][-2:]).max() <= 1 and (guessed > 0).all()

    spec = get_family("phi4_multimodal")
    model = instantiate(plan_build(ModelSection(preset=spec.tiny_preset, init="random")), device="meta")
    cost_model = CostModel.from_model(model, spec, {"vision", "projector", "llm"})
    costs = sample_costs(cost_model, dataset, dataset.lengths)
    text_only = cost_model.sample_costs(dataset.lengths, np.zeros(len(rows)), np.zeros(len(rows)), np.zeros(len(rows)))
    # the encoders are charged: more than the language model's share alone (labelled tokens aside, which are fewer)
    media_samples = np.asarray([k[0] != "text" for k in kinds] * 4)
    assert (costs[media_samples] > text_only[media_samples]).all()
    # a 721-token image costs more than a 25-token clip, and a sample holding both more than the image alone
    assert costs[1] > costs[2] and costs[3] > costs[1]
