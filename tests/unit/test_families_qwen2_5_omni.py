"""The qwen2_5_omni family (Qwen2.5-Omni's thinker) on its tiny preset: module paths and FSDP units on the real
transformers class, the audio-token and image-token rules against the real `Qwen2_5OmniProcessor`, padded batches
of audio, image and text samples through the trainer's collator (one optimizer step), packed rows against the
samples one by one (TMRoPE positions of image samples), and the built model loaded by vanilla transformers with the
same logits."""

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
SPEC = get_family("qwen2_5_omni")


@pytest.fixture(scope="module")
def tiny():
    """(plan, processor, model) of the tiny preset: 2 s audio windows of 32 mel bins, 14 px patches, fp32."""
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
        _sample("both", [one], [_png(100, 60, (20, 200, 20)), _png(37, 90)], question="Same?", answer="Yes."),
    ]


def test_module_paths_and_layer_classes_on_the_real_class():
    from vlmctl.families import count_parameters, decoder_layer_classes, decoder_layers, vision_layer_classes, vision_layers
    from vlmctl.models.build import instantiate, plan_build

    model = instantiate(plan_build(ModelSection(preset=SPEC.tiny_preset, init="random")), device="meta")
    assert type(model).__name__ == SPEC.model_class
    assert type(model.get_submodule(SPEC.vision_tower)).__name__ == "Qwen2_5OmniAudioEncoder"
    assert type(model.get_submodule("model.visual")).__name__ == "Qwen2_5OmniVisionEncoder"
    assert [type(model.get_submodule(p)).__name__ for p in SPEC.projector] == ["Linear", "Qwen2_5OmniPatchMerger"]
    assert type(model.get_submodule(SPEC.language_model)).__name__ == "Qwen2_5OmniThinkerTextModel"
    assert model.get_submodule(SPEC.lm_head).out_features == model.config.text_config.vocab_size
    assert {c.__name__ for c in decoder_layer_classes(model, SPEC)} == {"Qwen2_5OmniDecoderLayer"} and len(decoder_layers(model, SPEC)) == 2
    # two encoders, each block of both an FSDP / checkpointing unit, audio first (the thinker's forward order)
    assert list(SPEC.encoders) == ["audio", "image"] and SPEC.encoders["image"].path == "model.visual"
    assert {c.__name__ for c in vision_layer_classes(model, SPEC)} == {"Qwen2_5OmniAudioEncoderLayer", "Qwen2_5OmniVisionBlock"}
    layers = vision_layers(model, SPEC)
    assert [type(m).__name__ for m in layers] == ["Qwen2_5OmniAudioEncoderLayer"] * 2 + ["Qwen2_5OmniVisionBlock"] * len(model.model.visual.blocks)
    counts = count_parameters(model, SPEC)
    assert min(counts["vision"], counts["projector"], counts["llm"]) > 0
    # the image encoder is the `vision` part (frozen by align / finetune, trained by full), its merger the projector
    from vlmctl.families import part_of_parameter

    parts = {part_of_parameter(n, SPEC) for n, _ in model.named_parameters() if n.startswith("model.visual.")}
    assert parts == {"vision", "projector"}
    assert counts["vision"] == sum(p.numel() for n, p in model.named_parameters()
                                   if n.startswith(("model.audio_tower.", "model.visual.")) and not n.startswith(SPEC.projector))
    assert set(SPEC.modalities) == {"image", "audio"} and SPEC.mrope and SPEC.supports_packing


