"""The phi4_multimodal family (Phi-4-multimodal) on its tiny preset: module paths and FSDP units on the real
transformers class, the image-token and audio-token rules against the real `Phi4MultimodalProcessor` (with vlmctl's
port of its image processor), padded batches and packed rows of audio, image and text samples through the trainer's
collators, and the built model loaded by vanilla transformers with the same logits."""

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
SPEC = get_family("phi4_multimodal")


@pytest.fixture(scope="module")
def tiny():
    """(plan, processor, model) of the tiny preset: 64 px crops of 2 px patches (at most 4), clips padded to 2 s, fp32."""
    from vlmctl.models.build import make_model, make_processor, plan_build

    plan = plan_build(ModelSection(preset=SPEC.tiny_preset, init="random", dtype="fp32"))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    return plan, processor, make_model(plan, processor).eval()


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


def _clips() -> list[bytes]:
    return [normalize_audio(d).data for d in (wav(1.0), flac(1.9, 8_000))]


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import (count_parameters, decoder_layer_classes, decoder_layers, encoder_layers, part_of_parameter,
                                 vision_layer_classes, vision_layers)
    from vlmctl.models.build import instantiate, plan_build

    model = instantiate(plan_build(ModelSection(preset=SPEC.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == SPEC.model_class
    assert list(SPEC.encoders) == ["image", "audio"]
    assert type(model.get_submodule(SPEC.encoders["image"].path)).__name__ == "Phi4MultimodalVisionModel"
    assert type(model.get_submodule(SPEC.encoders["audio"].path)).__name__ == "Phi4MultimodalAudioModel"
    assert {k: {type(b).__name__ for b in blocks} for k, blocks in encoder_layers(model, SPEC).items()} == {
        "image": {"Phi4MultimodalVisionEncoderLayer"}, "audio": {"Phi4MultimodalAudioConformerEncoderLayer"}}
    # both encoders are the `vision` part; the image embedding's separators are the language model's
    parts = {n: part_of_parameter(n, SPEC) for n, _ in model.named_parameters()}
    assert {p for n, p in parts.items() if n.startswith(("model.embed_tokens_extend.image_embed.img_processor.",
                                                         "model.embed_tokens_extend.audio_embed.encoder."))} == {"vision"}
    assert parts["model.embed_tokens_extend.image_embed.sub_img_feature_extensor"] == "llm"
    assert {type(model.get_submodule(p)).__name__ for p in SPEC.projector} == {"Linear"} and len(SPEC.projector) == 6
    assert model.get_submodule(SPEC.lm_head).out_features == model.config.vocab_size
    assert {c.__name__ for c in decoder_layer_classes(model, SPEC)} == {"Phi4MultimodalDecoderLayer"} and len(decoder_layers(model, SPEC)) == 3
    assert {c.__name__ for c in vision_layer_classes(model, SPEC)} == {"Phi4MultimodalVisionEncoderLayer", "Phi4MultimodalAudioConformerEncoderLayer"}
    assert len(vision_layers(model, SPEC)) == 4
    counts = count_parameters(model, SPEC)
    assert min(counts["vision"], counts["projector"], counts["llm"]) > 0
    assert set(SPEC.modalities) == {"image", "audio"} and SPEC.supports_packing
    # the token ids live in the encoders' configs, the text settings at the top level
    assert (model.config.vision_config.image_token_id, model.config.audio_config.audio_token_id) != (200010, 200011)
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size < 1024


def test_a_preset_whose_layout_breaks_the_token_count_is_refused(tiny):
    from vlmctl.errors import ModelError

    plan, processor, _ = tiny
    kwargs = json.loads(json.dumps(plan.processor_kwargs))
    with pytest.raises(ModelError, match="32"):
        SPEC.preset_processor(processor.tokenizer, None, {**kwargs, "image": {**kwargs["image"], "patch_size": 4}}, plan.vlm_config)
    with pytest.raises(ModelError, match="reduces time by 8"):
        SPEC.preset_processor(processor.tokenizer, None, {**kwargs, "audio": {"audio_compression_rate": 4}}, plan.vlm_config)


def test_the_image_and_audio_token_rules_match_the_real_processor(tiny):
    from PIL import Image

    _, processor, model = tiny
    # one crop, a padded crop, 2 x 1 and 3 x 2 grids, and more crops than dynamic_hd (the closest aspect ratio)
    for w, h in [(64, 64), (100, 60), (37, 90), (130, 64), (150, 100), (400, 90), (90, 500), (300, 300)]:
        batch = processor(text=[f"a {SPEC.image_prompt} b"], images=[Image.new("RGB", (w, h))], return_tensors="pt")
        n = int((batch["input_ids"] == processor.image_token_id).sum())
        own = processor.image_processor(images=[Image.new("RGB", (w, h))])["num_img_tokens"][0]
        assert n == own == SPEC.num_visual_tokens(w, h, processor) == SPEC.num_visual_tokens(w, h, processor.image_processor), (w, h)
        assert batch["image_pixel_values"].shape[1] <= 1 + processor.image_processor.dynamic_hd
    # the published layout (448 px crops of 14 px patches, up to 36) from the config
    assert SPEC.num_visual_tokens(448, 448, model.config) == 256 + 1 + 256 + 16 + 16
    lengths = [400, 1600, 1601, 3_000, 8_000, 16_000, 20_000, 31_000, 32_000, 40_000]
    counted = []
    for n in lengths:
        batch = processor(text=[f"Hi {SPEC.prompt('audio')} there"], audio=[np.full(n, 0.1, np.float32)], sampling_rate=16_000, return_tensors="pt")
        counted.append(int((batch["input_ids"] == processor.audio_token_id).sum()))
        assert tuple(batch["audio_input_features"].shape) == (1, 198, 80)  # every clip padded (or cut) to the 2 s window
        assert int(batch["audio_attention_mask"].sum()) == (min(n, 32_000) - 400) // 160 + 1
    assert counted == [SPEC.num_audio_tokens(n, 16_000, processor) for n in lengths] and len(set(counted)) >= 7
    assert SPEC.num_audio_tokens(8_000, 8_000, processor) == SPEC.num_audio_tokens(16_000, 16_000, processor) == 13  # resampled first


def test_clips_reach_the_extractor_at_its_rate(tiny):
    from vlmctl.data.modalities.audio import AudioUnit, feature_rate

    _, processor, _ = tiny
    assert feature_rate(processor) == 16_000
    inputs = AudioUnit().processor_inputs([normalize_audio(flac(1.0, 8_000)).data], processor)
    assert inputs["sampling_rate"] == 16_000 and len(inputs["audio"][0]) == 16_000  # resampled from the stored 8 kHz


def test_a_forward_backward_reaches_both_encoders(tiny):
    import copy

    import torch
    from PIL import Image

    _, processor, base = tiny
    model = copy.deepcopy(base).train()
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": SPEC.prompt("audio") + "What?"}]}],
                                         tokenize=False)
    batch = processor(text=[text], images=[Image.new("RGB", (100, 60))], audio=[np.full(16_000, 0.1, np.float32)], sampling_rate=16_000,
                      return_tensors="pt")
    assert "num_img_tokens" not in batch  # the processor drops it (`unused_input_names`)
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    grads = {".".join(n.split(".")[:3]) for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert torch.isfinite(loss) and {"model.embed_tokens_extend.image_embed", "model.embed_tokens_extend.audio_embed", "model.layers.0"} <= grads


def test_padded_batches_give_the_samples_losses_but_audio_projection_depends_on_the_batch(tiny):
    """Samples whose batch-mates do not change the model's audio projection give their own losses in a padded batch
    (images of different crop counts, clips of different lengths); an audio-only sample batched with an image is
    projected with the `_for_vision_speech` layers and its loss changes (transformers' per-batch choice, which
    padded batches keep; packed rows project per sample, see the packed-row tests)."""
    import torch

    from vlmctl.data.collate import Collator
    from vlmctl.train.objectives import loss_sum

    _, processor, model = tiny
    one, two = _clips()
    both = [_sample("both", [one], [_png(100, 60)], question="Same?", answer="Yes."),
            _sample("image", images=[_png(64, 64), _png(37, 90)], question="Color?", answer="Red."),
            _sample("both2", [two], [_png(150, 100, (20, 200, 20))])]
    collator = Collator(processor, SPEC, dummy_image=False)
    batch = collator(both)
    assert tuple(batch["image_pixel_values"].shape[:2]) == (4, 5) and tuple(batch["audio_input_features"].shape) == (2, 198, 80)
    with torch.no_grad():
        assert float(loss_sum(model, batch)) == pytest.approx(sum(float(loss_sum(model, collator([s]))) for s in both), rel=1e-5)
        audio_only = _sample("one", [one])
        alone = float(loss_sum(model, collator([audio_only])))
        pair = collator([audio_only, both[1]])
        image_alone = float(loss_sum(model, collator([both[1]])))
        assert abs(float(loss_sum(model, pair)) - image_alone - alone) > 1e-3


def _packed_samples() -> list[Sample]:
    one, two = _clips()
    return [_sample("image", images=[_png(100, 60)], question="Color?", answer="Red."),
            _sample("audio", [one], question="What is that sound?", answer="A tone."),
            _sample("both", [two], [_png(37, 90, (20, 200, 20))], question="Same?", answer="No.")]


def test_a_packed_row_gives_each_sample_the_logits_it_has_alone(tiny):
    """Image-only, audio-only and image + audio samples packed in one row (the trainer's packed collator, the hook
    training installs): each sample's logits equal its own forward through transformers' class, alone and unpadded;
    the audio-only sample's clip goes through `_for_speech` although the row holds images, the other through
    `_for_vision_speech`. Without the hook (the class's per-batch choice) the audio-only sample's logits differ."""
    import copy

    import torch

    from vlmctl.data.collate import Collator, PackedCollator, model_inputs
    from vlmctl.families.phi4_multimodal import per_sample_audio_projection
    from vlmctl.train.kernels import per_sample_sums, token_losses
    from vlmctl.train.objectives import loss_sum

    _, processor, base = tiny
    samples = _packed_samples()
    single = Collator(processor, SPEC, dummy_image=False)
    with torch.no_grad():
        alone = [base(**model_inputs(single([s])), use_cache=False).logits[0] for s in samples]
    row = PackedCollator(processor, SPEC, tokens_per_batch=4096, dummy_image=False)(samples)
    assert row["input_ids"].shape[0] == 1 and row["seq_lens"] == [int(a.shape[0]) for a in alone]
    assert row["image_pixel_values"].shape[0] == 2 and row["audio_input_features"].shape[0] == 2
    with torch.no_grad():
        per_batch = base(**model_inputs(row), use_cache=False).logits[0]
    model = copy.deepcopy(base)
    assert SPEC.position_hook(model, processor.image_token_id) is None
    assert not per_sample_audio_projection(model)  # installed by the hook
    with torch.no_grad():
        logits = model(**model_inputs(row), use_cache=False).logits[0]
    bounds = np.cumsum([0, *row["seq_lens"]])
    for sample, expect, start, end in zip(samples, alone, bounds[:-1], bounds[1:]):
        torch.testing.assert_close(logits[start:end], expect, rtol=0, atol=1e-5, msg=f"logits of {sample.id}")
    # the per-batch choice: the audio-only sample's clip through `_for_vision_speech`
    assert not torch.allclose(per_batch[bounds[1]:bounds[2]], alone[1], atol=1e-3)
    torch.testing.assert_close(per_batch[bounds[0]:bounds[1]], alone[0], rtol=0, atol=1e-5)
    # the training path: per-sample losses of the labelled positions, and both projection pairs reached
    with torch.no_grad():
        losses, index = token_losses(model, {**model_inputs(row), "labels": row["labels"]})
        sums, _ = per_sample_sums(losses, index, row["seq_lens"])
        ref = torch.stack([loss_sum(base, single([s])) for s in samples])
    torch.testing.assert_close(sums, ref, rtol=1e-5, atol=1e-5)
    model.train()
    loss_sum(model, row).backward()
    audio = model.model.embed_tokens_extend.audio_embed
    assert audio.up_proj_for_speech.weight.grad.abs().sum() > 0 and audio.up_proj_for_vision_speech.weight.grad.abs().sum() > 0


def test_a_packed_row_under_longrope_rotates_each_sample_by_its_own_length(tiny):
    """The tiny model's weights under LongRoPE whose original length lies between a text sample's and an image
    sample's: packed together, each sample's logits equal its own alone (the text sample by the short factors, the
    image sample by the long ones); without the hook the row's longest sample switches both to the long factors."""
    import copy

    import torch
    from transformers import Phi4MultimodalForCausalLM

    from vlmctl.data.collate import Collator, PackedCollator, model_inputs

    _, processor, base = tiny
    config = copy.deepcopy(base.config)
    config.original_max_position_embeddings = 200
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                              "short_factor": [1.0] * 6, "long_factor": [4.0] * 6, "original_max_position_embeddings": 200}
    vanilla = Phi4MultimodalForCausalLM(config).eval()
    vanilla.load_state_dict(base.state_dict())
    samples = [_sample("image", images=[_png(64, 64)]), _sample("text", question="Which one is longer?", answer="The second.")]
    with torch.no_grad():
        alone = [vanilla(**model_inputs(Collator(processor, SPEC, dummy_image=False)([s])), use_cache=False).logits[0] for s in samples]
    row = PackedCollator(processor, SPEC, tokens_per_batch=4096, dummy_image=False)(samples)
    assert row["seq_lens"][0] > 200 > row["seq_lens"][1]
    model = copy.deepcopy(vanilla)
    SPEC.position_hook(model, processor.image_token_id)
    with torch.no_grad():
        logits = model(**model_inputs(row), use_cache=False).logits[0]
        one_choice = vanilla(**model_inputs(row), use_cache=False).logits[0]
    n = row["seq_lens"][0]
    torch.testing.assert_close(logits[:n], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[n:], alone[1], rtol=0, atol=1e-5)
    assert not torch.allclose(one_choice[n:], alone[1], atol=1e-3)


def test_rows_of_one_projection_pair_and_other_inputs_keep_the_class_forward(tiny):
    """A packed row whose clips all take one pair (no image, or images with every clip), a padded batch and a text
    row go through transformers' own code under the hook: same logits as without it."""
    import copy

    import torch

    from vlmctl.data.collate import Collator, PackedCollator, model_inputs

    _, processor, base = tiny
    model = copy.deepcopy(base)
    SPEC.position_hook(model, processor.image_token_id)
    image, audio, both = _packed_samples()
    packed = PackedCollator(processor, SPEC, tokens_per_batch=4096, dummy_image=False)
    batches = [packed([audio]), packed([both]), packed([image, both]), Collator(processor, SPEC, dummy_image=False)([audio, both])]
    with torch.no_grad():
        for batch in batches:
            inputs = model_inputs(batch)
            torch.testing.assert_close(model(**inputs, use_cache=False).logits, base(**inputs, use_cache=False).logits, rtol=0, atol=0)


def _conv_backward_by_groups(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                            _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """FLOPs of a convolution's backward pass: the forward pass's once per gradient asked for (input, weight).
    torch's own formula (`flop_counter.conv_backward_flop`) ignores `groups` and charges a depthwise convolution's
    backward as a dense one's (a 3x3 depthwise Conv2d of 32 channels: forward 0.58 MFLOPs, backward 19 MFLOPs)."""
    from torch.utils.flop_counter import conv_flop_count

    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * int(bool(output_mask[0])) + forward * int(bool(output_mask[1]))


FULL, FINETUNE, ALIGN, LLM = {"vision", "projector", "llm"}, {"projector", "llm"}, {"projector"}, {"llm"}


@pytest.mark.parametrize("trainable, packed", [(FULL, False), (FINETUNE, False), (ALIGN, False), (LLM, False), (FULL, True), (ALIGN, True)],
                         ids=["full", "finetune", "align", "llm", "full-packed", "align-packed"])
def test_the_cost_model_matches_the_flop_counter(tiny, trainable, packed):
    """One sample with two clips and an image (padding crops included), in a padded batch or a packed row (through
    the hook's per-sample embedding), forward and backward on the labelled positions with eager attention: the cost
    model's terms equal what `FlopCounterMode` counts (with grouped convolutions' backward counted by their groups),
    up to the causal half of the language model's attention. (One sample per row: eager attention computes a packed
    row's whole T x T scores, which the cost model charges per sample.)"""
    import copy

    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from vlmctl.data.collate import Collator, PackedCollator, model_inputs
    from vlmctl.families import part_of_parameter
    from vlmctl.train.flops import CostModel

    _, processor, base = tiny
    model = copy.deepcopy(base)
    model.set_attn_implementation("eager")
    sample = _sample("s", _clips(), [_png(100, 60)], question="Describe them all.", answer="A tone and a picture. " * 5)
    if packed:
        SPEC.position_hook(model, processor.image_token_id)
        batch = PackedCollator(processor, SPEC, tokens_per_batch=4096, dummy_image=False)([sample])
        assert "packed_cu_seqlens" in batch and "attention_mask" not in batch
    else:
        batch = Collator(processor, SPEC, dummy_image=False)([sample])
    assert tuple(batch["image_pixel_values"].shape[:2]) == (1, 5) and batch["audio_input_features"].shape[0] == 2
    for name, p in model.named_parameters():
        p.requires_grad_(part_of_parameter(name, SPEC) in trainable)
    labels = batch["labels"]
    target = torch.nonzero(labels[0] != -100).squeeze(1)
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: _conv_backward_by_groups}) as counter:
        logits = model(**model_inputs(batch), logits_to_keep=target - 1, use_cache=False).logits[0]
        F.cross_entropy(logits.float(), labels[0, target], reduction="sum").backward()
    cost = CostModel.from_model(model, SPEC, trainable)
    terms = cost.batch_terms(batch)
    expected = sum(terms.values()) + terms["llm_attention"]  # causal=False, as counted
    measured = counter.get_total_flops()
    assert abs(expected - measured) / measured < 0.01, (sorted(trainable), expected, measured, terms)
    assert min(terms["audio"], terms["audio_attention"], terms["vision"], terms["vision_attention"], terms["projector"]) > 0


def test_the_build_loads_with_vlmctl_and_with_vanilla_transformers_with_the_same_logits(tmp_path):
    import torch
    from transformers import Phi4MultimodalForCausalLM

    from vlmctl.data.collate import Collator, model_inputs
    from vlmctl.models import build_model, load_model

    out = tmp_path / "model"
    result = build_model(ModelSection(preset=SPEC.tiny_preset, init="random", output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS)
    assert result.family == "phi4_multimodal" and (result.info["audio_window_seconds"], result.info["audio_tokens_per_window"]) == (2.0, 25)
    model, processor, family = load_model(out, dtype=torch.float32)
    assert family is SPEC and type(processor).__name__ == "Phi4MultimodalProcessor" and processor.audio_window == 32_000
    assert processor.image_processor.dynamic_hd == 4 and processor.image_processor.size["height"] == 64  # saved settings
    saved = json.loads((out / "processor_config.json").read_text())
    assert saved["image_processor"]["image_processor_type"] == "Phi4MultimodalImageProcessor"  # transformers' own class
    vanilla = Phi4MultimodalForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    one, two = _clips()
    samples = [_sample("both", [one], [_png(100, 60)]), _sample("image", images=[_png(64, 64)]), _sample("both2", [two], [_png(37, 90)])]
    inputs = model_inputs(Collator(processor, SPEC, dummy_image=False)(samples))
    with torch.no_grad():
        ours = model.eval()(**inputs).logits
        torch.testing.assert_close(vanilla(**inputs).logits, ours, rtol=0, atol=0)


def test_sample_costs_charge_each_encoder_its_own_media_as_the_batch_does(tiny):
    """Compute-balanced batching of a family whose encoders both count themselves: from the counts before collation
    (tokens, labelled tokens, per modality placeholder tokens and items) the estimated FLOPs of a sample equal its
    collated batch's within 2% once the batch's padding (crops up to `dynamic_hd`, clips up to the window: processor
    settings the counts do not see) is cut; without the per-modality counts the encoders are not charged."""
    from vlmctl.data.collate import Collator
    from vlmctl.train.flops import CostModel

    _, processor, model = tiny
    cost = CostModel.from_model(model, SPEC, {"vision", "projector", "llm"})
    assert cost.vision is None and cost.own_media == (("image",), ("audio",))
    ids = {"image": model.config.vision_config.image_token_id, "audio": model.config.audio_config.audio_token_id}
    samples = {"text": _sample("t", question="Describe a tone and a square " * 3), "audio": _sample("a", _clips()[1:]),
               "image": _sample("i", images=[_png(100, 60)]), "both": _sample("b", _clips()[:1], [_png(130, 64)])}
    for name, sample in samples.items():
        batch = dict(Collator(processor, SPEC, dummy_image=False)([sample]))
        if sample.images:  # the image's own crops and the global view: a grid of 2 x 1 crops
            assert batch["image_pixel_values"].shape[1] == 5
            batch["image_pixel_values"] = batch["image_pixel_values"][:, :3]
        if sample.audios:  # the clip's own frames
            batch["audio_input_features"] = batch["audio_input_features"][:, : int(batch["audio_attention_mask"].sum())]
        input_ids, labels = batch["input_ids"], batch["labels"]
        media = {m: {"tokens": [int((input_ids == i).sum())], "items": [len(sample.media.get(m, []))]} for m, i in ids.items()}
        counts = ([int(batch["attention_mask"].sum())], [sum(c["tokens"][0] for c in media.values())],
                  [int((labels[..., 1:] != -100).sum())], [len(sample.images) + len(sample.audios)])
        estimated = cost.sample_costs(*counts, media=media)[0]
        measured = cost.batch_flops(batch)
        assert abs(estimated - measured) / measured < 0.02, (name, estimated, measured)
        encoders = cost.batch_terms(batch)
        if sample.images or sample.audios:
            assert cost.sample_costs(*counts)[0] < estimated
            assert encoders["vision"] + encoders["audio"] > 0
