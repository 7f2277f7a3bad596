"""The qwen3_omni family (Qwen3-Omni's thinker) on its tiny preset: module paths and FSDP units on the real
transformers class, the audio-token and image-token rules against the real `Qwen3OmniMoeProcessor`, counts from the
saved files against the collated length, packed rows against the samples one by one (losses, gradients, TMRoPE
positions), video samples (the processor's video tensors and seconds per temporal patch, token counts, packed rows
giving each sample its own logits), the cost model against `torch.utils.flop_counter`, and the built model loaded by
vanilla transformers with the same logits."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from audio_data import flac, wav  # noqa: E402

from vlmctl.config.model import ModelSection  # noqa: E402
from vlmctl.data.modalities.audio import normalize_audio  # noqa: E402
from vlmctl.data.sample import Sample  # noqa: E402
from vlmctl.families import get_family  # noqa: E402

TEXTS = ["What is that sound? A tone.", "Transcribe the clip.", "What color is the square?", "Which one is longer? The second."] * 10
SPEC = get_family("qwen3_omni")


@pytest.fixture(scope="module")
def tiny():
    """(plan, processor, model) of the tiny preset: 2 s audio windows of 32 mel bins in 1 s chunks, 16 px patches,
    4 experts, fp32."""
    from vlmctl.models.build import make_model, make_processor, plan_build

    plan = plan_build(ModelSection(preset=SPEC.tiny_preset, init="random", dtype="fp32"))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    return plan, processor, make_model(plan, processor)


def _png(w: int, h: int, color: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def _sample(sid: str, clips: list[bytes] = (), images: list[bytes] = (), question: str = "What is it?", answer: str = "A tone.") -> Sample:
    user = ([{"type": "image", "index": i} for i in range(len(images))] + [{"type": "audio", "index": i} for i in range(len(clips))]
            + [{"type": "text", "text": question}])
    return Sample(sid, [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                  images=list(images), audios=list(clips))


def _samples() -> list[Sample]:
    one, two, three = (normalize_audio(d).data for d in (wav(1.0), wav(0.5, 44_100, channels=2), flac(1.9, 8_000)))
    return [
        _sample("one", [one]),
        _sample("image", images=[_png(64, 64)], question="Color?", answer="Red."),
        _sample("two", [two, three], question="Which one is longer?", answer="The second."),
        Sample("text", [{"role": "user", "content": [{"type": "text", "text": "Hello?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]}]),
        _sample("both", [three], [_png(100, 60, (20, 200, 20)), _png(37, 90)], question="Same?", answer="Yes."),
    ]


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import (count_parameters, decoder_layer_classes, decoder_layers, encoder_layers, part_of_parameter,
                                 vision_layer_classes, vision_layers)
    from vlmctl.models.build import instantiate, plan_build

    model = instantiate(plan_build(ModelSection(preset=SPEC.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == SPEC.model_class
    assert list(SPEC.encoders) == ["audio", "image"]  # forward order: the thinker encodes audio before images
    assert type(model.get_submodule(SPEC.encoders["audio"].path)).__name__ == "Qwen3OmniMoeAudioEncoder"
    assert type(model.get_submodule(SPEC.encoders["image"].path)).__name__ == "Qwen3OmniMoeVisionEncoder"
    assert {k: {type(b).__name__ for b in blocks} for k, blocks in encoder_layers(model, SPEC).items()} == {
        "audio": {"Qwen3OmniMoeAudioEncoderLayer"}, "image": {"Qwen3OmniMoeVisionBlock"}}
    # both encoders are the `vision` part, their projections the projector
    assert {part_of_parameter(n, SPEC) for n, _ in model.named_parameters() if n.startswith(("model.audio_tower.layers.", "model.visual.blocks."))} == {"vision"}
    assert {part_of_parameter(n, SPEC) for n, _ in model.named_parameters() if n.startswith(("model.audio_tower.proj", "model.visual.merger"))} == {"projector"}
    assert [type(model.get_submodule(p)).__name__ for p in SPEC.projector] == ["Linear", "Linear", "Qwen3OmniMoeVisionPatchMerger", "ModuleList"]
    assert type(model.get_submodule(SPEC.language_model)).__name__ == "Qwen3OmniMoeThinkerTextModel"
    assert model.get_submodule(SPEC.lm_head).out_features == model.config.text_config.vocab_size
    assert {c.__name__ for c in decoder_layer_classes(model, SPEC)} == {"Qwen3OmniMoeThinkerTextDecoderLayer"} and len(decoder_layers(model, SPEC)) == 2
    assert {c.__name__ for c in vision_layer_classes(model, SPEC)} == {"Qwen3OmniMoeAudioEncoderLayer", "Qwen3OmniMoeVisionBlock"}
    assert len(vision_layers(model, SPEC)) == 4
    counts = count_parameters(model, SPEC)
    assert min(counts["vision"], counts["projector"], counts["llm"]) > 0
    assert set(SPEC.modalities) == {"image", "video", "audio"} and SPEC.mrope and SPEC.supports_packing
    assert SPEC.encoders["image"].modalities == ("image", "video")


def test_a_preset_whose_encoder_cannot_take_its_features_is_refused(tiny):
    from vlmctl.errors import ModelError

    plan, processor, _ = tiny
    config = json.loads(json.dumps(plan.vlm_config))
    with pytest.raises(ModelError, match="n_window"):
        SPEC.preset_processor(processor.tokenizer, None, plan.processor_kwargs, {**config, "audio_config": {**config["audio_config"], "n_window": 25}})
    with pytest.raises(ModelError, match="mel bins"):
        SPEC.preset_processor(processor.tokenizer, None, {**plan.processor_kwargs, "feature_size": 80}, config)


def test_tokens_ids_and_a_forward_backward_through_both_encoders(tiny):
    import torch
    from PIL import Image

    _, processor, model = tiny
    assert type(processor).__name__ == "Qwen3OmniMoeProcessor" and processor.video_processor.patch_size == 16
    tok = processor.tokenizer
    cfg = model.config
    assert cfg.image_token_id == processor.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.audio_token_id == processor.audio_token_id == tok.convert_tokens_to_ids("<|audio_pad|>")
    assert (cfg.vision_start_token_id, cfg.audio_start_token_id) == tuple(tok.convert_tokens_to_ids(["<|vision_start|>", "<|audio_start|>"]))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": SPEC.prompt("audio") + "What?"}]}],
                                         tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|>What?" in text
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 90, 3), np.uint8))
    batch = processor(text=[text], images=[image], audio=[np.full(16_000, 0.1, np.float32)], sampling_rate=16_000, return_tensors="pt")
    assert tuple(batch["input_features"].shape) == (1, 32, 200) and int(batch["feature_attention_mask"].sum()) == 100
    model.train()
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    grads = {n.split(".")[1] for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert torch.isfinite(loss) and {"audio_tower", "visual", "language_model"} <= grads  # both encoders reached the loss
    model.zero_grad(set_to_none=True)
    model.eval()


def _audio_count(processor, waves) -> list[int]:
    out = []
    for wave in waves:
        batch = processor(text=[f"Hi {SPEC.prompt('audio')} there"], audio=[wave], sampling_rate=16_000, return_tensors="pt")
        out.append(int((batch["input_ids"] == processor.audio_token_id).sum()))
    return out


def test_the_audio_and_image_token_rules_match_the_real_processor(tiny):
    from PIL import Image
    from transformers import WhisperFeatureExtractor

    _, processor, model = tiny
    lengths = [1, 160, 161, 320, 481, 961, 1600, 4000, 15_999, 16_000, 16_161, 17_600, 31_840, 32_000, 40_000]
    counted = _audio_count(processor, [np.full(n, 0.1, np.float32) for n in lengths])
    assert counted == [SPEC.num_audio_tokens(n, 16_000, processor) for n in lengths]
    assert len(set(counted)) >= 7  # the lengths cover partial chunks, whole chunks and the cut at the window
    assert SPEC.num_audio_tokens(16_000, 16_000, processor) == 13 and SPEC.num_audio_tokens(40_000, 16_000, processor) == 26
    assert SPEC.num_audio_tokens(8_000, 8_000, processor) == 13  # counted after resampling to the extractor's rate
    assert SPEC.num_audio_tokens(10**7, 16_000, model.config) == 30 * 13  # from the config: the published 30 s window
    assert SPEC.num_audio_tokens(16_000, 16_000, {"feature_extractor": processor.feature_extractor.to_dict()}) == 13
    published = SPEC.make_processor(processor.tokenizer, processor.image_processor, processor.chat_template,
                                    feature_extractor=WhisperFeatureExtractor(feature_size=128))
    lengths = [16_000, 160_000, 479_999, 480_000, 640_000]
    assert _audio_count(published, [np.full(n, 0.1, np.float32) for n in lengths]) == [
        SPEC.num_audio_tokens(n, 16_000, published) for n in lengths] == [13, 130, 390, 390, 390]
    for w, h in [(64, 64), (100, 60), (37, 211), (500, 300), (32, 32)]:
        batch = processor(text=[f"a {SPEC.image_prompt} b"], images=[Image.new("RGB", (w, h))], return_tensors="pt")
        n = int((batch["input_ids"] == processor.image_token_id).sum())
        assert n == SPEC.num_visual_tokens(w, h, processor) == SPEC.num_visual_tokens(w, h, processor.image_processor), (w, h)


def test_transformers_own_processor_batches_the_same(tiny):
    """Transformers' processor (what a machine with torchvision loads) pads a call to its longest clip; the family's
    `processor_outputs` pads each sample's clips to the window, so the collator batches them and the model gives
    the same loss as on the family's processor."""
    import torch
    import transformers

    from vlmctl.data.collate import Collator
    from vlmctl.families.qwen2_5_omni import omni_image_audio
    from vlmctl.train.objectives import loss_sum

    _, processor, model = tiny
    stock = omni_image_audio(transformers.Qwen3OmniMoeProcessor)(
        image_processor=processor.image_processor, feature_extractor=processor.feature_extractor, tokenizer=processor.tokenizer,
        chat_template=processor.chat_template)
    one = stock(text=[f"a {SPEC.prompt('audio')}"], audio=[np.full(12_000, 0.1, np.float32)], sampling_rate=16_000, return_tensors="pt")
    assert one["input_features"].shape[-1] == 75 and SPEC.processor_outputs(one, stock)["input_features"].shape[-1] == 200
    samples = [s for s in _samples() if s.id in ("one", "two", "both")]
    with torch.no_grad():
        ours = float(loss_sum(model, Collator(processor, SPEC, dummy_image=False)(samples)))
        theirs = float(loss_sum(model, Collator(stock, SPEC, dummy_image=False)(samples)))
    assert theirs == pytest.approx(ours, rel=1e-6)


