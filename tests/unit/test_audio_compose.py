"""Compose mode for audio (`model.audio` + `model.llm`): a tiny Whisper checkpoint and a tiny causal LM, both written
in the test, become `Qwen2AudioForConditionalGeneration` with the Whisper encoder's and the LLM's weights as they
were, loadable by vanilla transformers; the random-init variant reads configs only; bad combinations are refused
before any weights load."""

from __future__ import annotations

import numpy as np
import pytest

from vlmctl.config.model import ModelSection
from vlmctl.errors import ConfigError, ModelError

TEXTS = ["What is that sound? A tone.", "Transcribe it.", "la la la", "hello there"] * 10


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Folders of a tiny Whisper (encoder 2 x 32, 32 mel bins, a 2 s window, with its feature extractor) and a tiny
    Qwen2 LLM with a trained tokenizer and tied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from vlmctl.models.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("audio_compose")
    torch.manual_seed(0)
    whisper = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, decoder_layers=1,
                            decoder_attention_heads=2, decoder_ffn_dim=64, num_mel_bins=32, max_source_positions=100, vocab_size=100,
                            max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    WhisperForConditionalGeneration(whisper).save_pretrained(root / "whisper")
    WhisperFeatureExtractor(feature_size=32, chunk_length=2).save_pretrained(root / "whisper")
    tok = train_tokenizer(TEXTS, special_tokens=("<|im_start|>", "<|im_end|>", "<pad>"), image_token=None, image_prompt="")
    llm = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(llm).save_pretrained(root / "llm")
    tok.save_pretrained(root / "llm")
    return root


def test_whisper_encoder_and_an_llm_compose_into_qwen2_audio_that_vanilla_transformers_loads(parts, tmp_path):
    import torch
    from transformers import AutoModelForMultimodalLM, AutoProcessor, Qwen2ForCausalLM, WhisperForConditionalGeneration

    from vlmctl.models import build_model

    result = build_model(ModelSection(audio=str(parts / "whisper"), llm=str(parts / "llm"), output_dir=tmp_path / "out", dtype="fp32"))
    assert (result.family, result.mode) == ("qwen2_audio", "compose") and result.info["built_from"]["audio"] == str(parts / "whisper")
    assert (result.info["audio_window_seconds"], result.info["audio_tokens_per_window"]) == (2.0, 50)
    model = AutoModelForMultimodalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(str(tmp_path / "out"))
    assert type(model).__name__ == "Qwen2AudioForConditionalGeneration" and type(processor).__name__ == "Qwen2AudioProcessor"
    assert type(processor.feature_extractor).__name__ == "WhisperFeatureExtractor" and processor.feature_extractor.chunk_length == 2
    # the encoder's and the LLM's weights as they were (the LM head untied: the Qwen2-Audio class ties none)
    whisper = WhisperForConditionalGeneration.from_pretrained(str(parts / "whisper")).model.encoder.state_dict()
    tower = model.model.audio_tower.state_dict()
    assert set(tower) == set(whisper) and all(torch.equal(tower[k], whisper[k]) for k in whisper)
    llm = Qwen2ForCausalLM.from_pretrained(str(parts / "llm"))
    n = llm.config.vocab_size
    assert torch.equal(model.model.language_model.layers[1].mlp.up_proj.weight, llm.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(model.lm_head.weight[:n], llm.lm_head.weight) and model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    # the audio tokens were added to the LLM's tokenizer; one clip goes through
    tok = processor.tokenizer
    assert all(len(tok.encode(t, add_special_tokens=False)) == 1 for t in ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"))
    assert model.config.audio_token_id == tok.convert_tokens_to_ids("<|AUDIO|>") >= n
    inputs = processor(text=["<|audio_bos|><|AUDIO|><|audio_eos|>What is it?"], audio=[np.zeros(16_000, np.float32)], sampling_rate=16_000,
                       return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.audio_token_id).sum()) == 25
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


def test_random_init_reads_configs_only_and_counts_before_the_build(parts, tmp_path):
    from vlmctl.data.counting import model_configured
    from vlmctl.models import build_model
    from vlmctl.models.build import configured_processor

    section = ModelSection(audio=str(parts / "whisper"), llm="tiny", init="random", output_dir=tmp_path / "rnd", dtype="fp32")
    assert model_configured(section)
    conf = configured_processor(section)
    assert conf.family == "qwen2_audio" and conf.needs_training and "model.audio" in conf.description
    result = build_model(section, tokenizer_texts=TEXTS)
    assert result.family == "qwen2_audio" and result.info["built_from"]["tokenizer"] == "trained"
    # with a tokenizer the processor is known before the build
    conf = configured_processor(ModelSection(audio=str(parts / "whisper"), llm=str(parts / "llm"), init="random"))
    assert type(conf.processor).__name__ == "Qwen2AudioProcessor" and conf.processor.feature_extractor.nb_max_frames == 200


def test_bad_combinations_are_refused_before_any_weights_load(parts):
    from vlmctl.models.build import plan_build

    with pytest.raises(ValueError, match="model.vision .* or model.audio"):
        ModelSection(audio=str(parts / "whisper"), vision="siglip", llm="tiny")
    with pytest.raises(ValueError, match="projector must be linear"):
        ModelSection(audio=str(parts / "whisper"), llm="tiny", projector="mlp2x_gelu")
    with pytest.raises(ConfigError, match="model.llm not set"):
        plan_build(ModelSection(audio=str(parts / "whisper"), init="random"))
    with pytest.raises(ModelError, match="not a Whisper-family audio encoder"):
        plan_build(ModelSection(audio=str(parts / "llm"), llm=str(parts / "llm")))
