"""`vlmctl bench`'s samples with several images or one video clip: what the workloads draw, count and cost against
what the trainer's collator makes of them, and the cost model's vision-tower FLOPs of video clips against torch's
FLOP counter. The benches themselves are in tests/integration/test_bench_models.py."""

from __future__ import annotations

import pytest

from vlmctl.bench import WorkloadSpec


def _qwen_config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config=dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
                            vision_config=dict(depth=2, hidden_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[1]),
                            image_token_id=3, video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)


def _cost_model(config):
    import torch
    import transformers

    from vlmctl.families import detect_family, get_family
    from vlmctl.train.flops import CostModel

    family = get_family(detect_family(config))
    with torch.device("meta"):
        model = getattr(transformers, family.model_class)(config)
    return CostModel.from_model(model, family, {"vision", "projector", "llm"})


def test_spec_describes_the_media_of_its_samples():
    assert WorkloadSpec().media() == "1 image (224-560 px)"
    assert WorkloadSpec(images_per_sample=(2, 3), image_sizes=(56,)).media() == "2-3 images (56 px)"
    spec = WorkloadSpec.from_flags("224", "8,40", "chat", video_frames="16,64", video_sizes="224,448")
    assert spec.video_frames == (16, 64) and spec.video_sizes == (224, 448)
    assert spec.media() == "1 video of 16-64 frames (224-448 px)"


