"""Qwen3-Omni's thinker: an audio encoder (AuT), a Qwen3-VL-style vision encoder with DeepStack mergers and a
mixture-of-experts Qwen3 LLM with TMRoPE, in `Qwen3OmniMoeThinkerForConditionalGeneration` (Xu et al. 2025,
https://arxiv.org/abs/2509.17765). The talker and code2wav (speech output) are not part of the family: it trains the
thinker on audio, images, videos and text.

Module paths (transformers 5.24, checked by tests/unit/test_family_qwen3_omni.py):

| part                                       | path                                                         |
|--------------------------------------------|--------------------------------------------------------------|
| audio encoder (`audio`, the `vision` part) | model.audio_tower                                            |
| image encoder (`image`: images, videos)    | model.visual                                                 |
| projector                                  | model.audio_tower.proj1, model.audio_tower.proj2,            |
|                                            | model.visual.merger, model.visual.merger_list                |
| language model                             | model.language_model                                         |
| lm head                                    | lm_head                                                      |

Two encoders (`encoders`, in forward order, as in `vlmctl.families.qwen2_5_omni`): the audio tower (AuT, its
`Qwen3OmniMoeAudioEncoderLayer`s) and the vision encoder (Qwen3-VL's, its `Qwen3OmniMoeVisionBlock`s). Each is the
`vision` part (`train.freeze: [vision]` and the `align` / `finetune` stages freeze both; `full` trains both) and each
block of both is an FSDP2 / activation-checkpointing unit. Each encoder's projection into the LLM (the audio tower's
`proj1`/`proj2`, the vision encoder's merger and its DeepStack mergers) is the projector. FSDP2 and checkpointing wrap
each `Qwen3OmniMoeThinkerTextDecoderLayer` (attention, router and all its experts, as in
`vlmctl.families.qwen3_vl_moe`); the router's load-balancing loss is off (transformers' default).

Audio (transformers 5.24, src/transformers/models/qwen3_omni_moe/processing_qwen3_omni_moe.py, `_process_audio`,
`_get_feat_extract_output_lengths`; modeling_qwen3_omni_moe.py, `Qwen3OmniMoeAudioEncoder.forward`): the Whisper
feature extractor gives L log-mel frames (one per `hop_length` samples); the encoder cuts them into chunks of
2 x `n_window` frames, runs three stride-2 3x3 convolutions on each chunk and its layers on the chunks' remaining
positions, attending within windows of `n_window_infer` frames. A clip becomes
    a(L) = (((L mod 2n - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1 + (L // 2n) * 13       (n = n_window)
`<|audio_pad|>` tokens. The 13 is hard-coded there (the three convolutions over one chunk of 100 frames), so the
encoder works with n_window = 50 only (`preset_processor` refuses another). The published processor pads the
features of one call to its longest clip; vlmctl's processor (`QwenOmniAudioWindow`) pads every clip to the feature
extractor's window (`chunk_length` seconds) and cuts longer ones, so that clips of different samples batch along
dim 0 (`vlmctl.data.modalities.audio.concat_audio`). The encoder reads only the frames of `feature_attention_mask`,
so padding does not change a clip's features; a clip then has L = ceil(min(s, n_samples) / hop_length) frames
(the published processor keeps s // hop_length: one frame more where s is not a multiple of the hop).

Images: Qwen2-VL's image processor with Qwen3's 16 px patches (`qwen_vl.qwen_tokens` rule), one `<|image_pad|>` per
merge x merge block of patches, between `<|vision_start|>` and `<|vision_end|>`.

Videos: frames sampled by vlmctl (`vlmctl.data.modalities.video`) go to the processor's `videos=` with their metadata.
The published processor loads transformers' `Qwen2VLVideoProcessor` (which needs torchvision); where torchvision is
missing the family uses its stand-in (`qwen_video.FramesVideoProcessor`, the same outputs) with 16 px patches,
frames resized one by one into `VIDEO_SIZE` pixels (128 x 32^2 to 768 x 32^2, the processor's `videos_kwargs`; a
preset sets `video_min_pixels` / `video_max_pixels`), consecutive frames paired into temporal patches. A clip of T
frames becomes `pixel_values_videos` [ceil(T/2) * h * w, 3 * 2 * 16 * 16] and `video_grid_thw` (ceil(T/2), h, w), and
t * h * w / 4 `<|video_pad|>` tokens between `<|vision_start|>` and `<|vision_end|>` (`num_video_tokens`). The
processor (`omni_processor`) returns the seconds per temporal patch as `video_second_per_grid` [clips], a key the
video unit batches (`vlmctl.families.encoders.VIDEO_KEYS`): 2 / the clip's sampled rate (`clip_seconds_per_grid`;
transformers' processor takes 1 frame per second unless the call passes `fps`). The frame bounds are the video
processor's own `size`, saved with it (transformers' processor would pass its class default at every call). A video's
audio track is not interleaved with its frames (`use_audio_in_video` / `load_audio_from_video` raise ValueError):
give the audio as a clip of its own.

Positions (TMRoPE, `Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index`): images get 3-D positions
(t, h, w); a video's temporal patch t the temporal position t x `video_second_per_grid` x `position_id_per_seconds`
(13 per second: fractional for most rates, kept as float32 as the model computes them), its h and w as an image's;
an audio clip's tokens consecutive ones, as text; a sample without images or videos 0..T-1 on all three axes.
Packed rows: `position_hook` (`qwen2_5_omni.omni_prepare`, shared with Qwen2.5-Omni) gives a packed row the (4, 1, T)
text + per-sample 3-D positions from the model's own `get_rope_index` (`qwen2_5_omni.packed_omni_positions`, videos
included), the forward taking `logits_to_keep`
(`qwen2_5_omni.keep_logits_forward`) and the audio tower an attention implementation that splits its windows itself.
The audio tower encodes each clip on its own (`cu_seqlens` per window), so clips of different samples never mix.

FLOPs: the image encoder by the generic ViT rule with its merger (`vision_cost(merge=True)`: Qwen3-VL's tower, full
attention per frame, the merger and each DeepStack merger on the visual tokens); the audio encoder by its own rule
(`aut_cost`, `AuTShape`: chunks, 2-D convolutions, attention windows), which `vlmctl.train.flops.CostModel` adds to
the rest (its module docstring gives the terms and the backward factors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from vlmctl.errors import ModelError
from vlmctl.families.encoders import audio_encoder, image_encoder, submodule, vision_cost
from vlmctl.families.qwen2_5_omni import EXTRACTOR_KEYS, Qwen25OmniSpec, omni_image_audio
from vlmctl.families.qwen2_audio import extractor_settings, resampled_length
from vlmctl.families.qwen_vl import _frames_variant, _saved_video_settings, qwen_rule, qwen_video_tokens
from vlmctl.families.registry import register
from vlmctl.families.spec import setting

# numpy, torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's
# start-up) must not pay for them.

IMAGE, VIDEO, AUDIO = "<|image_pad|>", "<|video_pad|>", "<|audio_pad|>"
"""Placeholder tokens the processor repeats per image block, video block and audio position (Qwen3-Omni's tokenizer)."""
VISION_BOS, VISION_EOS, AUDIO_BOS, AUDIO_EOS = "<|vision_start|>", "<|vision_end|>", "<|audio_start|>", "<|audio_end|>"
"""The markers around an image / video and around an audio clip; `get_rope_index` finds media by them."""
N_WINDOW = 50
"""The only `n_window` (half a chunk, in mel frames) the encoder's output-length formula holds for (module docstring)."""
TOKENS_PER_CHUNK = 13
"""Audio positions per chunk of 2 x N_WINDOW frames after the three stride-2 convolutions."""
PUBLISHED_EXTRACTOR = {"sampling_rate": 16_000, "hop_length": 160, "n_samples": 30 * 16_000}
"""The published feature extractor (Whisper's, 128 mel bins), assumed when counting from a model config."""
VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
"""Pixels per frame of the video processor (`Qwen3OmniMoeProcessor.videos_kwargs["size"]`, transformers 5.24)."""
VIDEO_KEYS = ("video_min_pixels", "video_max_pixels")
"""Preset `processor:` settings of the video processor (its `size` bounds, pixels per frame)."""


def conv_out(n):
    """Positions after one of the encoder's 3x3, stride-2, padding-1 convolutions over `n` positions (torch's Conv2d
    output size; elementwise over tensors and arrays)."""
    return (n - 1) // 2 + 1


def audio_tokens(frames: int, n_window: int = N_WINDOW) -> int:
    """`<|audio_pad|>` tokens (and encoder output positions) of a clip of `frames` mel frames: a(L) of the module
    docstring (transformers' `_get_feat_extract_output_lengths`)."""
    chunk = 2 * int(n_window)
    frames = int(frames)
    rest = frames % chunk
    tail = conv_out(conv_out(conv_out(rest))) if rest else 0
    return tail + (frames // chunk) * TOKENS_PER_CHUNK


def clip_frames(samples: int, *, hop_length: int, n_samples: int) -> int:
    """Mel frames the frame mask keeps of a clip of `samples` samples padded or cut to `n_samples`:
    ceil(min(samples, n_samples) / hop_length)."""
    return min(-(-min(int(samples), int(n_samples)) // int(hop_length)), int(n_samples) // int(hop_length))


# --------------------------------------------------------------------------------------------------------------------
# The processor
# --------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def audio_window_processor(cls):
    """`omni_image_audio(cls)` (`Qwen3OmniMoeProcessor` without its video processor) whose feature extractor pads
    every clip to its window and cuts longer ones (module docstring). Saved under the real class's name; what
    `image_only_processor` loads a saved processor's image, audio and text parts with."""
    base = omni_image_audio(cls)

    class QwenOmniAudioWindow(base):
        audio_kwargs = {**cls.audio_kwargs, "padding": "max_length", "truncation": True}

    QwenOmniAudioWindow.__name__ = QwenOmniAudioWindow.__qualname__ = cls.__name__
    return QwenOmniAudioWindow


@lru_cache(maxsize=None)
def omni_processor(cls):
    """`cls` (`Qwen3OmniMoeProcessor`) with the family's changes (module docstring, "Videos"): a `qwen_video` stand-in
    accepted as its video processor (`qwen_vl._frames_variant`), every clip padded to the feature extractor's
    window, the frame bounds of its video processor's own `size` (no call-time `size`), each clip's seconds per
    temporal patch from its rate (`clip_seconds_per_grid`), and audio-in-video refused (ValueError). Saved under
    the real class's name."""
    base = _frames_variant(cls)

    class QwenOmniFrames(base):
        audio_kwargs = {**cls.audio_kwargs, "padding": "max_length", "truncation": True}
        videos_kwargs: dict = {}  # transformers' default `size` would override the video processor's saved bounds

        def __call__(self, *args: Any, **kwargs: Any):
            videos_kwargs = kwargs.get("videos_kwargs") or {}
            if any(kwargs.get(k) or videos_kwargs.get(k) for k in ("use_audio_in_video", "load_audio_from_video")):
                raise ValueError("vlmctl's Qwen3-Omni processor does not interleave a video's audio track with its frames "
                                 "(use_audio_in_video / load_audio_from_video): pass the audio as a clip of its own")
            return super().__call__(*args, **kwargs)

        def _process_videos(self, videos: Any, **kwargs: Any):
            processed, replacements = super()._process_videos(videos, **kwargs)
            options = kwargs["videos_kwargs"]
            temporal = int(self.video_processor.temporal_patch_size)
            processed["video_second_per_grid"] = clip_seconds_per_grid(
                options.get("video_metadata"), len(processed["video_grid_thw"]), temporal, fps=options.get("fps"))
            return processed, replacements

    QwenOmniFrames.__name__ = QwenOmniFrames.__qualname__ = cls.__name__
    return QwenOmniFrames


def clip_seconds_per_grid(metadata: Any, clips: int, temporal_patch_size: int, *, fps: float | None = None) -> list[float]:
    """Seconds per temporal patch of each of `clips` clips: temporal_patch_size / rate, the rate being `fps` where
    given (transformers' `Qwen3OmniMoeProcessor._process_videos`, which takes 1 frame per second without it), else
    each clip's sampled rate from its `metadata` (`VideoMetadata.sampled_fps` of a dict or `VideoMetadata` per clip,
    as Qwen2.5-VL's processor reads it), else 1 frame per second. Returns a list of `clips` floats."""
    from transformers.video_utils import VideoMetadata

    if fps is not None:
        return [temporal_patch_size / float(fps)] * clips
    metadata = list(metadata) if isinstance(metadata, (list, tuple)) else [metadata] * clips
    fields = set(VideoMetadata.__dataclass_fields__)
    out = []
    for i in range(clips):
        meta = metadata[i] if i < len(metadata) else None
        if isinstance(meta, dict):
            meta = VideoMetadata(**{k: v for k, v in meta.items() if k in fields})
        rate = meta.sampled_fps if meta is not None and meta.fps else 1.0
        out.append(temporal_patch_size / float(rate))
    return out


# --------------------------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------------------------


def _matrices(module) -> int:
    """Parameters of the weight matrices and kernels under `module` (biases and norm scales excluded)."""
    return sum(p.numel() for p in module.parameters() if p.ndim >= 2)


@dataclass(frozen=True)
class AuTShape:
    """What the audio encoder costs (`aut_cost` reads it off the model) and its FLOPs per micro-batch: a cost rule's
    result that `vlmctl.train.flops.CostModel` adds as it is (a `CountsItself`: `paths`, `batch_terms`,
    `sample_terms`). Forward FLOPs, matmuls only,
    as `torch.utils.flop_counter` counts them (transformers 5.24, `Qwen3OmniMoeAudioEncoder.forward`): each clip's L
    frames (the `feature_attention_mask` sums) cut into chunks of 2 x n_window frames, all chunks padded to the
    longest one; the three 3x3 stride-2 convolutions run on every chunk at its padded size (2 x kernel x output
    positions, mel bins x frames, each), `conv_out` on every padded chunk's remaining frames; the layers, `proj1`
    and `proj2` on the real positions (a(L) per clip, module docstring); attention 4 x d x layers x the sum of
    squared windows (each clip's positions cut into windows of the longest chunk's positions x n_window_infer /
    (2 x n_window)). Backward factors are the cost model's: the encoder is the `vision` part (its first convolution
    reads the mel features: no input gradient), `proj1` / `proj2` the projector (`proj1` reads the encoder's
    output)."""

    paths: tuple[str, ...]  # the module paths whose parameters it charges: the whole tower, `proj1` / `proj2` included
    mel_bins: int
    n_window: int
    n_window_infer: int
    width: int  # d_model
    layers: int
    convs: tuple[int, int, int]  # kernel parameters of conv2d1, conv2d2, conv2d3
    conv_out: int  # the linear layer over a chunk's flattened convolution channels x mel bins
    blocks: int  # the layers' matrices
    proj: tuple[int, int]  # proj1, proj2

    def batch_terms(self, batch: Mapping[str, Any], cost: Any) -> dict[str, float]:
        """FLOPs of the clips of one collated micro-batch (`input_features`, `feature_attention_mask` [clips,
        frames]) as the `audio`, `audio_attention` and `projector` terms, under `cost`'s backward factors (a
        `vlmctl.train.flops.CostModel`). No clips: no terms."""
        mask = batch.get("feature_attention_mask")
        if batch.get("input_features") is None or mask is None:
            return {}
        clips = [int(n) for n in mask.reshape(-1, mask.shape[-1]).sum(-1).tolist()]
        chunk = 2 * self.n_window
        chunks = [min(chunk, f - start) for f in clips for start in range(0, f, chunk)]
        if not chunks:
            return {}
        positions = sum(conv_out(conv_out(conv_out(c))) for c in chunks)
        window = max(conv_out(conv_out(conv_out(c))) for c in chunks) * (self.n_window_infer // chunk)
        pairs = 0
        for frames in clips:
            full, rest = divmod(audio_tokens(frames, self.n_window), window)
            pairs += full * window * window + rest * rest
        return self._terms(len(chunks), max(chunks), positions, pairs, cost)

    def sample_terms(self, tokens, items, cost: Any) -> dict[str, Any]:
        """The `batch_terms` of N samples from their audio tokens and clips (float64 arrays [N]; `CountsItself`):
        a clip of a(L) tokens is taken as ceil(a(L) / 13) whole chunks (the chunks of a batch are padded to its
        longest), each of its positions one layer position, its attention windows as `batch_terms` cuts them."""
        import numpy as np

        tokens, items = np.asarray(tokens, dtype=np.float64), np.asarray(items, dtype=np.float64)
        per_clip = np.divide(tokens, items, out=np.zeros_like(tokens), where=items > 0)
        chunk = 2 * self.n_window
        per_chunk = conv_out(conv_out(conv_out(chunk)))
        window = per_chunk * (self.n_window_infer // chunk)
        full = np.floor(per_clip / window)
        pairs = items * (full * window * window + (per_clip - full * window) ** 2)
        return self._terms(items * np.ceil(per_clip / per_chunk), chunk, tokens, pairs, cost)

    def _terms(self, chunks, longest: int, positions, pairs, cost: Any) -> dict[str, Any]:
        """The terms of `chunks` chunks padded to `longest` frames, `positions` real output positions and `pairs`
        attention pairs per layer (scalars, or numpy arrays elementwise)."""
        h, w, stem = self.mel_bins, longest, []
        for _ in range(3):
            h, w = conv_out(h), conv_out(w)
            stem.append(chunks * h * w)
        first, rest_ = cost.weight_factor("vision", input_layer=True), cost.weight_factor("vision")
        audio = (first * self.convs[0] * stem[0] + rest_ * (self.convs[1] * stem[1] + self.convs[2] * stem[2])
                 + rest_ * self.conv_out * chunks * w + rest_ * self.blocks * positions)
        projector = (cost.weight_factor("projector", input_layer=True) * self.proj[0]
                     + cost.weight_factor("projector") * self.proj[1]) * positions
        return {"audio": audio, "audio_attention": cost.attention_factor("vision") * 4.0 * self.width * self.layers * pairs,
                "projector": projector}


@dataclass(frozen=True)
class AuTCost:
    """The cost rule of Qwen3-Omni's audio encoder (`aut_cost`); called as `rule(model, encoder)`."""

    def __call__(self, model: Any, encoder: Any) -> AuTShape:
        tower = submodule(model, encoder.path)
        a = getattr(model.config, encoder.config_key)
        return AuTShape(paths=(encoder.path,), mel_bins=int(a.num_mel_bins), n_window=int(a.n_window),
                        n_window_infer=int(a.n_window_infer), width=int(a.d_model), layers=int(a.encoder_layers),
                        convs=tuple(_matrices(getattr(tower, f"conv2d{i}")) for i in (1, 2, 3)),
                        conv_out=_matrices(tower.conv_out), blocks=_matrices(tower.layers),
                        proj=(_matrices(tower.proj1), _matrices(tower.proj2)))


def aut_cost() -> AuTCost:
    """The cost rule of Qwen3-Omni's audio encoder (`AuTShape`), read from the model (any device, meta included) and
    `model.config.audio_config` (n_window, n_window_infer, d_model, encoder_layers, num_mel_bins). Picklable."""
    return AuTCost()


# --------------------------------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------------------------------


class Qwen3OmniSpec(Qwen25OmniSpec):
    """Qwen3-Omni's thinker: images and videos (16 px patches), audio (chunked AuT encoder), TMRoPE positions."""

    def num_audio_tokens(self, samples: int, sampling_rate: int, processor_or_config: Any) -> int:
        """`<|audio_pad|>` tokens of one clip of `samples` samples at `sampling_rate` Hz (resampled to the feature
        extractor's rate first). `processor_or_config`: the processor, its feature extractor, a saved
        processor_config.json's settings, or the model config (the published extractor: 16 kHz, hop 160, 30 s
        window). Returns a token count (module docstring). Raises ModelError without feature-extractor settings."""
        if setting(processor_or_config, "audio_config") is not None:
            fe = PUBLISHED_EXTRACTOR
        else:
            fe = extractor_settings(processor_or_config)
        n = resampled_length(int(samples), int(sampling_rate), fe["sampling_rate"])
        return audio_tokens(clip_frames(n, hop_length=fe["hop_length"], n_samples=fe["n_samples"]))

    def processor_outputs(self, outputs: Mapping[str, Any], processor: Any) -> Mapping[str, Any]:
        """One sample's outputs with its clips' features [n, mel bins, frames] and frame mask [n, frames] padded to the
        feature extractor's window (`nb_max_frames`), as `QwenOmniAudioWindow` returns them: transformers' own
        processor (loaded where torchvision is installed) pads a call to its longest clip only. The encoder reads only
        the masked frames, so the padding changes nothing but the shapes."""
        features = outputs.get("input_features")
        window = getattr(getattr(processor, "feature_extractor", None), "nb_max_frames", None)
        if features is None or window is None or features.shape[-1] >= int(window):
            return outputs
        import torch.nn.functional as F

        extra = int(window) - features.shape[-1]
        mask = outputs["feature_attention_mask"]
        return {**outputs, "input_features": F.pad(features, (0, extra)), "feature_attention_mask": F.pad(mask, (0, extra))}

    def num_video_tokens(self, frames: int, width: int, height: int, processor_or_config: Any, *, fps: float | None = None) -> int:
        """`<|video_pad|>` tokens of one clip of `frames` frames of `width` x `height` px: Qwen2-VL's video rule
        (`qwen_vl.qwen_video_tokens`: ceil(frames / 2) temporal patches of (H' / 16) * (W' / 16) / 4 tokens, H' x W'
        the frame resized into the video processor's pixels per frame). `processor_or_config`: the processor, its
        settings read from a folder, or the model config (then `VIDEO_SIZE`, the published bounds, with the vision
        config's patch, merge and temporal patch sizes). `fps` does not matter (no timestamps)."""
        vision = setting(processor_or_config, "vision_config")
        if vision is not None and setting(processor_or_config, "video_processor") is None:
            processor_or_config = {"video_processor": {
                "size": VIDEO_SIZE, "patch_size": setting(vision, "patch_size", default=16),
                "merge_size": setting(vision, "spatial_merge_size", default=2),
                "temporal_patch_size": setting(vision, "temporal_patch_size", default=2)}}
        return qwen_video_tokens(frames, width, height, processor_or_config, default_patch=16)

    def video_processor(self, image_processor: Any, **settings: Any):
        """The video processor: transformers' `Qwen2VLVideoProcessor` (what the published Qwen3-Omni processor loads)
        or, where torchvision is missing, its stand-in `qwen_video.FramesVideoProcessor`, with the image processor's
        patch / merge / temporal patch sizes and `VIDEO_SIZE` pixels per frame, unless `settings` (a saved video
        processor's, or `min_pixels` / `max_pixels`) say otherwise."""
        import transformers

        kwargs = {"patch_size": image_processor.patch_size, "merge_size": image_processor.merge_size,
                  "temporal_patch_size": image_processor.temporal_patch_size, "size": dict(VIDEO_SIZE), **settings}
        try:
            return getattr(transformers, self.video_processor_class)(**kwargs)  # ImportError without torchvision
        except ImportError:
            from vlmctl.families.qwen_video import STAND_INS  # imported only when a processor is built

            return STAND_INS[self.video_processor_class](**kwargs)

    def make_processor(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None, *,
                       feature_extractor: Any = None, video_processor: Any = None, **kwargs: Any):
        """`Qwen3OmniMoeProcessor` over `image_processor`, `video_processor` (`self.video_processor(image_processor)`
        where None), `feature_extractor` (a `WhisperFeatureExtractor`, 16 kHz, 128 mel bins: the published one, where
        None) and `tokenizer`, as `omni_processor` changes it (windowed clips, stand-in video processor, seconds per
        temporal patch from each clip's rate)."""
        import transformers

        extractor = feature_extractor if feature_extractor is not None else transformers.WhisperFeatureExtractor(feature_size=128)
        video = video_processor if video_processor is not None else self.video_processor(image_processor)
        cls = omni_processor(getattr(transformers, self.processor_class))
        return cls(image_processor=image_processor, video_processor=video, feature_extractor=extractor, tokenizer=tokenizer,
                   chat_template=chat_template)

    def image_only_processor(self, ref: str, *, trust_remote_code: bool = False):
        """The saved processor at `ref` as `make_processor` builds it: its image processor, feature extractor,
        tokenizer and template loaded without the video processor (transformers' needs torchvision), which is built
        again from its saved settings (`video_processor`; the defaults where the folder has none)."""
        import transformers

        cls = audio_window_processor(getattr(transformers, self.processor_class))
        saved = cls.from_pretrained(ref, trust_remote_code=trust_remote_code)
        video = self.video_processor(saved.image_processor, **_saved_video_settings(ref))
        return self.make_processor(saved.tokenizer, saved.image_processor, saved.chat_template,
                                   feature_extractor=saved.feature_extractor, video_processor=video)

    def preset_processor(self, tokenizer: Any, chat_template: str | None, kwargs: Mapping[str, Any], config: Mapping[str, Any]):
        """The processor of a preset: its `processor:` settings split between the Whisper feature extractor
        (`EXTRACTOR_KEYS`), the video processor (`VIDEO_KEYS`: `video_min_pixels` / `video_max_pixels`, pixels per
        frame) and the image processor. Raises ModelError when the extractor's mel bins differ from the encoder's
        (`num_mel_bins`) or the encoder's `n_window` is not `N_WINDOW`."""
        import transformers

        audio = dict(config.get("audio_config") or {})
        extractor = transformers.WhisperFeatureExtractor(**{k: v for k, v in kwargs.items() if k in EXTRACTOR_KEYS})
        mels, window = int(audio.get("num_mel_bins", 128)), int(audio.get("n_window", N_WINDOW))
        if extractor.feature_size != mels:
            raise ModelError(f"the preset's feature extractor gives {extractor.feature_size} mel bins, but its audio encoder takes {mels}",
                             hint="set processor.feature_size to audio_config.num_mel_bins")
        if window != N_WINDOW:
            raise ModelError(f"audio_config.n_window is {window}; Qwen3-Omni's encoder computes its output lengths for "
                             f"n_window {N_WINDOW} only", hint=f"set audio_config.n_window: {N_WINDOW}")
        image = self.image_processor(**{k: v for k, v in kwargs.items() if k not in EXTRACTOR_KEYS and k not in VIDEO_KEYS})
        video = self.video_processor(image, **{k.removeprefix("video_"): v for k, v in kwargs.items() if k in VIDEO_KEYS})
        return self.make_processor(tokenizer, image, chat_template, feature_extractor=extractor, video_processor=video)


QWEN3_OMNI = register(Qwen3OmniSpec(
    name="qwen3_omni",
    model_types=("qwen3_omni_moe_thinker",),
    model_class="Qwen3OmniMoeThinkerForConditionalGeneration",
    config_class="Qwen3OmniMoeThinkerConfig",
    processor_class="Qwen3OmniMoeProcessor",
    encoders={
        # the tower computes a clip's real frames only, in chunks; attention within windows of chunks
        "audio": audio_encoder("model.audio_tower", layer_classes=("Qwen3OmniMoeAudioEncoderLayer",), cost=aut_cost()),
        # Qwen3-VL's tower: a Conv3d patch embedding (kernel = stride) and the vision rotary; its MLP has no gate
        "image": image_encoder("model.visual", layer_classes=("Qwen3OmniMoeVisionBlock",), cost=vision_cost(merge=True),
                               kernels=("patch_embed_gemm", "compiled_rotary"), video=True),
    },
    projector=("model.audio_tower.proj1", "model.audio_tower.proj2", "model.visual.merger", "model.visual.merger_list"),
    language_model="model.language_model",
    decoder_layer_classes=("Qwen3OmniMoeThinkerTextDecoderLayer",),
    modalities={"image": IMAGE, "video": VIDEO, "audio": AUDIO},
    prompts={"image": f"{VISION_BOS}{IMAGE}{VISION_EOS}", "video": f"{VISION_BOS}{VIDEO}{VISION_EOS}",
             "audio": f"{AUDIO_BOS}{AUDIO}{AUDIO_EOS}"},
    # the published processor: Qwen2-VL's image processor with 16 px patches, 3136 to 12845056 pixels
    visual_token_rule=qwen_rule(16, 56 * 56, 28 * 28 * 16384),
    image_grid_args=("image_grid_thw",),
    mrope=True,
    supports_packing=True,
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", VISION_BOS, VISION_EOS, IMAGE, VIDEO,
                    AUDIO, AUDIO_BOS, AUDIO_EOS),
    extra_special_tokens={"audio_token": AUDIO, "video_token": VIDEO, "vision_bos_token": VISION_BOS, "vision_eos_token": VISION_EOS,
                          "audio_bos_token": AUDIO_BOS, "audio_eos_token": AUDIO_EOS},
    config_token_ids={"image_token_id": IMAGE, "video_token_id": VIDEO, "audio_token_id": AUDIO,
                      "audio_start_token_id": AUDIO_BOS, "audio_end_token_id": AUDIO_EOS,
                      "vision_start_token_id": VISION_BOS, "vision_end_token_id": VISION_EOS},
    image_processor_class="Qwen2VLImageProcessor",
    video_processor_class="Qwen2VLVideoProcessor",
    tiny_preset="tiny-qwen3-omni",
    notes="Qwen3-Omni's thinker: audio + images + videos + text (no speech output, no audio-in-video); MoE decoder; two "
          "encoders, both the `vision` part.",
))