def test_tokens_ids_and_a_forward_backward_through_both_encoders(tiny):
    import torch
    from PIL import Image

    _, processor, model = tiny
    assert type(processor).__name__ == "Qwen2_5OmniProcessor" and processor.video_processor is None
    tok = processor.tokenizer
    cfg = model.config
    assert cfg.image_token_id == processor.image_token_id == tok.convert_tokens_to_ids("<|IMAGE|>")
    assert cfg.audio_token_id == processor.audio_token_id == tok.convert_tokens_to_ids("<|AUDIO|>")
    assert (cfg.vision_start_token_id, cfg.audio_start_token_id) == tuple(tok.convert_tokens_to_ids(["<|vision_bos|>", "<|audio_bos|>"]))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": SPEC.prompt("audio") + "What?"}]}],
                                         tokenize=False)
    assert "<|vision_bos|><|IMAGE|><|vision_eos|><|audio_bos|><|AUDIO|><|audio_eos|>What?" in text
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
    lengths = [1, 160, 161, 320, 481, 961, 1600, 4000, 15_999, 16_000, 16_161, 31_840, 32_000, 40_000]
    assert _audio_count(processor, [np.full(n, 0.1, np.float32) for n in lengths]) == [
        SPEC.num_audio_tokens(n, 16_000, processor) for n in lengths]
    assert SPEC.num_audio_tokens(16_000, 16_000, processor) == 25 and SPEC.num_audio_tokens(40_000, 16_000, processor) == 50
    assert SPEC.num_audio_tokens(8_000, 8_000, processor) == 25  # counted after resampling to the extractor's rate
    assert SPEC.num_audio_tokens(10**6, 16_000, model.config) == 50  # from the config: the encoder's window
    assert SPEC.num_audio_tokens(16_000, 16_000, {"feature_extractor": processor.feature_extractor.to_dict()}) == 25
    # the published extractor: 128 mel bins, 30 s window
    published = SPEC.make_processor(processor.tokenizer, processor.image_processor, processor.chat_template,
                                    feature_extractor=WhisperFeatureExtractor(feature_size=128))
    lengths = [16_000, 160_000, 479_999, 480_000, 640_000]
    assert _audio_count(published, [np.full(n, 0.1, np.float32) for n in lengths]) == [
        SPEC.num_audio_tokens(n, 16_000, published) for n in lengths] == [25, 250, 750, 750, 750]
    # images: Qwen's grid rule, from the processor and from the config (the tiny preset's pixel bounds are the processor's)
    for w, h in [(64, 64), (100, 60), (37, 211), (500, 300), (28, 28)]:
        batch = processor(text=[f"a {SPEC.image_prompt} b"], images=[Image.new("RGB", (w, h))], return_tensors="pt")
        n = int((batch["input_ids"] == processor.image_token_id).sum())
        assert n == SPEC.num_visual_tokens(w, h, processor) == SPEC.num_visual_tokens(w, h, processor.image_processor), (w, h)
    assert SPEC.num_visual_tokens(448, 448, model.config) == 256  # the published bounds: 448 px is 32 x 32 patches


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


