"""Qwen2-Audio: a Whisper-style audio encoder + a linear projector + a Qwen2 LLM in
`Qwen2AudioForConditionalGeneration` (Chu et al. 2024, https://arxiv.org/abs/2407.10759). Audio and text only: the
family takes no images.

Module paths (transformers 5.23, checked by tests/unit/test_audio_qwen2.py):

| part                                  | path                        |
|---------------------------------------|-----------------------------|
| audio tower (the `vision` part)       | model.audio_tower           |
| projector                             | model.multi_modal_projector |
| language model                        | model.language_model        |
| lm head                               | lm_head                     |

The audio tower is what `train.freeze` and the parameter summaries call the `vision` part (the encoder in front of
the projector); its `Qwen2AudioEncoderLayer`s and the LLM's `Qwen2DecoderLayer`s are the FSDP2 and
activation-checkpointing units.

Audio-token rule (transformers 5.23, src/transformers/models/qwen2_audio/processing_qwen2_audio.py,
`Qwen2AudioProcessor._process_audio`, over src/transformers/models/whisper/feature_extraction_whisper.py): the
feature extractor pads or cuts every clip to `chunk_length` seconds (`n_samples` = chunk_length x sampling_rate) and
its frame mask keeps one frame per `hop_length` samples of audio, so a clip of `s` samples (at the extractor's rate)
has L = ceil(min(s, n_samples) / hop_length) frames, and becomes (((L - 1) // 2 + 1) - 2) // 2 + 1 `<|AUDIO|>`
tokens (the encoder's stride-2 convolution, then its stride-2 average pooling): 25 per second at 16 kHz with a hop of
160, 750 for a 30 s window. Clips longer than the window are cut by the feature extractor; `data.audio.max_seconds`
should stay within it.

Compose mode (`model.audio` + `model.llm`): the encoder half of a Whisper checkpoint (Radford et al. 2022,
https://arxiv.org/abs/2212.04356) becomes the audio tower (`Qwen2AudioEncoder` is transformers' `WhisperEncoder`
with an average pooling after it: the same parameter names, so the weights load as they are), any causal LM the
language model (transformers' `Qwen2AudioModel` builds it with `AutoModel.from_config(text_config)`), and a fresh
linear projector joins them: exactly `Qwen2AudioForConditionalGeneration`, which vanilla transformers loads
(`AutoModelForMultimodalLM`, `AutoProcessor`). The processor is `Qwen2AudioProcessor` over the checkpoint's
`WhisperFeatureExtractor` and the LLM's tokenizer with the three audio tokens added.

Packing (`supports_packing=True`): a packed row [1, T] of several samples, with per-sample position ids and
`packed_cu_seqlens` and no attention mask (`vlmctl.data.collate.PackedCollator`), goes through
`Qwen2AudioForConditionalGeneration` (transformers 5.23) as it is except for two things, both set up by
`prepare_packed` (called through the spec's `position_hook`, which training calls with the model whenever
`train.packing` is on):

- the logits: vlmctl's packed loss asks for the labelled positions only (`logits_to_keep` as an index tensor, see
  `vlmctl.train.kernels.token_losses`), which the class's forward does not take: it would pass the keyword on to
  the language model, which ignores it, and return the logits of every position. `keep_logits_forward` gives the
  instance a forward that runs the class's inner model (`model.model`: audio tower, projector, the audio features
  scattered over the `<|AUDIO|>` tokens, language model) and applies the LM head to the kept hidden states only,
  as transformers' other `*ForConditionalGeneration` classes do (`slice_logits_to_keep`); without
  `logits_to_keep` it is the class's own forward.
- the audio tower's attention: `set_attention` gives a model without a `vision_config` one implementation for all
  its parts, so under the varlen kernel (`vlmctl_varlen`, CUDA) the audio tower would get it too, which takes one
  row and no padding mask, while the tower encodes a batch of clips [N, mel bins, frames] whose padded frames are
  masked. `audio_attention` keeps the tower on sdpa then.

The rest needs nothing: the audio features of a row's clips are concatenated in row order, which is the order of
their `<|AUDIO|>` runs, and scattered over them in that order; the position ids and the packed-sequence keywords
reach the language model (the audio tower gets neither), which builds the per-sample causal mask from the position
ids (sdpa, eager, flex) or hands `packed_cu_seqlens` to the varlen kernel. transformers' legacy merge (an
unexpanded prompt: no two adjacent `<|AUDIO|>` tokens in the batch) needs an attention mask and rewrites the
position ids, so it cannot take packed rows; it is never taken, as every clip of at least
`data.audio.min_seconds` (0.1 s, the length of the dummy clip too) writes two or more `<|AUDIO|>` tokens.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

from vlmctl.errors import ModelError
from vlmctl.families.encoders import audio_encoder
from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, setting

# numpy and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# soxr (an optional dependency) is imported only where used, so the rest works without it.

AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
"""The placeholder token the processor repeats per encoder frame, and the markers around it (Qwen2AudioProcessor)."""
WHISPER_DEFAULTS = {"sampling_rate": 16_000, "hop_length": 160}
"""WhisperFeatureExtractor defaults, assumed when counting from a model config (which has no extractor settings)."""


ENCODER_KEYS = ("num_mel_bins", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "d_model", "dropout",
                "attention_dropout", "activation_function", "activation_dropout", "scale_embedding", "max_source_positions",
                "encoder_layerdrop")
"""`WhisperConfig` keys that `Qwen2AudioEncoderConfig` shares (its encoder half)."""


def audio_encoder_config(config: Any):
    """The `Qwen2AudioEncoderConfig` of an audio encoder's config: a Whisper config (`model_type` whisper: its encoder
    half, `ENCODER_KEYS`), a Qwen2-Audio encoder config, or a Qwen2-Audio model's `audio_config`. Raises ModelError for
    any other model type."""
    import transformers

    model_type = getattr(config, "model_type", None)
    if model_type == "qwen2_audio":
        config = config.audio_config
        model_type = config.model_type
    if model_type == "qwen2_audio_encoder":
        return transformers.Qwen2AudioEncoderConfig(**{k: getattr(config, k) for k in ENCODER_KEYS if hasattr(config, k)})
    if model_type != "whisper":
        raise ModelError(f"model.audio is a {model_type!r} model, not a Whisper-family audio encoder",
                         hint="set model.audio to a Whisper checkpoint (e.g. openai/whisper-small) or a Qwen2-Audio encoder")
    return transformers.Qwen2AudioEncoderConfig(**{k: getattr(config, k) for k in ENCODER_KEYS if hasattr(config, k)})


def _no_images(width: int, height: int, source: Any) -> int:
    raise ModelError("family qwen2_audio takes no images", hint="train images with a vision-language family")


def extractor_settings(source: Any) -> dict[str, int]:
    """{sampling_rate, hop_length, n_samples} of the feature extractor behind `source`: a processor, a feature
    extractor, a dict of the settings a saved processor_config.json holds (its `feature_extractor`), or a model
    config (Whisper's 16 kHz and hop of 160, over the encoder's window of 2 x max_source_positions frames).
    Raises ModelError when `source` says nothing about audio."""
    if source is None:
        raise ModelError("no processor or config to count audio tokens with")
    audio_config = setting(source, "audio_config")
    if audio_config is not None:
        frames = 2 * int(setting(audio_config, "max_source_positions", default=1500))
        return {**WHISPER_DEFAULTS, "n_samples": frames * WHISPER_DEFAULTS["hop_length"]}
    extractor = setting(source, "feature_extractor", default=source)
    rate, hop = setting(extractor, "sampling_rate"), setting(extractor, "hop_length")
    if rate is None or hop is None:
        raise ModelError(f"{type(source).__name__} has no feature-extractor settings (sampling_rate, hop_length)",
                         hint="count with the model's processor (a WhisperFeatureExtractor)")
    n_samples = setting(extractor, "n_samples") or int(setting(extractor, "chunk_length", default=30)) * int(rate)
    return {"sampling_rate": int(rate), "hop_length": int(hop), "n_samples": int(n_samples)}


def audio_tokens(samples: int, *, hop_length: int, n_samples: int) -> int:
    """`<|AUDIO|>` tokens of a clip of `samples` samples at the feature extractor's rate (module docstring):
    L = ceil(min(samples, n_samples) / hop_length) frames, (((L - 1) // 2 + 1) - 2) // 2 + 1 tokens (0 for L < 3)."""
    frames = -(-min(int(samples), int(n_samples)) // int(hop_length))
    frames = min(frames, int(n_samples) // int(hop_length))
    return max(0, (((frames - 1) // 2 + 1) - 2) // 2 + 1) if frames > 0 else 0


MASKED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""transformers' attention implementations that take the audio tower's padding mask over a batch of clips."""


def keep_logits_forward(model: Any) -> bool:
    """Give `model` (a `Qwen2AudioForConditionalGeneration`, unwrapped) a forward that takes `logits_to_keep`
    (`_forward_keeping_logits`, module docstring), in place: an instance attribute, so wrappers applied later
    (peft, FSDP2, DDP, DeepSpeed) call it through their own forward and hooks. Idempotent; returns False when it
    was there already."""
    if getattr(model.forward, "__func__", None) is _forward_keeping_logits:
        return False
    model.forward = types.MethodType(_forward_keeping_logits, model)
    return True


def _forward_keeping_logits(self, *args: Any, logits_to_keep: Any = 0, **kwargs: Any):
    """The class's forward with `logits_to_keep`: an int n keeps the last n positions (0: all of them, the class's
    own forward runs), a 1-D index tensor (n,) those positions of every row. Returns the class's output with logits
    [B, n, V] computed from the language model's hidden states at the kept positions only (the LM head never sees
    the others) and no loss. Raises ValueError for `labels` with `logits_to_keep` (the loss of kept logits is the
    caller's: `vlmctl.train.kernels.token_losses`)."""
    if isinstance(logits_to_keep, int) and logits_to_keep == 0:
        return type(self).forward(self, *args, **kwargs)  # the class's (FSDP2's subclass inherits it)
    if kwargs.get("labels") is not None:
        raise ValueError("Qwen2-Audio's forward computes no loss with logits_to_keep; compute it from the returned logits")
    from transformers.modeling_utils import slice_logits_to_keep
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioCausalLMOutputWithPast

    out = self.model(*args, **kwargs)  # audio tower, projector, audio features merged, language model
    logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
    return Qwen2AudioCausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values, hidden_states=out.hidden_states,
                                            attentions=out.attentions, attention_mask=out.attention_mask)


def audio_attention(model: Any, path: str = "model.audio_tower") -> str:
    """Keep the audio tower at `path` on an attention implementation that takes its padding mask over a batch of
    clips (`MASKED_ATTENTION`): one set for the whole model that does not (the varlen kernel of packed rows) is
    replaced by sdpa for the tower only. Returns the tower's implementation."""
    tower = model.get_submodule(path)
    if tower.config._attn_implementation not in MASKED_ATTENTION:
        tower.set_attn_implementation("sdpa")
    return tower.config._attn_implementation


def prepare_packed(model: Any, path: str = "model.audio_tower") -> None:
    """What packed rows need of a Qwen2-Audio model (module docstring), in place, after the attention backend is
    set and before any wrapper: `keep_logits_forward`, `audio_attention` for the audio tower at `path`."""
    keep_logits_forward(model)
    audio_attention(model, path)


RESAMPLE_QUALITY = "HQ"
"""soxr quality of every resampling of audio (librosa's default `res_type` is soxr_hq): the data pipeline's
(`vlmctl.data.modalities.audio.resample`) and the length the token rule computes (`resampled_length`)."""


def resampled_length(samples: int, rate: int, target: int) -> int:
    """Samples of a clip of `samples` at `rate` Hz once resampled to `target` Hz (soxr's output length, round(samples
    * target / rate), computed by resampling silence of that length when the rates differ, as
    `vlmctl.data.modalities.audio.resample` does). Raises ModelError without soxr (the audio extra)."""
    if rate == target or samples == 0:
        return samples
    import numpy as np

    try:
        import soxr  # the optional audio extra
    except ImportError:
        raise ModelError(f"counting the tokens of {rate} Hz audio for a {target} Hz feature extractor needs soxr",
                         hint="pip install 'vlmctl[audio]'") from None
    return len(soxr.resample(np.zeros(samples, np.float32), rate, target, quality=RESAMPLE_QUALITY))


class Qwen2AudioSpec(FamilySpec):
    """Qwen2-Audio: audio parts only (`modalities` has no image), the audio-token rule, the Whisper feature extractor
    of its presets."""

    def check_modalities(self) -> None:
        """Refuse a spec without an audio placeholder token. Raises ModelError."""
        if "audio" not in self.modalities:
            raise ModelError(f"family {self.name!r} declares no audio placeholder token", hint="set modalities={'audio': ...}")

    def num_audio_tokens(self, samples: int, sampling_rate: int, processor_or_config: Any) -> int:
        """Audio placeholder tokens of one clip of `samples` samples at `sampling_rate` Hz (resampled to the feature
        extractor's rate first, as `vlmctl.data.modalities.audio.AudioUnit` hands it over). `processor_or_config`: the
        processor, its feature extractor, a saved processor_config.json's settings, or the model config. Returns a
        token count (module docstring). Raises ModelError without feature-extractor settings."""
        fe = extractor_settings(processor_or_config)
        n = resampled_length(int(samples), int(sampling_rate), fe["sampling_rate"])
        return audio_tokens(n, hop_length=fe["hop_length"], n_samples=fe["n_samples"])

    def position_hook(self, model: Any, image_token_id: int | None) -> Callable[[dict], dict] | None:
        """None: the collator's (1, T) per-sample positions are right as they are. Training calls this hook with the
        model exactly when rows are packed (`vlmctl.train.setup.prepare_model`: after the attention backend is set,
        before peft and the parallel wrappers), so it also prepares the model for packed rows (`prepare_packed`:
        the `logits_to_keep` forward, the audio tower's attention)."""
        prepare_packed(model, self.encoders["audio"].path)
        return None

    def preset_processor(self, tokenizer: Any, chat_template: str | None, kwargs: Mapping[str, Any], config: Mapping[str, Any]):
        """`Qwen2AudioProcessor` over a `WhisperFeatureExtractor` with the preset's settings `kwargs` (feature_size =
        the encoder's mel bins, chunk_length x sampling_rate / hop_length = 2 x max_source_positions frames)."""
        import transformers

        audio = dict(config.get("audio_config") or {})
        extractor = transformers.WhisperFeatureExtractor(**dict(kwargs))
        frames, mels = 2 * int(audio.get("max_source_positions", 1500)), int(audio.get("num_mel_bins", 128))
        if extractor.nb_max_frames != frames or extractor.feature_size != mels:
            raise ModelError(f"the preset's feature extractor gives {extractor.nb_max_frames} frames of {extractor.feature_size} mel bins, "
                             f"but its audio encoder takes {frames} frames of {mels}",
                             hint="set processor.chunk_length / hop_length / feature_size to match audio_config")
        return getattr(transformers, self.processor_class)(feature_extractor=extractor, tokenizer=tokenizer, chat_template=chat_template,
                                                           audio_token=AUDIO_TOKEN, audio_bos_token=AUDIO_BOS, audio_eos_token=AUDIO_EOS)

    # ---- compose mode: a Whisper-family encoder + any causal LM (`model.audio` + `model.llm`)

    def compose_audio_config(self, audio_config: Any, text_config: Any, *, token_ids: Mapping[str, int]):
        """`Qwen2AudioConfig` joining an audio encoder's config (`audio_encoder_config`) and any LLM's `text_config`;
        `token_ids` holds `audio_token_index`. Raises ModelError for an encoder that is not Whisper-style."""
        import transformers

        return getattr(transformers, self.config_class)(audio_config=audio_encoder_config(audio_config).to_dict(),
                                                        text_config=text_config.to_dict(), **token_ids)

    def audio_feature_extractor(self, audio_config: Any, ref: str | None = None, *, trust_remote_code: bool = False):
        """The feature extractor of a composed model: the checkpoint's own at `ref` when it has one, else a
        `WhisperFeatureExtractor` (16 kHz, hop 160) whose window is the encoder's 2 x max_source_positions frames and
        whose mel bins are its `num_mel_bins`. Raises ModelError when the extractor does not fit the encoder."""
        import transformers

        encoder = audio_encoder_config(audio_config)
        frames, mels = 2 * int(encoder.max_source_positions), int(encoder.num_mel_bins)
        extractor = None
        if ref is not None:
            try:
                extractor = transformers.AutoFeatureExtractor.from_pretrained(ref, trust_remote_code=trust_remote_code)
            except Exception:  # noqa: BLE001 - a config-only folder: build one below
                extractor = None
        if extractor is None:
            samples = frames * WHISPER_DEFAULTS["hop_length"]
            if samples % WHISPER_DEFAULTS["sampling_rate"]:
                raise ModelError(f"the audio encoder's window of {frames} frames is not a whole number of seconds at 16 kHz",
                                 hint="use a Whisper checkpoint that ships its preprocessor_config.json")
            extractor = transformers.WhisperFeatureExtractor(feature_size=mels, sampling_rate=WHISPER_DEFAULTS["sampling_rate"],
                                                             hop_length=WHISPER_DEFAULTS["hop_length"],
                                                             chunk_length=samples // WHISPER_DEFAULTS["sampling_rate"])
        if getattr(extractor, "nb_max_frames", None) != frames or getattr(extractor, "feature_size", None) != mels:
            raise ModelError(f"the feature extractor of {ref} gives {getattr(extractor, 'nb_max_frames', '?')} frames of "
                             f"{getattr(extractor, 'feature_size', '?')} mel bins, but its encoder takes {frames} frames of {mels}",
                             hint="use a Whisper checkpoint whose preprocessor_config.json matches its config")
        return extractor

    def compose_audio_processor(self, tokenizer: Any, feature_extractor: Any, chat_template: str | None):
        """`Qwen2AudioProcessor` over `feature_extractor` and the LLM's `tokenizer` (which must hold the audio tokens,
        `extra_special_tokens`)."""
        import transformers

        return getattr(transformers, self.processor_class)(feature_extractor=feature_extractor, tokenizer=tokenizer,
                                                           chat_template=chat_template, audio_token=AUDIO_TOKEN,
                                                           audio_bos_token=AUDIO_BOS, audio_eos_token=AUDIO_EOS)

    def image_processor(self, **kwargs: Any):
        """None of its own: Qwen2-Audio takes no images. Raises ModelError."""
        raise ModelError(f"family {self.name} takes no images: it has no image processor", hint="use its feature extractor (processor.feature_extractor)")


QWEN2_AUDIO = register(Qwen2AudioSpec(
    name="qwen2_audio",
    collate_prompts=True,
    model_types=("qwen2_audio",),
    model_class="Qwen2AudioForConditionalGeneration",
    config_class="Qwen2AudioConfig",
    processor_class="Qwen2AudioProcessor",
    # the tower runs the language model's attention (its packed rows: `audio_attention`)
    encoders={"audio": audio_encoder("model.audio_tower", layer_classes=("Qwen2AudioEncoderLayer",), attention=None)},
    projector=("model.multi_modal_projector",),
    language_model="model.language_model",
    decoder_layer_classes=("Qwen2DecoderLayer",),
    modalities={"audio": AUDIO_TOKEN},
    prompts={"audio": f"{AUDIO_BOS}{AUDIO_TOKEN}{AUDIO_EOS}"},
    visual_token_rule=_no_images,
    supports_packing=True,
    special_tokens=("<|im_start|>", "<|im_end|>", "<pad>", AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS),
    extra_special_tokens={"audio_token": AUDIO_TOKEN, "audio_bos_token": AUDIO_BOS, "audio_eos_token": AUDIO_EOS},
    config_token_ids={"audio_token_index": AUDIO_TOKEN},
    tiny_preset="tiny-qwen2-audio",
    compose_audio=True,
    notes="Audio + text (no images): Whisper-style encoder, linear projector, Qwen2 LLM; the audio tower is the `vision` part.",
))
