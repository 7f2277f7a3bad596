"""Qwen2.5-Omni's thinker: an audio encoder, a vision encoder and a Qwen2.5 LLM with TMRoPE in
`Qwen2_5OmniThinkerForConditionalGeneration` (Xu et al. 2025, https://arxiv.org/abs/2503.20215). The talker and
token2wav (speech output) are not part of the family: it trains the thinker on audio, images and text.

Module paths (transformers 5.23, checked by tests/unit/test_families_qwen2_5_omni.py):

| part                                     | path                                         |
|------------------------------------------|----------------------------------------------|
| audio encoder (`audio`, the `vision` part) | model.audio_tower                          |
| image encoder (`image`, the `vision` part) | model.visual                               |
| projector                                | model.audio_tower.proj, model.visual.merger  |
| language model                           | model.language_model                         |
| lm head                                  | lm_head                                      |

Two encoders (`encoders`, in forward order: the thinker encodes audio before images): the audio tower (Whisper-style,
its `Qwen2_5OmniAudioEncoderLayer`s) and the vision encoder (Qwen2.5-VL's, its `Qwen2_5OmniVisionBlock`s, window
attention). Each is the `vision` part (`train.freeze: [vision]` and the `align` / `finetune` stages freeze both; `full`
trains both) and each block of both is an FSDP2 / activation-checkpointing unit. Each encoder's projection into the
LLM (the audio tower's `proj`, the vision encoder's patch merger) is the projector. The cost model counts each encoder
by its own rule (`audio_cost`, `vision_cost` with the merger and windows).

Audio-token rule (transformers 5.23, src/transformers/models/qwen2_5_omni/processing_qwen2_5_omni.py,
`Qwen2_5OmniProcessor._process_audio` / `_get_feat_extract_output_lengths`): the Whisper feature extractor pads
every clip to `chunk_length` seconds, its frame mask keeps ceil(min(s, n_samples) / hop_length) frames L, and the
clip becomes (((L - 1) // 2 + 1) - 2) // 2 + 1 `<|AUDIO|>` tokens: Qwen2-Audio's rule (`qwen2_audio.audio_tokens`),
25 per second at 16 kHz. The audio tower encodes each clip in windows of 2 x `n_window` frames.

Images: Qwen2.5-VL's processor and rule (`qwen_vl.qwen_tokens`, `Qwen2VLImageProcessor`), one `<|IMAGE|>` per
merge x merge block of patches, between `<|vision_bos|>` and `<|vision_eos|>`.

Videos are not taken: `Qwen2_5OmniProcessor` returns the seconds per temporal patch as `video_second_per_grid`,
which vlmctl's video unit does not batch (it knows Qwen2.5-VL's `second_per_grid_ts`), and its video processor
(`Qwen2VLVideoProcessor`) needs torchvision. The preset's processor is built with no video processor
(`OmniImageAudio`: images, audio and text).

Positions (TMRoPE, `Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index`): images get 3-D positions
(t, h, w) as in Qwen2.5-VL; an audio clip's tokens get consecutive positions, as text does, so a sample without
images has the 1-D positions 0..T-1 on all three axes. Packed rows (`supports_packing=True`): `position_hook`
(`omni_prepare`) gives a packed row the (4, 1, T) text + per-sample 3-D positions, calling the model's own
`get_rope_index` on each sample with images (with its image grids and its clips' frame counts;
`packed_omni_positions`, which `vlmctl.families.qwen3_omni` shares, videos included), and prepares the
model as Qwen2-Audio's packed rows need it (`qwen2_audio.audio_attention`, and a forward taking `logits_to_keep`,
`keep_logits_forward`: the class's forward has no such argument).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from vlmctl.errors import ModelError
from vlmctl.families.qwen2_audio import audio_attention, audio_tokens, extractor_settings, resampled_length
from vlmctl.families.qwen_vl import qwen_rule, rope_index_fn
from vlmctl.families.encoders import KERNELS, audio_cost, audio_encoder, image_encoder, vision_cost
from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, _find_prefix, is_packed

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.

IMAGE, VIDEO, AUDIO = "<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>"
"""Placeholder tokens the processor repeats per image block, video block and audio frame (Qwen2.5-Omni's tokenizer)."""
VISION_BOS, VISION_EOS, AUDIO_BOS, AUDIO_EOS = "<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>", "<|audio_eos|>"
"""The markers around an image / video and around an audio clip; `get_rope_index` finds media by them."""
EXTRACTOR_KEYS = frozenset({"feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value", "dither"})
"""Preset `processor:` settings that belong to the Whisper feature extractor; the others go to the image processor."""


# --------------------------------------------------------------------------------------------------------------------
# Packed rows
# --------------------------------------------------------------------------------------------------------------------


def packed_omni_positions(get_rope_index: Callable[..., tuple[Any, Any]], input_ids, seq_lens: list[int], *,
                          token_ids: Mapping[str, int], image_grid_thw=None, video_grid_thw=None,
                          video_second_per_grid=None, feature_lens=None):
    """(4, 1, T) position ids of a packed Qwen2.5-Omni or Qwen3-Omni row: the 1-D text positions restarting per sample
    (row 0, what transformers reads to build the packed mask) over the per-sample 3-D TMRoPE positions (rows 1-3).

    `input_ids` (1, T); in row order `image_grid_thw` [n_images, 3], `video_grid_thw` [n_videos, 3],
    `video_second_per_grid` [n_videos] (seconds per temporal patch) and `feature_lens` [n_clips] (mel frames per clip,
    the `feature_attention_mask` sums). `token_ids`: the config's `vision_start` (`<|vision_bos|>` /
    `<|vision_start|>`), `image`, `video` and `audio_start` (`<|audio_bos|>` / `<|audio_start|>`) token ids. A sample
    with images or videos gets the model's own `get_rope_index` on its tokens with its slices of these (an image or a
    video is the token after a vision start, a clip one audio start: how `get_rope_index` of both classes counts them,
    transformers 5.24, models/qwen2_5_omni/modeling_qwen2_5_omni.py and models/qwen3_omni_moe/modeling_qwen3_omni_moe.py);
    one without gets 0..n-1, what `get_rope_index` gives text and audio alone. Positions are int64 where all are whole
    numbers (always so for images and clips), else float32 as Qwen3-Omni's `get_rope_index` gives them (a video's
    temporal positions are t x seconds per patch x `position_id_per_seconds`).
    Raises ModelError for a sample with videos and no `video_second_per_grid`.
    """
    import torch

    rows, start, used = [], 0, {"image": 0, "video": 0, "audio": 0}
    for n in seq_lens:
        ids = input_ids[:, start:start + n]
        after = ids[0, 1:][ids[0, :-1] == token_ids["vision_start"]]
        count = {"image": int((after == token_ids["image"]).sum()), "video": int((after == token_ids["video"]).sum()),
                 "audio": int((ids[0] == token_ids["audio_start"]).sum())}
        if count["video"] and video_second_per_grid is None:
            raise ModelError("a packed row has videos but no video_second_per_grid (seconds per temporal patch)",
                             hint="build the batch with the family's processor (`vlmctl.models.load_processor`)")
        if count["image"] or count["video"]:
            part = {key: None if t is None or not count[m] else t[used[m]:used[m] + count[m]]
                    for key, m, t in (("image_grid_thw", "image", image_grid_thw), ("video_grid_thw", "video", video_grid_thw),
                                      ("second_per_grids", "video", video_second_per_grid), ("audio_seqlens", "audio", feature_lens))}
            pos, _ = get_rope_index(ids, attention_mask=torch.ones_like(ids), **part)
        else:
            pos = torch.arange(n, device=input_ids.device).view(1, 1, -1).expand(3, 1, -1)
        rows.append(pos.float())  # float32 is exact for whole positions below 2**24
        start += n
        used = {m: used[m] + count[m] for m in used}
    mrope = torch.cat(rows, dim=-1)
    text = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens]).view(1, 1, -1)
    positions = torch.cat([text.to(mrope.dtype), mrope], dim=0)
    return positions.to(torch.long) if torch.equal(positions, positions.round()) else positions


