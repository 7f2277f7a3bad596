"""The qwen2_audio family on its tiny preset: module paths and FSDP units on the real transformers classes, the
audio-token rule against the real `Qwen2AudioProcessor` (tiny and published feature-extractor settings), token
counts read from the saved files against the collated length, padded batches with the audio tensors and the
dummy clip of ranks without audio, and packed rows (the per-sample losses and gradients of the samples one by one,
logits of the labelled positions only, the audio tower's attention under the varlen kernel)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from audio_data import flac, tone, wav  # noqa: E402

from vlmctl.config.model import ModelSection  # noqa: E402
from vlmctl.data.modalities.audio import normalize_audio  # noqa: E402
from vlmctl.data.sample import Sample  # noqa: E402
from vlmctl.families import get_family  # noqa: E402

TEXTS = ["What is that sound? A tone.", "Transcribe the clip.", "la la la", "Which one is longer? The second."] * 10
SPEC = get_family("qwen2_audio")


@pytest.fixture(scope="module")
def tiny():
    """(plan, processor, model) of the tiny preset: 2 s windows of 32 mel bins, fp32."""
    from vlmctl.models.build import make_model, make_processor, plan_build

    plan = plan_build(ModelSection(preset=SPEC.tiny_preset, init="random", dtype="fp32"))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    return plan, processor, make_model(plan, processor)


def _audio_count(processor, waves, rate) -> list[int]:
    """`<|AUDIO|>` tokens per clip that the real processor writes, one clip per prompt."""
    out = []
    for wave in waves:
        batch = processor(text=[f"Hi {SPEC.prompt('audio')} there"], audio=[wave], sampling_rate=rate, return_tensors="pt")
        out.append(int((batch["input_ids"] == processor.audio_token_id).sum()))
    return out


def test_paths_layers_and_a_forward_backward_through_the_audio_tower(tiny):
    import torch

    from vlmctl.families import count_parameters, decoder_layer_classes, decoder_layers, vision_layer_classes, vision_layers

    plan, processor, model = tiny
    assert plan.family is SPEC and type(model).__name__ == "Qwen2AudioForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2AudioProcessor" and type(processor.feature_extractor).__name__ == "WhisperFeatureExtractor"
    assert type(model.get_submodule(SPEC.vision_tower)).__name__ == "Qwen2AudioEncoder"
    counts = count_parameters(model, SPEC)
    assert min(counts["vision"], counts["projector"], counts["llm"]) > 0
    # the FSDP2 / activation-checkpointing units: 2 decoder layers, 2 encoder layers
    assert {c.__name__ for c in decoder_layer_classes(model, SPEC)} == {"Qwen2DecoderLayer"} and len(decoder_layers(model, SPEC)) == 2
    assert {c.__name__ for c in vision_layer_classes(model, SPEC)} == {"Qwen2AudioEncoderLayer"} and len(vision_layers(model, SPEC)) == 2
    assert model.config.audio_token_id == processor.audio_token_id == processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    # the chat template writes the audio prompt for an audio part, as vanilla transformers users pass it
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What?"}]}], tokenize=False)
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>What?" in text
    batch = processor(text=[text], audio=[tone(1.0)], sampling_rate=16_000, return_tensors="pt")
    assert tuple(batch["input_features"].shape) == (1, 32, 200) and int(batch["feature_attention_mask"].sum()) == 100
    model.train()
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if n.startswith(SPEC.vision_tower + ".") and p.grad is not None]
    assert torch.isfinite(loss) and grads and any(g.abs().sum() > 0 for g in grads)  # the audio reached the loss
    model.zero_grad(set_to_none=True)
    model.eval()


def test_the_audio_token_rule_matches_the_real_processor(tiny):
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    _, processor, model = tiny
    # the tiny preset's 2 s window: clips of every length around the frame and pooling boundaries, and longer ones
    lengths = [1, 160, 161, 320, 481, 961, 1600, 4000, 15_999, 16_000, 16_161, 31_840, 32_000, 40_000]
    assert _audio_count(processor, [np.full(n, 0.1, np.float32) for n in lengths], 16_000) == [
        SPEC.num_audio_tokens(n, 16_000, processor) for n in lengths]
    assert SPEC.num_audio_tokens(16_000, 16_000, processor) == 25 and SPEC.num_audio_tokens(40_000, 16_000, processor) == 50
    # other stored rates: counted after the resampling the collator does (8 kHz and 44.1 kHz clips)
    for rate in (8_000, 44_100):
        stored = normalize_audio(wav(0.77, rate), _settings(rate)).data
        wave = _unit_waves(stored, processor)
        assert _audio_count(processor, wave, 16_000) == [SPEC.num_audio_tokens(int(0.77 * rate), rate, processor)]
    # from the model config (no extractor): Whisper's 16 kHz, hop 160, the encoder's window
    assert SPEC.num_audio_tokens(16_000, 16_000, model.config) == 25 and SPEC.num_audio_tokens(10**6, 16_000, model.config) == 50
    # from the settings a saved processor_config.json holds
    assert SPEC.num_audio_tokens(16_000, 16_000, {"feature_extractor": processor.feature_extractor.to_dict()}) == 25
    # the published Qwen2-Audio extractor: 128 mel bins, 30 s window
    published = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=processor.tokenizer,
                                    chat_template=processor.chat_template)
    lengths = [16_000, 160_000, 479_999, 480_000, 640_000]
    assert _audio_count(published, [np.full(n, 0.1, np.float32) for n in lengths], 16_000) == [
        SPEC.num_audio_tokens(n, 16_000, published) for n in lengths] == [25, 250, 750, 750, 750]


def _settings(rate: int):
    from vlmctl.config.data import DataAudio

    return DataAudio(sampling_rate=rate)  # stored at the clip's own rate: the collator resamples it


def _unit_waves(stored: bytes, processor) -> list:
    from vlmctl.data.modalities import get_unit

    inputs = get_unit("audio").processor_inputs([stored], processor)
    assert inputs["sampling_rate"] == 16_000
    return inputs["audio"]


def _sample(sid: str, clips: list[bytes], question: str = "What is it?", answer: str = "A tone.") -> Sample:
    user = [{"type": "audio", "index": i} for i in range(len(clips))] + [{"type": "text", "text": question}]
    return Sample(sid, [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}], audios=clips)


def _samples() -> list[Sample]:
    one, two, three = (normalize_audio(d).data for d in (wav(1.0), wav(0.5, 44_100, channels=2), flac(1.9, 8_000)))
    return [
        _sample("one", [one]),
        _sample("two", [two, three], "Which one is longer?", "The second."),
        Sample("text", [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                        {"role": "user", "content": [{"type": "text", "text": "Hello?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]}]),
        _sample("again", [one, one], "Same twice?", "Yes."),
    ]


def test_counts_read_from_the_files_equal_the_loaded_processor_and_the_collated_length(tiny, tmp_path):
    from vlmctl.data.collate import Collator
    from vlmctl.data.tokens import TokenCounter

    _, processor, _ = tiny
    processor.save_pretrained(str(tmp_path))
    (tmp_path / "vlmctl_model.json").write_text(json.dumps({"family": SPEC.name}))
    light, full = TokenCounter.from_files(tmp_path), TokenCounter(processor, SPEC.name, tmp_path)
    assert light is not None and light.image_token_id is None
    collator = Collator(processor, SPEC, max_length=100_000, dummy_image=False)
    for sample in _samples():
        assert light.render(sample) == full.render(sample)
        n = light.count(sample, [])
        assert n == full.count(sample, []) == collator([sample])["input_ids"].shape[1], sample.id
    counted = _samples()[1]
    light.count(counted, [])
    assert counted.media_tokens["audio"] == [12, 47]  # 0.5 s and 1.9 s at 16 kHz: 25 tokens per second


def test_padded_batches_carry_the_audio_tensors_and_a_dummy_clip_for_text_only_ranks(tiny):
    import torch

    from vlmctl.data.collate import Collator, model_inputs
    from vlmctl.train.objectives import loss_sum

    _, processor, model = tiny
    samples = _samples()
    collator = Collator(processor, SPEC)
    batch = collator(samples)
    assert tuple(batch["input_features"].shape) == (5, 32, 200) and tuple(batch["feature_attention_mask"].shape) == (5, 200)
    assert batch["num_dummy_audios"] == 0 and batch["num_dummy_images"] == 0 and batch["input_ids"].shape[0] == 4
    # the clips are in row order: row 1's two clips (0.5 s and 1.9 s) are the 2nd and 3rd
    assert batch["feature_attention_mask"].sum(-1).tolist() == [100, 50, 190, 100, 100]
    assert set(model_inputs(batch)) == {"input_ids", "attention_mask", "input_features", "feature_attention_mask"}
    with torch.no_grad():
        together = float(loss_sum(model, batch))
        apart = sum(float(loss_sum(model, collator([s]))) for s in samples)
    assert together == pytest.approx(apart, rel=1e-4)  # padding changes nothing: the sum of per-sample losses
    text_only = collator([samples[2]])  # a rank without audio runs the audio tower on a silent clip with no labels
    assert text_only["num_dummy_audios"] == 1 and text_only["input_ids"].shape[0] == 2 and text_only["input_features"].shape[0] == 1
    without = Collator(processor, SPEC, dummy_image=False)([samples[2]])
    assert without["num_dummy_audios"] == 0 and "input_features" not in without
    with torch.no_grad():  # the dummy row adds no loss
        assert float(loss_sum(model, text_only)) == pytest.approx(float(loss_sum(model, without)), rel=1e-5)


def _packed_model(model):
    """A copy of the tiny model prepared for packed rows as training prepares it (the spec's `position_hook`)."""
    import copy

    packed = copy.deepcopy(model).eval()
    assert SPEC.supports_packing and SPEC.position_hook(packed, None) is None
    return packed


def test_packed_rows_give_the_per_sample_losses_and_gradients(tiny):
    """A packed row of clips and text (one clip, two clips, text only, the same clip twice) through the trainer's
    collator and loss: each sample's summed loss and every gradient equal the samples' own, one padded batch each
    through the class's own forward (full logits); the LM head sees the labelled positions only."""
    import torch

    from vlmctl.data.collate import Collator, PackedCollator, model_inputs
    from vlmctl.train.kernels import per_sample_sums, token_losses
    from vlmctl.train.objectives import loss_sum

    _, processor, base = tiny
    model, samples = _packed_model(base), _samples()
    single = Collator(processor, SPEC, dummy_image=False)
    ref = torch.stack([loss_sum(model, single([s])) for s in samples])
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert any(n.startswith(SPEC.vision_tower + ".") for n in ref_grads)  # the audio reached the loss

    row = PackedCollator(processor, SPEC, tokens_per_batch=4096)(samples)
    assert row["input_ids"].shape[0] == 1 and row["num_dummy_audios"] == 0 and tuple(row["input_features"].shape[:2]) == (5, 32)
    assert "attention_mask" not in row and row["position_ids"][0, row["seq_lens"][0]] == 0  # positions restart per sample
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    losses, index = token_losses(model, {**model_inputs(row), "labels": row["labels"]})
    hook.remove()
    sums, counts = per_sample_sums(losses, index, row["seq_lens"])
    # the head saw the hidden states of the labelled positions only (and computed their loss in chunks)
    assert seen == [(1, row["num_label_tokens"], model.config.text_config.hidden_size)]
    assert counts.tolist() == [int((single([s])["labels"][0, 1:] != -100).sum()) for s in samples]
    torch.testing.assert_close(sums.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    loss_sum(model, row).backward()  # the trainer's loss of a packed row: the same token losses
    for name, p in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
        else:
            assert p.grad is None or not p.grad.any(), name


def test_the_class_forward_returns_every_logit_and_the_packed_forward_is_it_otherwise(tiny):
    """Why the family prepares packed models: the class's forward takes no `logits_to_keep` (every position's
    logits come back: the LM head runs over the whole row, which the chunked loss head cuts to the labelled positions
    afterwards). The prepared forward is the class's own without it, refuses labels with it, and is installed once."""
    import torch

    from vlmctl.data.collate import PackedCollator, model_inputs
    from vlmctl.families.qwen2_audio import keep_logits_forward
    from vlmctl.train.kernels import token_losses

    _, processor, base = tiny
    row = PackedCollator(processor, SPEC, tokens_per_batch=4096)(_samples()[:2])
    inputs = model_inputs(row)
    keep = torch.tensor([3, 7])
    with torch.no_grad():
        assert base(**inputs, logits_to_keep=keep).logits.shape[1] == row["input_ids"].shape[1]
        # the chunked loss head takes the labelled positions itself from the whole row the class's forward hands it
        unprepared, _ = token_losses(base, {**inputs, "labels": row["labels"]})
        model = _packed_model(base)
        prepared, _ = token_losses(model, {**inputs, "labels": row["labels"]})
        torch.testing.assert_close(unprepared, prepared)
        assert not keep_logits_forward(model)  # installed by the hook already
        full = model(**inputs).logits
        torch.testing.assert_close(full, base(**inputs).logits)
        torch.testing.assert_close(model(**inputs, logits_to_keep=keep).logits, full[:, keep])
        torch.testing.assert_close(model(**inputs, logits_to_keep=1).logits, full[:, -1:])
        with pytest.raises(ValueError, match="no loss with logits_to_keep"):
            model(**inputs, labels=row["labels"], logits_to_keep=keep)


def test_the_audio_tower_keeps_a_masked_attention_under_the_varlen_kernel(tiny):
    """`set_attention` gives a model without a vision config one implementation for all parts; the varlen kernel
    takes one row and no padding mask, so the audio tower (a batch of padded clips) stays on sdpa."""
    from vlmctl.train.kernels import VARLEN_NAME, register_varlen_attention, set_attention

    _, _, base = tiny
    model = _packed_model(base)
    register_varlen_attention()
    set_attention(model, VARLEN_NAME)
    assert model.config.audio_config._attn_implementation == VARLEN_NAME  # what the tower would run
    SPEC.position_hook(model, None)
    assert model.config.audio_config._attn_implementation == "sdpa"
    assert model.config.get_text_config()._attn_implementation == VARLEN_NAME


def test_modalities_a_family_does_not_take_are_refused_with_the_fix(tiny):
    from vlmctl.data.collate import encode_sample
    from vlmctl.errors import DataError
    from vlmctl.models.build import make_processor, plan_build

    _, processor, _ = tiny
    from video_data import png_bytes

    image = Sample("i", [{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "Color?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "Green."}]}], images=[png_bytes(40)])
    with pytest.raises(DataError, match="takes no image input") as err:
        encode_sample(image, processor, SPEC)
    assert "drop the image samples" in err.value.hint
    plan = plan_build(ModelSection(preset="tiny", init="random"))  # LLaVA: images only
    llava = make_processor(plan, tokenizer_texts=TEXTS)
    with pytest.raises(DataError, match="takes no audio input") as err:
        encode_sample(_samples()[0], llava, plan.family)
    assert "drop the audio samples" in err.value.hint and "model build --list" in err.value.hint


def test_the_build_records_the_audio_window(tmp_path):
    from vlmctl.models import build_model, load_model

    result = build_model(ModelSection(preset=SPEC.tiny_preset, init="random", output_dir=tmp_path / "model"), tokenizer_texts=TEXTS)
    assert result.family == "qwen2_audio" and result.visual_tokens_per_image is None and result.image_size is None
    assert (result.info["audio_window_seconds"], result.info["audio_tokens_per_window"]) == (2.0, 50)
    model, processor, family = load_model(tmp_path / "model")
    assert family is SPEC and type(processor).__name__ == "Qwen2AudioProcessor" and processor.feature_extractor.chunk_length == 2