def test_baseline_samples_with_several_images_and_their_costs():
    # each image is its own run of image tokens between vision start/end tokens, before the text; the probe's cost
    # estimate counts every image of a sample
    import numpy as np

    from vlmctl.bench import BaselineWorkload, qwen_vl_samples

    cfg = _qwen_config()
    spec = WorkloadSpec(image_sizes=(28, 56, 112), text_tokens=(5, 30), images_per_sample=(2, 3))
    samples = qwen_vl_samples(40, cfg, spec)
    assert {s["n_images"] for s in samples} == {2, 3}
    for s in samples:
        ids, grids = s["input_ids"].tolist(), s["image_grid_thw"].tolist()
        assert len(grids) == s["n_images"] and ids.count(5) == ids.count(6) == s["n_images"]
        runs = [int(h * w // 4) for _, h, w in grids]
        start = 0
        for n in runs:  # <vision_start> n x <image_pad> <vision_end>, image after image
            assert ids[start] == 5 and ids[start + 1:start + 1 + n] == [3] * n and ids[start + 1 + n] == 6
            start += n + 2
        assert s["n_visual"] == sum(runs) and s["pixel_values"].shape[0] == s["n_patches"] == sum(h * w for _, h, w in grids)
        assert (s["labels"][:start] == -100).all() and (s["labels"][start:] != -100).all()
        assert s["n_text"] == len(ids) - s["n_visual"] and not {3, 4, 5, 6} & set(ids[start:])
    workload = BaselineWorkload(cfg, spec, seed=0, rows=4, budget=512)
    cost = _cost_model(cfg)
    expected = [cost.sample_flops(text_tokens=s["n_text"], labelled_tokens=s["n_text"], visual_tokens=s["n_visual"],
                                  image_patches=[s["n_patches"] // s["n_images"]] * s["n_images"]) for s in workload.samples]
    assert workload.costs(cost) == pytest.approx(np.asarray(expected), rel=1e-12)


@pytest.fixture(scope="module")
def video_plan():
    """A chat bench of the tiny Qwen2.5-VL preset on clips of 4-8 frames of 56 px, padded micro-batches of 2."""
    from vlmctl import bench
    from vlmctl.config import ModelSection, TrainSection

    spec = WorkloadSpec(text_tokens=(3, 30), video_frames=(3, 8), video_sizes=(56,))
    return bench.prepare(ModelSection(preset="tiny-qwen2.5-vl", init="random"), TrainSection(packing=False, micro_batch_size=2),
                         spec, steps=3, warmup=1, check_device=False)


def test_video_samples_go_through_the_video_processor_as_counted(video_plan):
    # a clip is a stored clip (Motion JPEG in Matroska) that the collator decodes and the family's video processor
    # patchifies; its counted tokens (planning) are what the processor makes, the answer alone is labelled
    import torch

    from vlmctl.data.collate import IGNORE_INDEX, Collator
    from vlmctl.data.modalities.video import decode_clip

    plan = video_plan
    workload, family, processor = plan.workload, plan.model.family, plan.model.processor
    assert plan.spec.kind == "chat" and len(workload.lengths) == 8  # auto: video samples take the chat workload
    collator = Collator(processor, family)
    tokenizer = processor.tokenizer
    for i in range(len(workload.lengths)):
        frames, side = workload.media[i].video
        assert frames in (4, 6, 8) and side == 56 and workload.media[i].images == ()  # even counts in 3..8
        sample = workload.sample(i)
        clip = decode_clip(sample.videos[0])
        assert clip.frames.shape == (frames, side, side, 3) and sample.images == []
        row = collator.encode(sample)
        t, h, w = row.media_inputs["video"]["video_grid_thw"][0].tolist()
        assert row.length == workload.lengths[i] and row.media_counts == {"video": 1} and t == frames // 2
        assert row.num_visual_tokens == t * h * w // 4 == family.num_video_tokens(frames, side, side, processor) == workload.visual_tokens(workload.media[i])
        assert row.media_inputs["video"]["pixel_values_videos"].shape[0] == t * h * w
        answer = sample.messages[1]["content"][0]["text"]
        labelled = row.labels[row.labels != IGNORE_INDEX].tolist()
        assert labelled[:-1] == tokenizer(answer, add_special_tokens=False)["input_ids"]
    batch = workload.batch([0, 1], collator)
    assert batch["num_dummy_images"] == 0 and "pixel_values" not in batch  # the clips run the vision tower
    assert batch["video_grid_thw"].shape == (2, 3) and batch["num_visual_tokens"] == sum(
        int(torch.prod(g)) // 4 for g in batch["video_grid_thw"])


def test_video_costs_count_a_clip_as_its_temporal_patches(video_plan):
    # the probe's estimate: a clip of t temporal patches of h x w patches costs what t images of h x w patches do;
    # the collated batch's FLOPs count the clip's vision tower from its grid
    import numpy as np

    from vlmctl.data.collate import Collator

    workload = video_plan.workload
    cost = _cost_model(video_plan.model.config)
    costs = workload.costs(cost)
    expected = []
    for n, media in zip(workload.lengths, workload.media):
        visual = workload.visual_tokens(media)
        t = media.video[0] // 2
        expected.append(cost.sample_flops(text_tokens=n - visual, labelled_tokens=n - visual, visual_tokens=visual,
                                          image_patches=[visual * 4 // t] * t))
    assert costs == pytest.approx(np.asarray(expected), rel=1e-12)
    batch = workload.batch([0], Collator(video_plan.model.processor, video_plan.model.family, dummy_image=False))
    grid = tuple(batch["video_grid_thw"][0].tolist())
    terms = cost.batch_terms(batch)
    alone = cost.sample_terms(text_tokens=batch["num_text_tokens"], labelled_tokens=batch["num_label_tokens"], image_grids=[grid])
    assert terms["vision"] == alone["vision"] > 0 and terms["vision_attention"] == alone["vision_attention"] > 0


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_video_flops_match_the_flop_counter(name):
    # two clips through a tiny model's forward + backward (eager attention): the cost model's terms equal what
    # torch counts, Qwen2.5-VL's window attention per temporal slice included (the causal half put back, as in
    # tests/unit/test_flops.py)
    import torch
    import torch.nn.functional as F
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from vlmctl.families import get_family
    from vlmctl.train.flops import CostModel

    text = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
    ids = dict(image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003)
    if name == "qwen2_vl":
        cfg = transformers.Qwen2VLConfig(text_config=text, **ids, vision_config=dict(
            depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2))
    else:
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, **ids, vision_config=dict(
            depth=4, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=14,
            spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1, 3]))
    family = get_family(name)
    torch.manual_seed(0)
    model = getattr(transformers, family.model_class)(cfg)
    model.set_attn_implementation("eager")
    grids = [(3, 12, 8), (2, 6, 10)]  # 12 x 8 patches: windows of 4 x 4 patches, the last row of windows partial
    tokens = [5]
    for t, h, w in grids:
        tokens += [1002] + [1001] * (t * h * w // 4) + [1003]
    input_ids = torch.tensor([tokens + list(range(10, 250))])
    labels = input_ids.clone()
    labels[:, :-120] = -100
    batch = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=(input_ids == 1001).long() * 2,
                 video_grid_thw=torch.tensor(grids), second_per_grid_ts=torch.tensor([1.0, 1.0]),
                 pixel_values_videos=torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14))
    if name == "qwen2_vl":
        del batch["second_per_grid_ts"]
    target = torch.nonzero(labels[0] != -100).squeeze(1)
    with FlopCounterMode(display=False) as counter:
        logits = model(**batch, logits_to_keep=target - 1, use_cache=False).logits[0]
        F.cross_entropy(logits.float(), labels[0, target], reduction="sum").backward()
    terms = CostModel.from_model(model, family, {"vision", "projector", "llm"}).batch_terms({**batch, "labels": labels})
    assert sum(terms.values()) + terms["llm_attention"] == pytest.approx(counter.get_total_flops(), rel=1e-9)
    assert terms["vision"] > 0 and terms["vision_attention"] > 0