def omni_prepare(model: Any, audio_path: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Prepare `model` (a Qwen2.5-Omni or Qwen3-Omni thinker, unwrapped) for packed rows in place
    (`keep_logits_forward`; the audio tower at `audio_path`, its encoder's path, on an attention implementation that
    takes its windows one by one where the whole model's is a varlen kernel: `qwen2_audio.audio_attention`) and return
    the batch hook (run by `loop.prefetch` ahead of the step) that replaces a packed row's (1, T) position ids by the
    (4, 1, T) positions of `packed_omni_positions` (images, videos and clips), on CPU before the device copy. Padded
    batches pass through unchanged (the model computes their positions from the attention mask)."""
    keep_logits_forward(model)
    audio_attention(model, _find_prefix(model, audio_path))
    rope_index = rope_index_fn(model)
    config = model.config
    token_ids = {"vision_start": int(config.vision_start_token_id), "image": int(config.image_token_id),
                 "video": int(config.video_token_id), "audio_start": int(config.audio_start_token_id)}

    def prepare(batch: dict[str, Any]) -> dict[str, Any]:
        if not is_packed(batch):
            return batch
        mask = batch.get("feature_attention_mask")
        positions = packed_omni_positions(rope_index, batch["input_ids"], batch["seq_lens"], token_ids=token_ids,
                                          image_grid_thw=batch.get("image_grid_thw"), video_grid_thw=batch.get("video_grid_thw"),
                                          video_second_per_grid=batch.get("video_second_per_grid"),
                                          feature_lens=None if mask is None else mask.sum(-1))
        return {**batch, "position_ids": positions}

    return prepare


def keep_logits_forward(model: Any) -> bool:
    """Give `model` (a `Qwen2_5OmniThinkerForConditionalGeneration`, unwrapped) a forward that takes
    `logits_to_keep` (`_forward_keeping_logits`), in place: an instance attribute, so wrappers applied later (peft,
    FSDP2, DDP) call it through their own forward and hooks. Idempotent; returns False when it was there already."""
    if getattr(model.forward, "__func__", None) is _forward_keeping_logits:
        return False
    model.forward = types.MethodType(_forward_keeping_logits, model)
    return True


def _forward_keeping_logits(self, *args: Any, logits_to_keep: Any = 0, **kwargs: Any):
    """The class's forward with `logits_to_keep`: an int n keeps the last n positions (0: all, the class's own
    forward runs), a 1-D index tensor (n,) those positions of every row. Returns a `CausalLMOutputWithPast` with
    logits [B, n, V] from the hidden states at the kept positions only, and no loss. Raises ValueError for `labels`
    with `logits_to_keep` (the loss of kept logits is the caller's: `vlmctl.train.kernels.token_losses`)."""
    if isinstance(logits_to_keep, int) and logits_to_keep == 0:
        return type(self).forward(self, *args, **kwargs)  # the class's (FSDP2's subclass inherits it)
    if kwargs.get("labels") is not None:
        raise ValueError("Qwen2.5-Omni's forward computes no loss with logits_to_keep; compute it from the returned logits")
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    out = self.model(*args, **kwargs)  # encoders, their features merged, language model
    logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
    return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values, hidden_states=out.hidden_states,
                                  attentions=out.attentions)


# --------------------------------------------------------------------------------------------------------------------
# The processor without a video processor
# --------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def omni_image_audio(cls):
    """`cls` (`Qwen2_5OmniProcessor`) without its video processor: images, audio and text. Its parts are (image
    processor, feature extractor, tokenizer), in the order `from_pretrained` passes them; `cls.__init__` passes its
    own four positionally, and transformers pairs them with the parts in order (the fourth, the tokenizer slot,
    is dropped). `model_input_names` would read the absent video processor's. Saved under the real class's name."""

    class OmniImageAudio(cls):
        video_processor = None  # what code asking for a video processor finds

        def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None, video_processor=None):
            super().__init__(image_processor, feature_extractor, tokenizer, None, chat_template=chat_template)

        @classmethod
        def get_attributes(klass):
            return [a for a in super().get_attributes() if a != "video_processor"]

        @property
        def model_input_names(self):
            names = [*self.tokenizer.model_input_names, *self.feature_extractor.model_input_names,
                     *self.image_processor.model_input_names, "feature_attention_mask"]
            return list(dict.fromkeys(names))

    OmniImageAudio.__name__ = OmniImageAudio.__qualname__ = cls.__name__
    return OmniImageAudio