def test_one_training_step_on_padded_batches_of_audio_images_and_text(tiny):
    """The trainer's collator and loss: a padded batch gives the sum of the samples' own losses, a rank without
    audio or images runs both encoders on dummy rows that add no loss, and one optimizer step changes every part."""
    import copy

    import torch

    from vlmctl.data.collate import Collator, model_inputs
    from vlmctl.train.objectives import loss_sum

    _, processor, base = tiny
    model, samples = copy.deepcopy(base), _samples()
    collator = Collator(processor, SPEC)
    batch = collator(samples)
    assert tuple(batch["input_features"].shape) == (4, 32, 200) and batch["feature_attention_mask"].sum(-1).tolist() == [100, 50, 190, 100]
    assert batch["num_dummy_audios"] == 0 and batch["num_dummy_images"] == 0 and tuple(batch["image_grid_thw"].shape) == (3, 3)
    assert set(model_inputs(batch)) == {"input_ids", "attention_mask", "input_features", "feature_attention_mask", "pixel_values", "image_grid_thw"}
    with torch.no_grad():
        together = float(loss_sum(model.eval(), batch))
        apart = sum(float(loss_sum(model, collator([s]))) for s in samples)
    assert together == pytest.approx(apart, rel=1e-4)
    text_only = collator([samples[3]])
    assert text_only["num_dummy_audios"] == 1 and text_only["num_dummy_images"] == 1 and text_only["input_ids"].shape[0] == 3
    without = Collator(processor, SPEC, dummy_image=False)([samples[3]])
    with torch.no_grad():
        assert float(loss_sum(model, text_only)) == pytest.approx(float(loss_sum(model, without)), rel=1e-5)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    loss = loss_sum(model, batch) / batch["num_label_tokens"]
    loss.backward()
    optimizer.step()
    changed = {n.split(".")[1] for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert torch.isfinite(loss) and {"audio_tower", "visual", "language_model"} <= changed


def test_packed_rows_give_the_per_sample_losses_and_gradients(tiny):
    """A packed row of audio, image, text-only and audio + two-image samples: each sample's summed loss and every
    gradient equal the samples' own (padded, the class's own forward and positions); the LM head sees the labelled
    positions only, and image samples get their TMRoPE positions from the hook."""
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
    assert row["position_ids"].dtype == torch.long  # whole positions: the ids' dtype, as the class computes them
    assert not torch.equal(row["position_ids"][0], row["position_ids"][1])  # images: 3-D positions differ from text's
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    losses, index = token_losses(model, {**model_inputs(row), "labels": row["labels"]})
    handle.remove()
    sums, _ = per_sample_sums(losses, index, row["seq_lens"])
    # the head saw the hidden states of the labelled positions only (and computed their loss in chunks)
    assert seen == [(1, row["num_label_tokens"], model.config.text_config.hidden_size)]
    torch.testing.assert_close(sums.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    loss_sum(model, row).backward()
    for name, p in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    with torch.no_grad():  # without logits_to_keep the prepared forward is the class's
        inputs = model_inputs(single([samples[1]]))
        torch.testing.assert_close(model(**inputs).logits, base(**inputs).logits)


def test_flops_of_both_encoders_match_the_flop_counter(tiny):
    """The cost model of a padded batch with a clip and two images (both encoders, each counted by its own rule:
    the audio tower on the clip's real frames in chunks, the vision encoder's windows, each encoder's projector on
    its own rows) against torch's FLOP counter over forward + backward, logits at the labelled positions only as
    the trainer computes them, for every stage; the causal half of the language model's attention put back as in
    tests/unit/test_flops.py."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from vlmctl.data.collate import Collator, model_inputs
    from vlmctl.families import part_of_parameter
    from vlmctl.families.qwen2_5_omni import keep_logits_forward
    from vlmctl.train.flops import CostModel

    _, processor, base = tiny
    model = copy.deepcopy(base)
    model.set_attn_implementation("eager")
    keep_logits_forward(model)
    batch = Collator(processor, SPEC, dummy_image=False)([_samples()[4]])
    inputs, labels = model_inputs(batch), batch["labels"]
    target = torch.nonzero(labels[0] != -100).squeeze(1)
    for trainable in ({"vision", "projector", "llm"}, {"projector", "llm"}, {"projector"}):
        for name, p in model.named_parameters():
            p.requires_grad_(part_of_parameter(name, SPEC) in trainable)
        with FlopCounterMode(display=False) as counter:
            logits = model(**inputs, logits_to_keep=target - 1, use_cache=False).logits[0]
            F.cross_entropy(logits.float(), labels[0, target], reduction="sum").backward()
        model.zero_grad(set_to_none=True)
        cost = CostModel.from_model(model, SPEC, trainable)
        terms = cost.batch_terms(batch)
        assert cost.vision is not None and cost.audio is not None and cost.audio.chunk == 2 * model.config.audio_config.n_window
        assert min(terms["vision"], terms["vision_attention"], terms["audio"], terms["audio_attention"], terms["projector"]) > 0
        expected = sum(terms.values()) + terms["llm_attention"]  # causal=False, as counted
        measured = counter.get_total_flops()
        assert abs(expected - measured) / measured < 0.02, (sorted(trainable), expected, measured, terms)


def test_the_build_loads_with_vlmctl_and_with_vanilla_transformers_with_the_same_logits(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5OmniThinkerForConditionalGeneration

    from vlmctl.data.collate import Collator, model_inputs
    from vlmctl.models import build_model, load_model

    out = tmp_path / "model"
    result = build_model(ModelSection(preset=SPEC.tiny_preset, init="random", output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS)
    assert result.family == "qwen2_5_omni" and (result.info["audio_window_seconds"], result.info["audio_tokens_per_window"]) == (2.0, 50)
    model, processor, family = load_model(out, dtype=torch.float32)
    assert family is SPEC and type(processor).__name__ == "Qwen2_5OmniProcessor" and processor.feature_extractor.chunk_length == 2
    assert processor.image_processor.size["longest_edge"] == 200704  # the saved image-processor settings
    vanilla = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    auto = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(auto) is type(vanilla)
    inputs = model_inputs(Collator(processor, SPEC, dummy_image=False)(_samples()))
    with torch.no_grad():
        ours = model.eval()(**inputs).logits
        torch.testing.assert_close(vanilla(**inputs).logits, ours, rtol=0, atol=0)
        torch.testing.assert_close(auto(**inputs).logits, ours, rtol=0, atol=0)