def test_counts_read_from_the_files_equal_the_collated_length(tiny, tmp_path):
    from vlmctl.data.collate import Collator
    from vlmctl.data.tokens import TokenCounter

    _, processor, _ = tiny
    processor.save_pretrained(str(tmp_path))
    (tmp_path / "vlmctl_model.json").write_text(json.dumps({"family": SPEC.name}))
    counter = TokenCounter(processor, SPEC.name, tmp_path)
    collator = Collator(processor, SPEC, max_length=100_000, dummy_image=False)
    for sample in _samples():
        sizes = [(64, 64)] if sample.id == "image" else [(100, 60), (37, 90)] if sample.id == "both" else []
        assert counter.count(sample, sizes) == collator([sample])["input_ids"].shape[1], sample.id


def test_packed_rows_give_the_per_sample_losses_and_gradients(tiny):
    """A packed row of audio, image, text-only and audio + two-image samples: each sample's summed loss and every
    gradient equal the samples' own (padded, the class's own forward and positions); image samples get their TMRoPE
    positions from the hook."""
    import copy

    import torch

    from vlmctl.data.collate import Collator, PackedCollator, model_inputs
    from vlmctl.families.qwen2_5_omni import keep_logits_forward
    from vlmctl.train.kernels import per_sample_sums, token_losses
    from vlmctl.train.objectives import loss_sum

    _, processor, base = tiny
    model, samples = copy.deepcopy(base).eval(), _samples()
    single = Collator(processor, SPEC, dummy_image=False)
    ref = torch.stack([loss_sum(model, single([s])) for s in samples])
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    hook = SPEC.position_hook(model, processor.image_token_id)
    assert not keep_logits_forward(model)  # installed by the hook
    row = PackedCollator(processor, SPEC, tokens_per_batch=4096)(samples)
    assert row["input_ids"].shape[0] == 1 and row["num_dummy_audios"] == 0 and row["num_dummy_images"] == 0
    row = hook(row)
    assert tuple(row["position_ids"].shape) == (4, 1, row["input_ids"].shape[1])
    assert not torch.equal(row["position_ids"][0], row["position_ids"][1])  # images: 3-D positions differ from text's
    losses, index = token_losses(model, {**model_inputs(row), "labels": row["labels"]})
    sums, _ = per_sample_sums(losses, index, row["seq_lens"])
    torch.testing.assert_close(sums.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    loss_sum(model, row).backward()
    for name, p in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    padded = Collator(processor, SPEC)(samples)
    with torch.no_grad():
        assert float(loss_sum(model, padded)) == pytest.approx(float(ref.sum()), rel=1e-4)


@pytest.mark.parametrize("trainable", [{"vision", "projector", "llm"}, {"projector", "llm"}, {"projector"}, {"llm"}],
                         ids=["full", "finetune", "align", "llm"])
def test_the_cost_model_matches_the_flop_counter(tiny, trainable):
    """One packed row holding one sample with two clips (a partial and whole chunks) and two images, forward and
    backward on the labelled positions with eager attention and eager experts: the cost model's terms equal what
    `FlopCounterMode` counts, up to the causal half of the language model's attention (the counter counts T^2)."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from vlmctl.data.collate import PackedCollator, model_inputs
    from vlmctl.families import part_of_parameter
    from vlmctl.train.flops import CostModel

    _, processor, base = tiny
    model = copy.deepcopy(base)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")  # a matmul per expert, which the counter sees
    clips = [normalize_audio(d).data for d in (wav(1.5), flac(0.7, 8_000))]
    sample = _sample("s", clips, [_png(100, 60), _png(64, 130)], question="Describe them all. " * 5, answer="A tone and two pictures. " * 6)
    row = SPEC.position_hook(model, processor.image_token_id)(PackedCollator(processor, SPEC, tokens_per_batch=4096)([sample]))
    assert row["feature_attention_mask"].sum(-1).tolist() == [150, 70] and row["image_grid_thw"].shape[0] == 2
    for name, p in model.named_parameters():
        p.requires_grad_(part_of_parameter(name, SPEC) in trainable)
    labels = row["labels"]
    target = torch.nonzero(labels[0] != -100).squeeze(1)
    with FlopCounterMode(display=False) as counter:
        logits = model(**model_inputs(row), logits_to_keep=target - 1, use_cache=False).logits[0]
        F.cross_entropy(logits.float(), labels[0, target], reduction="sum").backward()
    cost = CostModel.from_model(model, SPEC, trainable)
    terms = cost.batch_terms(row)
    expected = sum(terms.values()) + terms["llm_attention"]  # causal=False, as counted
    measured = counter.get_total_flops()
    assert abs(expected - measured) / measured < 0.01, (sorted(trainable), expected, measured, terms)
    assert min(terms["audio"], terms["audio_attention"], terms["vision"], terms["vision_attention"], terms["projector"]) > 0
    # on the meta device the same
    from vlmctl.models.build import instantiate, plan_build

    meta = instantiate(plan_build(ModelSection(preset=SPEC.tiny_preset, init="random")), processor.tokenizer, device="meta")
    assert CostModel.from_model(meta, SPEC, trainable).batch_terms(row) == terms


def test_the_build_loads_with_vlmctl_and_with_vanilla_transformers_with_the_same_logits(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText, Qwen3OmniMoeThinkerForConditionalGeneration

    from vlmctl.data.collate import Collator, model_inputs
    from vlmctl.models import build_model, load_model

    out = tmp_path / "model"
    result = build_model(ModelSection(preset=SPEC.tiny_preset, init="random", output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS)
    assert result.family == "qwen3_omni" and (result.info["audio_window_seconds"], result.info["audio_tokens_per_window"]) == (2.0, 26)
    model, processor, family = load_model(out, dtype=torch.float32)
    assert family is SPEC and type(processor).__name__ == "Qwen3OmniMoeProcessor" and processor.feature_extractor.chunk_length == 2
    assert processor.image_processor.size["longest_edge"] == 262144  # the saved image-processor settings
    vanilla = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    inputs = model_inputs(Collator(processor, SPEC, dummy_image=False)(_samples()))
    with torch.no_grad():
        ours = model.eval()(**inputs).logits
        torch.testing.assert_close(vanilla(**inputs).logits, ours, rtol=0, atol=0)
    auto = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(auto) is type(vanilla)
    with torch.no_grad():
        torch.testing.assert_close(auto(**inputs).logits, ours, rtol=0, atol=0)


def _counts(batch, ids: dict[str, int], items: dict[str, int]) -> dict:
    """The counts a sampler has of one collated sample: its tokens, labelled tokens and, per modality, its
    placeholder tokens (`ids`: modality -> placeholder id) and media items."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    real = batch["attention_mask"].sum() if batch.get("attention_mask") is not None else input_ids.numel()
    media = {m: {"tokens": [int((input_ids == i).sum())], "items": [items.get(m, 0)]} for m, i in ids.items()}
    return {"tokens": [int(real)], "labelled": [int((labels[..., 1:] != -100).sum())], "media": media,
            "visual": [sum(c["tokens"][0] for c in media.values())], "items": [sum(items.values())]}


def test_sample_costs_charge_each_encoder_its_own_media_as_the_batch_does(tiny):
    """Compute-balanced batching of an image + audio family whose audio encoder counts itself: from the counts
    before collation (tokens, labelled tokens, per modality placeholder tokens and items) the estimated FLOPs of a
    sample with one clip and one image equal its collated batch's within 2%; without the per-modality counts a clip's
    tokens are taken as image patches and the estimate is off."""
    from vlmctl.data.collate import Collator
    from vlmctl.train.flops import CostModel

    _, processor, model = tiny
    cost = CostModel.from_model(model, SPEC, {"vision", "projector", "llm"})
    assert cost.own_media == (("audio",),) and "image" in cost.vision_media
    ids = {"image": processor.image_token_id, "audio": processor.audio_token_id}
    clip = normalize_audio(flac(1.9, 8_000)).data
    samples = {"text": _sample("t", question="Describe a tone and a square " * 3), "audio": _sample("a", [clip]),
               "image": _sample("i", images=[_png(100, 60)]), "both": _sample("b", [clip], [_png(64, 130)])}
    estimated = {}
    for name, sample in samples.items():
        batch = Collator(processor, SPEC, dummy_image=False)([sample])
        c = _counts(batch, ids, {"image": len(sample.images), "audio": len(sample.audios)})
        estimated[name] = cost.sample_costs(c["tokens"], c["visual"], c["labelled"], c["items"], media=c["media"])[0]
        blind = cost.sample_costs(c["tokens"], c["visual"], c["labelled"], c["items"])[0]
        measured = cost.batch_flops(batch)
        assert abs(estimated[name] - measured) / measured < 0.02, (name, estimated[name], measured)
        if sample.audios:
            assert abs(blind - measured) / measured > 0.1, (name, blind, measured)


# ------------------------------------------------------------------------------------------------ videos


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    """Stored clips of a square moving right: `slow` 8 frames at 2 fps (1 s per temporal patch: whole temporal
    positions), `fast` 12 frames of 84 x 56 at 8 fps (0.25 s per patch: 3.25 positions apart)."""
    pytest.importorskip("av")
    from video_data import moving_square

    from vlmctl.config.data import DataVideo
    from vlmctl.data.modalities.video import normalize_video

    def clip(frames: int, w: int, h: int, fps: int) -> bytes:
        settings = DataVideo(fps=fps, max_frames=64, min_pixels=16, max_pixels=w * h)
        return normalize_video(moving_square(frames=frames, width=w, height=h, fps=fps), settings).data

    return {"slow": clip(8, 64, 48, 2), "fast": clip(12, 84, 56, 8)}


def _video_sample(sid: str, videos: list[bytes], images: list[bytes] = (), audios: list[bytes] = (), answer: str = "A red square.") -> Sample:
    user = ([{"type": "image", "index": i} for i in range(len(images))] + [{"type": "audio", "index": i} for i in range(len(audios))]
            + [{"type": "video", "index": i} for i in range(len(videos))] + [{"type": "text", "text": "What moves?"}])
    return Sample(sid, [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                  images=list(images), audios=list(audios), videos=list(videos))


def _video_samples(clips) -> list[Sample]:
    tone = normalize_audio(wav(1.0)).data
    return [
        _video_sample("slow", [clips["slow"]]),
        Sample("text", [{"role": "user", "content": [{"type": "text", "text": "Hello?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]}]),
        _video_sample("image-and-fast", [clips["fast"]], images=[_png(64, 64)], answer="It moves right."),
        _video_sample("audio-and-slow", [clips["slow"]], audios=[tone], answer="A tone and a square."),
        _video_sample("two", [clips["fast"], clips["slow"]], answer="The same square."),
    ]


def test_video_samples_give_the_processor_tensors_token_counts_and_seconds_per_temporal_patch(tiny, clips, tmp_path):
    import torch

    from vlmctl.data.collate import Collator, encode_sample
    from vlmctl.data.tokens import TokenCounter
    from vlmctl.families.qwen3_omni import VIDEO_SIZE

    _, processor, model = tiny
    video = processor.video_processor
    assert (video.patch_size, video.temporal_patch_size, video.merge_size) == (16, 2, 2)
    assert video.size == {"shortest_edge": 4096, "longest_edge": 16384}  # the preset's video_min_pixels / video_max_pixels
    sample = _video_sample("all", [clips["slow"], clips["fast"]], images=[_png(64, 64)], audios=[normalize_audio(wav(1.0)).data])
    enc = encode_sample(sample, processor, SPEC)
    media = enc.media_inputs["video"]
    grids = media["video_grid_thw"].tolist()
    assert [g[0] for g in grids] == [4, 6]  # frames / temporal patch of 2
    assert tuple(media["pixel_values_videos"].shape) == (sum(t * h * w for t, h, w in grids), 3 * 2 * 16 * 16)
    # seconds per temporal patch: 2 frames / the clip's sampled rate (2 fps, 8 fps)
    assert media["video_second_per_grid"].tolist() == pytest.approx([1.0, 0.25])
    assert set(enc.media_inputs) == {"image", "video", "audio"}
    frames = [(8, 64, 48), (12, 84, 56)]
    per_clip = [SPEC.num_video_tokens(f, w, h, processor) for f, w, h in frames]
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert int((enc.input_ids == video_id).sum()) == sum(per_clip) == sum(t * h * w // 4 for t, h, w in grids)
    # counted from the saved files (prepare's counter) as the collator writes them
    processor.save_pretrained(str(tmp_path))
    (tmp_path / "vlmctl_model.json").write_text(json.dumps({"family": SPEC.name}))
    counter = TokenCounter(processor, SPEC.name, tmp_path)
    for s in _video_samples(clips):
        sizes = [(64, 64)] * len(s.images)
        assert counter.count(s, sizes) == Collator(processor, SPEC, max_length=100_000, dummy_image=False)([s])["input_ids"].shape[1], s.id
    # from the model config: the published bounds (128 to 768 blocks of 32 x 32 px a frame), as a processor with them writes
    published = SPEC.make_processor(processor.tokenizer, processor.image_processor, processor.chat_template)
    assert published.video_processor.size == VIDEO_SIZE
    frames = torch.zeros(6, 90, 130, 3, dtype=torch.uint8).numpy()
    out = published(text=[f"a {SPEC.prompt('video')}"], videos=[frames], video_metadata=[{"fps": 3.0, "total_num_frames": 6}],
                    do_sample_frames=False, return_tensors="pt")
    assert int((out["input_ids"] == video_id).sum()) == SPEC.num_video_tokens(6, 130, 90, model.config) == SPEC.num_video_tokens(6, 130, 90, published)
    assert out["video_second_per_grid"].tolist() == pytest.approx([2 / 3])
    with pytest.raises(ValueError, match="use_audio_in_video"):
        processor(text=[f"a {SPEC.prompt('video')}"], videos=[frames], use_audio_in_video=True, return_tensors="pt")


def test_a_packed_row_with_videos_gives_each_sample_its_own_logits(tiny, clips):
    """Video, text, image + video, audio + video and two-video samples in one packed row: each sample's logits equal
    its own forward (padded, the class's own positions from `video_second_per_grid`); the 8 fps clip's temporal
    positions are fractional and kept so; without the hook's positions the logits differ."""
    import copy

    import torch

    from vlmctl.data.collate import Collator, PackedCollator, model_inputs

    _, processor, base = tiny
    model, samples = copy.deepcopy(base).eval(), _video_samples(clips)
    single = Collator(processor, SPEC, dummy_image=False)
    with torch.no_grad():
        ref = [model(**model_inputs(single([s]))).logits[0] for s in samples]
    row = PackedCollator(processor, SPEC, tokens_per_batch=8192, dummy_image=False)(samples)
    assert row["input_ids"].shape[0] == 1 and len(row["seq_lens"]) == len(samples)
    assert row["video_second_per_grid"].tolist() == pytest.approx([1.0, 0.25, 1.0, 0.25, 1.0])
    row = SPEC.position_hook(model, processor.image_token_id)(row)
    positions = row["position_ids"]
    assert tuple(positions.shape) == (4, 1, row["input_ids"].shape[1]) and positions.dtype == torch.float32
    assert not torch.equal(positions, positions.round())  # 3.25 positions per temporal patch of the fast clip
    with torch.no_grad():
        logits = model(**model_inputs(row), use_cache=False).logits[0]  # a cache turns off transformers' packed mask
        start = 0
        for sample, expect, n in zip(samples, ref, row["seq_lens"]):
            assert n == expect.shape[0], sample.id
            torch.testing.assert_close(logits[start:start + n], expect, rtol=1e-5, atol=1e-5, msg=f"logits of {sample.id}")
            start += n
        flat = model(**{**model_inputs(row), "position_ids": positions[:1].long()}, use_cache=False).logits[0]
    assert not torch.allclose(flat, logits, atol=1e-3)  # the videos' 3-D positions matter
    model.train()
    from vlmctl.train.objectives import loss_sum

    loss_sum(model, row).backward()
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0  # the frames reach the loss


def test_video_samples_on_the_built_folder_give_vanilla_transformers_logits_and_counted_flops(tiny, clips, tmp_path):
    """The built folder loaded by vlmctl (stand-in video processor read back) and by vanilla transformers gives the
    same logits on video samples (the class computing the positions from `video_second_per_grid`); the cost model's
    terms of a packed row with two clips and an image equal `FlopCounterMode`'s count (eager attention and experts,
    the language model's attention causal-halved as in the audio / image test)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    from vlmctl.data.collate import Collator, PackedCollator, model_inputs
    from vlmctl.models import build_model, load_model
    from vlmctl.train.flops import CostModel

    out = tmp_path / "model"
    build_model(ModelSection(preset=SPEC.tiny_preset, init="random", output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS)
    model, processor, _ = load_model(out, dtype=torch.float32)
    assert processor.video_processor.size == {"shortest_edge": 4096, "longest_edge": 16384}
    vanilla = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    samples = [s for s in _video_samples(clips) if s.videos]
    inputs = model_inputs(Collator(processor, SPEC, dummy_image=False)(samples))
    assert inputs["video_second_per_grid"].tolist() == pytest.approx([1.0, 0.25, 1.0, 0.25, 1.0])
    with torch.no_grad():
        torch.testing.assert_close(vanilla(**inputs).logits, model.eval()(**inputs).logits, rtol=0, atol=0)

    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    sample = _video_sample("s", [clips["slow"], clips["fast"]], images=[_png(64, 64)], answer="A red square moves right. " * 4)
    row = SPEC.position_hook(model, processor.image_token_id)(PackedCollator(processor, SPEC, tokens_per_batch=4096, dummy_image=False)([sample]))
    labels = row["labels"]
    target = torch.nonzero(labels[0] != -100).squeeze(1)
    with FlopCounterMode(display=False) as counter:
        logits = model.train()(**model_inputs(row), logits_to_keep=target - 1, use_cache=False).logits[0]
        F.cross_entropy(logits.float(), labels[0, target], reduction="sum").backward()
    terms = CostModel.from_model(model, SPEC, {"vision", "projector", "llm"}).batch_terms(row)
    expected = sum(terms.values()) + terms["llm_attention"]  # causal=False, as counted
    measured = counter.get_total_flops()
    assert abs(expected - measured) / measured < 0.01, (expected, measured, terms)