# --------------------------------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------------------------------


class Qwen25OmniSpec(FamilySpec):
    """Qwen2.5-Omni's thinker: images (Qwen2.5-VL's rule), audio (Qwen2-Audio's rule), TMRoPE positions."""

    def num_audio_tokens(self, samples: int, sampling_rate: int, processor_or_config: Any) -> int:
        """`<|AUDIO|>` tokens of one clip of `samples` samples at `sampling_rate` Hz (resampled to the feature
        extractor's rate first, as `vlmctl.data.modalities.audio.AudioUnit` hands it over). `processor_or_config`: the
        processor, its feature extractor, a saved processor_config.json's settings, or the model config (Whisper's
        16 kHz and hop of 160 over the encoder's 2 x max_source_positions frames). Returns a token count (module
        docstring). Raises ModelError without feature-extractor settings."""
        fe = extractor_settings(processor_or_config)
        n = resampled_length(int(samples), int(sampling_rate), fe["sampling_rate"])
        return audio_tokens(n, hop_length=fe["hop_length"], n_samples=fe["n_samples"])

    def position_hook(self, model: Any, image_token_id: int | None) -> Callable[[dict], dict] | None:
        """`omni_prepare(model, <the audio encoder's path>)`: packed rows need per-sample TMRoPE positions, the
        `logits_to_keep` forward and the audio tower on a masked attention. Training calls it with the model exactly
        when rows are packed."""
        return omni_prepare(model, self.encoders["audio"].path)

    def image_size_kwargs(self, kwargs: Mapping[str, Any], size: int) -> dict[str, Any]:
        """`model.image_size` caps the pixels per image at size**2 (`max_pixels`; `min_pixels` no larger)."""
        return {**kwargs, "max_pixels": size * size, "min_pixels": min(kwargs.get("min_pixels", 3136), size * size)}

    def default_image_size(self, image_processor: Any) -> int | None:
        """448 px: a square image at the size Qwen-VL examples use (dynamic resolution has no native size)."""
        return 448

    def make_processor(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None, *,
                       feature_extractor: Any = None, **kwargs: Any):
        """`Qwen2_5OmniProcessor` over `image_processor`, `feature_extractor` (a `WhisperFeatureExtractor`, 16 kHz,
        128 mel bins: the published one, where None) and `tokenizer` (which holds the family's tokens,
        `extra_special_tokens`), without a video processor (`omni_image_audio`)."""
        import transformers

        extractor = feature_extractor if feature_extractor is not None else transformers.WhisperFeatureExtractor(feature_size=128)
        cls = omni_image_audio(getattr(transformers, self.processor_class))
        return cls(image_processor=image_processor, feature_extractor=extractor, tokenizer=tokenizer, chat_template=chat_template)

    def image_only_processor(self, ref: str, *, trust_remote_code: bool = False):
        """The saved processor at `ref` without its video processor (`omni_image_audio`), its saved image-processor
        and feature-extractor settings kept: transformers' own needs torchvision for the video processor."""
        import transformers

        return omni_image_audio(getattr(transformers, self.processor_class)).from_pretrained(ref, trust_remote_code=trust_remote_code)

    def preset_processor(self, tokenizer: Any, chat_template: str | None, kwargs: Mapping[str, Any], config: Mapping[str, Any]):
        """The processor of a preset: its `processor:` settings split between the Whisper feature extractor
        (`EXTRACTOR_KEYS`) and the image processor. Raises ModelError when the extractor's window or mel bins do not
        match the audio encoder (feature_size = num_mel_bins, chunk_length x sampling_rate / hop_length = 2 x
        max_source_positions frames)."""
        import transformers

        audio = dict(config.get("audio_config") or {})
        extractor = transformers.WhisperFeatureExtractor(**{k: v for k, v in kwargs.items() if k in EXTRACTOR_KEYS})
        frames, mels = 2 * int(audio.get("max_source_positions", 1500)), int(audio.get("num_mel_bins", 128))
        if extractor.nb_max_frames != frames or extractor.feature_size != mels:
            raise ModelError(f"the preset's feature extractor gives {extractor.nb_max_frames} frames of {extractor.feature_size} mel bins, "
                             f"but its audio encoder takes {frames} frames of {mels}",
                             hint="set processor.chunk_length / hop_length / feature_size to match audio_config")
        image = self.image_processor(**{k: v for k, v in kwargs.items() if k not in EXTRACTOR_KEYS})
        return self.make_processor(tokenizer, image, chat_template, feature_extractor=extractor)


QWEN2_5_OMNI = register(Qwen25OmniSpec(
    name="qwen2_5_omni",
    model_types=("qwen2_5_omni_thinker",),
    model_class="Qwen2_5OmniThinkerForConditionalGeneration",
    config_class="Qwen2_5OmniThinkerConfig",
    processor_class="Qwen2_5OmniProcessor",
    encoders={
        # the tower computes a clip's real frames only, attending within chunks of 2 x n_window frames
        "audio": audio_encoder("model.audio_tower", layer_classes=("Qwen2_5OmniAudioEncoderLayer",),
                               cost=audio_cost(chunk_key="n_window")),
        "image": image_encoder("model.visual", layer_classes=("Qwen2_5OmniVisionBlock",),
                               cost=vision_cost(merge=True, windows=True), kernels=KERNELS),
    },
    projector=("model.audio_tower.proj", "model.visual.merger"),
    language_model="model.language_model",
    decoder_layer_classes=("Qwen2_5OmniDecoderLayer",),
    modalities={"image": IMAGE, "audio": AUDIO},
    prompts={"image": f"{VISION_BOS}{IMAGE}{VISION_EOS}", "audio": f"{AUDIO_BOS}{AUDIO}{AUDIO_EOS}"},
    # the published processor: Qwen2.5-VL's image processor (patch 14, 3136 to 12845056 pixels)
    visual_token_rule=qwen_rule(14, 56 * 56, 28 * 28 * 16384),
    image_grid_args=("image_grid_thw",),
    mrope=True,
    supports_packing=True,
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", VISION_BOS, VISION_EOS, IMAGE, VIDEO,
                    AUDIO, AUDIO_BOS, AUDIO_EOS),
    extra_special_tokens={"audio_token": AUDIO, "video_token": VIDEO, "vision_bos_token": VISION_BOS, "vision_eos_token": VISION_EOS,
                          "audio_bos_token": AUDIO_BOS, "audio_eos_token": AUDIO_EOS},
    config_token_ids={"image_token_index": IMAGE, "video_token_index": VIDEO, "audio_token_index": AUDIO,
                      "audio_start_token_id": AUDIO_BOS, "audio_end_token_id": AUDIO_EOS,
                      "vision_start_token_id": VISION_BOS, "vision_end_token_id": VISION_EOS},
    image_processor_class="Qwen2VLImageProcessor",
    tiny_preset="tiny-qwen2.5-omni",
    notes="Qwen2.5-Omni's thinker: audio + images + text (no video, no speech output); two encoders, both the `vision` part.",
))
