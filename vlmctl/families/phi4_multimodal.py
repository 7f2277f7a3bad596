"""Phi-4-multimodal: a SigLIP-style image encoder over dynamic-HD crops, a conformer audio encoder and a Phi-3-style
LLM in `Phi4MultimodalForCausalLM` (Microsoft 2025, https://arxiv.org/abs/2503.01743). Images, audio and text.

Module paths (transformers 5.24, checked by tests/unit/test_family_phi4_multimodal.py):

| part                                       | path                                                         |
|--------------------------------------------|--------------------------------------------------------------|
| image encoder (`image`, the `vision` part) | model.embed_tokens_extend.image_embed.img_processor          |
| audio encoder (`audio`, the `vision` part) | model.embed_tokens_extend.audio_embed.encoder                |
| projector                                  | model.embed_tokens_extend.image_embed.img_projection_up /    |
|                                            | _down, model.embed_tokens_extend.audio_embed.up_proj_for_... |
|                                            | / down_proj_for_... (`speech` and `vision_speech` pairs)      |
| language model                             | model                                                        |
| lm head                                    | lm_head                                                      |

Two encoders (`encoders`, in forward order: the model embeds images before audio): the image encoder (SigLIP-style,
its `Phi4MultimodalVisionEncoderLayer`s) and the conformer audio encoder (its
`Phi4MultimodalAudioConformerEncoderLayer`s). Each is the `vision` part (`train.freeze: [vision]` and the `align` /
`finetune` stages freeze both; `full` trains both) and each block of both is an FSDP2 / activation-checkpointing
unit. Each encoder's projections into the LLM are the projector. The language model's path is the whole `model`
(its decoder layers, embeddings and both encoders live under it): the image embedding's two learned separators
(`global_img_feature_extensor`, `sub_img_feature_extensor`) count as the `llm` part. FSDP2 and checkpointing wrap
each `Phi4MultimodalDecoderLayer`.

Images (transformers 5.24, src/transformers/models/phi4_multimodal/image_processing_phi4_multimodal.py,
`Phi4MultimodalImageProcessor.dynamic_preprocess` / `_preprocess`): an image of W x H px is resized to fit a grid of
(w, h) crops of S px (S = `size.height`), w = ceil(W / S), h = ceil(H / S), or, when w x h exceeds `dynamic_hd`, the
grid among those of at most `dynamic_hd` crops whose aspect ratio is closest; it keeps its aspect ratio and is padded
white at the right or bottom; a mask of S / p patches a side per crop marks the padding (p = `patch_size`). The crops
and a global S x S view go through the encoder; each crop becomes (S / 2p)^2 tokens (2 x 2 average pooling), and the
image
    256 + 1 + m + r + 16      `<|image|>` tokens,
with m the unmasked entries of the mask sampled every second patch and r those of its first column (the row
separators). The 256 and 16 are the global view's tokens and separators as transformers writes them for S / p = 32
(the published 448 px crops of 14 px patches), so a preset must keep S / p = 32 (`preset_processor` refuses another).
That image processor needs torchvision; `Phi4ImageProcessor` is the same computation on PIL / numpy / torch (resizes
with torch's bilinear antialiased and bicubic kernels, as torchvision's tensor resize runs them), saved under the real
class's name so a machine with torchvision loads transformers' own.

Audio (feature_extraction_phi4_multimodal.py, `Phi4MultimodalFeatureExtractor`): a clip of s samples at 16 kHz gives
F = (s - win_length) // hop_length + 1 log-mel frames (400 and 160) and ceil(ceil(F / compression) / downsample)
`<|audio|>` tokens (8 and 1 in the published extractor, the encoder's `time_reduction`). The encoder adds its padding
mask to the attention scores as 0 / 1 instead of -inf / 0 (`Phi4MultimodalAudioModel.forward`), so padded frames
change a clip's features: vlmctl's processor (`phi4_processor_class`) pads every clip to the same window (`max_length`
samples, the preset's `audio_window_seconds`; longer clips are cut) and always returns `audio_attention_mask`, so a
clip encodes the same alone and in any batch, and clips of different samples concatenate along dim 0.

FLOPs: each encoder by its own cost rule (`phi4_image_cost`: crops, the unused layers and the pooling head
forward only; `phi4_audio_cost`: the conformer's subsampling, blocks and causal convolutions), which
`vlmctl.train.flops.CostModel` adds to the language model's terms.

Config: `Phi4MultimodalConfig` takes the text settings at its top level and reads the image / audio token ids from
`vision_config` / `audio_config`; `config_kwargs` lays a preset's `config:` out so.

Packed rows (`supports_packing=True`): a packed row [1, T] of several samples, with per-sample position ids and
`packed_cu_seqlens` and no attention mask (`vlmctl.data.collate.PackedCollator`), goes through
`Phi4MultimodalForCausalLM` as it is (the language model builds the per-sample causal mask from the position ids, or
hands `packed_cu_seqlens` to the varlen kernel; the class's forward takes `logits_to_keep` as an index tensor; the
images' and the clips' features fill their placeholder tokens in row order), except for the audio projection: the
class picks one pair per forward (`Phi4MultimodalFeatureEmbedding.forward`: `_for_vision_speech` when
`image_pixel_values` is given, else `_for_speech`), so a sample's clips would be projected by its row-mates' images.
`position_hook` (which training calls with the model exactly when rows are packed) installs
`per_sample_audio_projection`: the inner model's forward embeds a packed row holding both `<|image|>` and `<|audio|>`
tokens with `packed_embeddings`, which encodes all clips in one call, as the class does, and projects each clip by
the pair its own sample would choose alone (`_for_vision_speech` exactly when that sample holds an `<|image|>`
token); any other input (a row of one pair, padded batches, generation) runs the class's own code. The rotary
embedding makes a second per-forward choice: under LongRoPE (the published `rope_type: longrope`) transformers'
`longrope_frequency_update` switches to the long factors when the largest position id exceeds
`original_max_position_embeddings`, which in a packed row is the longest sample's length; the hook's
`per_sample_rope` computes a packed row's cos / sin sample by sample, so each sample's factors follow its own length.
A packed row thus gives each sample the logits it has alone. Padded batches keep transformers' per-batch choice of
the audio pair, as vanilla transformers runs them. Not per sample, by design: in training mode the conformer draws
one random streaming-chunk offset per forward (`Phi4MultimodalAudioModel`; training-time randomness of the clips'
chunk boundaries, none in eval mode).
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from vlmctl.errors import ModelError
from vlmctl.families.encoders import EncoderSpec, submodule
from vlmctl.families.qwen2_audio import resampled_length
from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, setting

# numpy, torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's
# start-up) must not pay for them.

IMAGE, AUDIO = "<|image|>", "<|audio|>"
"""Placeholder tokens the processor repeats per image token and audio token (transformers' converted Phi-4 tokenizer)."""
MASK_SIDE = 32
"""Patches a side of one crop for which transformers' image-token count holds (S / p, module docstring)."""
PUBLISHED_IMAGE = {"size": 448, "patch_size": 14, "dynamic_hd": 36}
"""The published image processor's settings, assumed when counting from a model config."""
PUBLISHED_AUDIO = {"sampling_rate": 16_000, "hop_length": 160, "win_length": 400, "audio_compression_rate": 8,
                   "audio_downsample_rate": 1, "audio_feat_stride": 1}
"""The published feature extractor's settings."""


# --------------------------------------------------------------------------------------------------------------------
# Token rules
# --------------------------------------------------------------------------------------------------------------------


def crop_grid(width: int, height: int, size: int, max_crops: int) -> tuple[int, int]:
    """(crops across, crops down) of a `width` x `height` px image under `Phi4MultimodalImageProcessor.dynamic_preprocess`
    with crops of `size` px and at most `max_crops` crops (module docstring)."""
    across, down = math.ceil(width / size), math.ceil(height / size)
    if across * down <= max_crops:
        return across, down
    ratios = sorted({(i, j) for n in range(1, max_crops + 1) for i in range(1, n + 1) for j in range(1, n + 1) if i * j <= max_crops},
                    key=lambda r: r[0] * r[1])
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for ratio in ratios:  # transformers' find_closest_aspect_ratio, ties to the larger grid the image fills half of
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and width * height > 0.5 * size * size * ratio[0] * ratio[1]:
            best = ratio
    return best


def crop_layout(width: int, height: int, size: int, patch: int, max_crops: int):
    """((crops across, down), (resized width, height), patch mask [down x S/p, across x S/p] as a numpy bool array) of
    one image (module docstring). Raises ValueError for an image too thin to resize (transformers' own check)."""
    import numpy as np

    across, down = crop_grid(width, height, size, max_crops)
    target_w, target_h = size * across, size * down
    if target_w / width < target_h / height:
        new_w, new_h = target_w, int(height * target_w / width)
    else:
        new_w, new_h = int(width * target_h / height), target_h
    side = size // patch
    mask = np.ones((side * down, side * across), dtype=bool)
    pad_w, pad_h = target_w - new_w, target_h - new_h
    if pad_w >= patch:
        mask[:, -(pad_w // patch):] = False
    if pad_h >= patch:
        mask[-(pad_h // patch):, :] = False
    if min(new_h, target_h) < 10 or min(new_w, target_w) < 10:
        raise ValueError(f"the aspect ratio is very extreme {(new_w, new_h)}")
    return (across, down), (new_w, new_h), mask


def image_tokens(width: int, height: int, *, size: int, patch: int, max_crops: int) -> int:
    """`<|image|>` tokens of one `width` x `height` px image: 256 + 1 + m + r + 16 (module docstring)."""
    _, _, mask = crop_layout(int(width), int(height), size, patch, max_crops)
    sampled = mask[0::2, 0::2]
    return 256 + 1 + int(sampled.sum()) + int(sampled[:, 0].sum()) + 16


def image_settings(source: Any) -> dict[str, int]:
    """{size, patch_size, dynamic_hd} of the image processor behind `source` (a processor, an image processor, a dict
    of its settings), or the published ones for a model config."""
    if setting(source, "vision_config") is not None:
        return dict(PUBLISHED_IMAGE)
    image = setting(source, "image_processor", default=source)
    size = setting(image, "size", default={"height": PUBLISHED_IMAGE["size"]})
    height = size.get("height") if isinstance(size, dict) else getattr(size, "height", None)
    return {"size": int(height or PUBLISHED_IMAGE["size"]), "patch_size": int(setting(image, "patch_size", default=14)),
            "dynamic_hd": int(setting(image, "dynamic_hd", default=36))}


def phi4_image_rule(width: int, height: int, source: Any) -> int:
    """The visual-token rule (`FamilySpec.visual_token_rule`): `image_tokens` under `image_settings(source)`."""
    s = image_settings(source)
    return image_tokens(width, height, size=s["size"], patch=s["patch_size"], max_crops=s["dynamic_hd"])


def audio_tokens(samples: int, *, hop_length: int = 160, win_length: int = 400, audio_compression_rate: int = 8,
                 audio_downsample_rate: int = 1, audio_feat_stride: int = 1, **_: Any) -> int:
    """`<|audio|>` tokens of a clip of `samples` samples at the extractor's rate (module docstring)."""
    frames = ((int(samples) - win_length) // hop_length + 1) * audio_feat_stride
    return -(-(-(-frames // audio_compression_rate)) // audio_downsample_rate)


# --------------------------------------------------------------------------------------------------------------------
# The processor
# --------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def image_processor_class():
    """`Phi4ImageProcessor`: transformers' `Phi4MultimodalImageProcessor` on the PIL backend (module docstring).
    Returns the class (built on first use: it subclasses transformers' `PilBackend`)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers.feature_extraction_utils import BatchFeature
    from transformers.image_processing_backends import PilBackend
    from transformers.processing_utils import ImagesKwargs

    class Phi4ImageProcessorKwargs(ImagesKwargs, total=False):
        patch_size: int
        dynamic_hd: int

    class Phi4ImageProcessor(PilBackend):
        """Images -> `image_pixel_values` [N, 1 + max crops, 3, S, S] (the global view first, missing crops zero),
        `image_sizes` [N, 2] (the padded image's height and width, px), `image_attention_mask` [N, 1 + max crops,
        S/p, S/p] and `num_img_tokens` (a list), as transformers' torchvision processor returns them."""

        resample = 3  # bicubic, for the global view
        size = {"height": 448, "width": 448}
        patch_size = 14
        dynamic_hd = 36
        image_mean = [0.5, 0.5, 0.5]
        image_std = [0.5, 0.5, 0.5]
        do_rescale = True
        do_normalize = True
        do_convert_rgb = True
        valid_kwargs = Phi4ImageProcessorKwargs
        model_input_names = ["image_pixel_values", "image_sizes", "image_attention_mask"]

        def _preprocess(self, images, size, patch_size, dynamic_hd, rescale_factor=1 / 255, image_mean=None, image_std=None,
                        return_tensors=None, **kwargs):
            if size.height != size.width:
                raise ValueError("Phi4MultimodalImageProcessor only supports square sizes.")
            side, n = size.height, size.height // patch_size
            mean = torch.tensor(image_mean if image_mean is not None else self.image_mean).view(3, 1, 1)
            std = torch.tensor(image_std if image_std is not None else self.image_std).view(3, 1, 1)
            crops, masks, tokens, sizes = [], [], [], []
            for image in images:  # numpy [3, H, W] uint8
                pixels = torch.from_numpy(np.ascontiguousarray(image)).float()
                height, width = pixels.shape[-2:]
                (across, down), (new_w, new_h), mask = crop_layout(width, height, side, patch_size, dynamic_hd)
                resized = F.interpolate(pixels[None], size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)[0]
                resized = resized.round().clamp(0, 255)
                canvas = torch.full((3, side * down, side * across), 255.0)
                canvas[:, :new_h, :new_w] = resized
                normed = (canvas * rescale_factor - mean) / std
                view = F.interpolate(normed[None], size=(side, side), mode="bicubic", align_corners=False, antialias=False)[0]
                tiles = normed.reshape(3, down, side, across, side).permute(1, 3, 0, 2, 4).reshape(-1, 3, side, side)
                mask_t = torch.from_numpy(mask).float()
                mask_tiles = mask_t.reshape(down, n, across, n).transpose(1, 2).reshape(-1, n, n)
                crops.append(torch.cat([view[None], tiles]))
                masks.append(torch.cat([torch.ones(1, n, n), mask_tiles]))
                tokens.append(image_tokens(width, height, size=side, patch=patch_size, max_crops=dynamic_hd))
                sizes.append([side * down, side * across])
            most = max(c.shape[0] for c in crops)
            pixel_values = torch.stack([torch.cat([c, c.new_zeros(most - c.shape[0], *c.shape[1:])]) for c in crops])
            attention = torch.stack([torch.cat([m, m.new_ones(most - m.shape[0], n, n)]) for m in masks])
            data = {"image_pixel_values": pixel_values, "image_sizes": torch.tensor(sizes, dtype=torch.long),
                    "image_attention_mask": attention, "num_img_tokens": tokens}
            return BatchFeature(data=data, tensor_type=return_tensors)

    Phi4ImageProcessor.__name__ = Phi4ImageProcessor.__qualname__ = "Phi4MultimodalImageProcessor"
    return Phi4ImageProcessor


@lru_cache(maxsize=None)
def phi4_processor_class(cls):
    """`cls` (`Phi4MultimodalProcessor`) whose feature extractor pads every clip to `audio_window` samples (cutting
    longer ones) and whose outputs always hold `audio_attention_mask` (module docstring); its `audio_processor` is
    also its `feature_extractor`, where vlmctl's audio unit reads the sampling rate. Saved under the real class's
    name, with `audio_window` in its processor_config.json."""

    class Phi4WindowProcessor(cls):
        def __init__(self, image_processor=None, audio_processor=None, tokenizer=None, audio_window: int = 16_000 * 30, **kwargs):
            super().__init__(image_processor, audio_processor, tokenizer, **kwargs)
            self.audio_window = int(audio_window)

        @property
        def feature_extractor(self):
            """The audio processor under the name code handling any audio processor reads (its rate, its settings)."""
            return self.audio_processor

        def __call__(self, *args: Any, audio: Any = None, **kwargs: Any):
            if audio is None:
                return super().__call__(*args, **kwargs)
            # cut here: the extractor counts a clip's tokens from its length before its own truncation
            clips = [a[: self.audio_window] for a in (audio if isinstance(audio, (list, tuple)) else [audio])]
            audio_kwargs = {**kwargs.pop("audio_kwargs", {}), "padding": "max_length", "max_length": self.audio_window}
            if "padding" in kwargs:  # the text's padding (a batch of prompts), not the clips' window
                kwargs["text_kwargs"] = {**kwargs.pop("text_kwargs", {}), "padding": kwargs.pop("padding")}
            out = super().__call__(*args, audio=clips, audio_kwargs=audio_kwargs, **kwargs)
            if "audio_input_features" in out and out.get("audio_attention_mask") is None:
                import torch

                frames = out["audio_input_features"].shape[1]
                lengths = [len(a) for a in clips]
                fe = self.audio_processor
                valid = torch.tensor([(n - fe.win_length) // fe.hop_length + 1 for n in lengths]) * fe.audio_feat_stride
                out["audio_attention_mask"] = torch.arange(frames)[None, :] < valid[:, None]
            return out

    Phi4WindowProcessor.__name__ = Phi4WindowProcessor.__qualname__ = cls.__name__
    return Phi4WindowProcessor


# --------------------------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------------------------


def _matrices(modules) -> int:
    """Parameters of the weight matrices and kernels of `modules` (biases, norm scales and embeddings excluded)."""
    import torch

    return sum(p.numel() for m in modules for p in m.parameters() if p.ndim >= 2 and not isinstance(m, torch.nn.Embedding))


@dataclass(frozen=True)
class Phi4ImageShape:
    """What the image encoder and its projection cost (`phi4_image_cost` reads it off the model) and their FLOPs per
    micro-batch: a cost rule's result that `vlmctl.train.flops.CostModel` adds as it is (a `CountsItself`:
    `paths`, `batch_terms`, `sample_terms`).
    Forward FLOPs, matmuls only, as `torch.utils.flop_counter` counts them (transformers 5.24,
    `Phi4MultimodalImageEmbedding.forward`): every crop of `image_pixel_values` [N, crops, 3, S, S] (padding crops
    included: the encoder runs them) at P = (S / p)^2 positions: the patch embedding and the layers (2 x matrices x
    P), attention 4 x d x P^2 per layer; the layers after `feature_layer` and the pooling head run forward only
    (their output is not used); the two projections on the image tokens (the batch's `<|image|>` count).

    Backward factors are the cost model's (the encoder is the `vision` part, its patch embedding reads the pixels;
    the projections the projector), except that the first projection's input gradient is also needed when the
    language model's weights are trained: the two learned separators concatenated to its input
    (`global_img_feature_extensor`, `sub_img_feature_extensor`) are `llm` parameters."""

    paths: tuple[str, ...]  # the image embedding: the encoder, the separators and both projections
    image_token_id: int
    patches: int  # P, positions per crop
    width: int
    layers: int
    used_layers: int  # up to `feature_layer`
    patch_embed: int
    layer: int  # one layer's matrices
    head_kv: int  # the pooling head's key and value projections (run at P positions)
    head_one: int  # its other matrices (run at one position: the probe)
    proj: tuple[int, int]  # img_projection_up, img_projection_down

    def batch_terms(self, batch: Mapping[str, Any], cost: Any) -> dict[str, float]:
        """FLOPs of the images of one collated micro-batch as the `vision`, `vision_attention` and `projector`
        terms, under `cost`'s backward factors (a `vlmctl.train.flops.CostModel`). No images: no terms."""
        pixels, ids = batch.get("image_pixel_values"), batch["input_ids"]
        tokens = int((ids == self.image_token_id).sum())
        if pixels is None or not tokens:
            return {}
        return self._terms(int(pixels.shape[0]) * int(pixels.shape[1]), tokens, cost)

    def sample_terms(self, tokens, items, cost: Any) -> dict[str, Any]:
        """The `batch_terms` of N samples from their image tokens and images (float64 arrays [N]; `CountsItself`):
        an image of n tokens is taken as the global view and ceil((n - 273) / 272) crops (a crop holds 256 tokens
        and its row one 16-token separator, module docstring). The zero crops that pad every image to 1 +
        `dynamic_hd` in a batch are not counted: that bound is a processor setting the model does not hold."""
        import numpy as np

        tokens, items = np.asarray(tokens, dtype=np.float64), np.asarray(items, dtype=np.float64)
        per_image = np.divide(tokens, items, out=np.zeros_like(tokens), where=items > 0)
        side = MASK_SIDE // 2  # tokens a side of one crop after the 2 x 2 pooling
        crops = np.maximum(np.ceil((per_image - (side * side + side + 1)) / (side * side + side)), 1)
        return self._terms(items * (1 + crops), tokens, cost)

    def _terms(self, crops, tokens, cost: Any) -> dict[str, Any]:
        """The terms of `crops` crops through the encoder and `tokens` image tokens through the projections
        (scalars, or numpy arrays elementwise)."""
        P, d, unused = self.patches, self.width, self.layers - self.used_layers
        vision = crops * (cost.weight_factor("vision", input_layer=True) * self.patch_embed * P
                          + cost.weight_factor("vision") * self.layer * P * self.used_layers
                          + 2 * self.layer * P * unused + 2 * (self.head_kv * P + self.head_one))
        attention = crops * 4.0 * d * (P * P * (cost.attention_factor("vision") * self.used_layers + unused) + P)
        into = "vision" in cost.grad_through or "llm" in cost.trained  # the first projection's input gradient
        up = 2 + 2 * into + 2 * ("projector" in cost.trained)
        down = 2 + 2 * (into or "projector" in cost.trained) + 2 * ("projector" in cost.trained)
        return {"vision": vision, "vision_attention": attention, "projector": (up * self.proj[0] + down * self.proj[1]) * tokens}


@dataclass(frozen=True)
class Phi4ImageCost:
    """The cost rule of Phi-4-multimodal's image encoder (`phi4_image_cost`); called as `rule(model, encoder)`."""

    def __call__(self, model: Any, encoder: Any) -> Phi4ImageShape:
        embed_path = encoder.path.rsplit(".", 1)[0]  # the image embedding around the encoder
        embed, tower = submodule(model, embed_path), submodule(model, encoder.path)
        v = getattr(model.config, encoder.config_key)
        width, layers, feature = int(v.hidden_size), int(v.num_hidden_layers), int(v.feature_layer)
        return Phi4ImageShape(
            paths=(embed_path,), image_token_id=int(v.image_token_id), patches=(int(v.image_size) // int(v.patch_size)) ** 2,
            width=width, layers=layers, used_layers=feature if feature >= 0 else layers + 1 + feature,
            patch_embed=_matrices([tower.embeddings.patch_embedding]), layer=_matrices([tower.encoder.layers[0]]),
            head_kv=2 * width * width, head_one=_matrices([tower.head]) - 2 * width * width,
            proj=(_matrices([embed.img_projection_up]), _matrices([embed.img_projection_down])))


def phi4_image_cost() -> Phi4ImageCost:
    """The cost rule of the image encoder (`Phi4ImageShape`), read from the model (any device, meta included) and
    `model.config.vision_config`. Picklable."""
    return Phi4ImageCost()


@dataclass(frozen=True)
class Phi4AudioShape:
    """What the conformer audio encoder and its projection cost (`phi4_audio_cost` reads it off the model) and their
    FLOPs per micro-batch, added by `vlmctl.train.flops.CostModel` as they are (`paths`, `batch_terms`). Forward FLOPs,
    matmuls only (transformers 5.24, `Phi4MultimodalAudioModel.forward`, `Phi4MultimodalAudioEmbedding.forward`):
    `audio_input_features` [B, T, mel bins]: the subsampling convolutions at their output positions, its output
    layer and each conformer block's linear layers and pointwise convolutions at T' = T / time_reduction positions
    per clip, the depthwise convolution and the pointwise one after it at T' + k - 1 (its causal padding),
    attention 4 x d x T'^2 per block; the projections at T' positions (one pair per clip: `_for_vision_speech` when
    the batch has images, in a packed row when the clip's own sample has one; both pairs have the same sizes). Backward factors are the cost model's (the encoder is the `vision` part, its
    first convolution reads the mel features; the projections the projector). A `CountsItself` (`paths`,
    `batch_terms`, `sample_terms`)."""

    paths: tuple[str, ...]  # the audio embedding: the encoder and both projection pairs
    audio_token_id: int
    mel_bins: int  # the encoder's input features per frame (`input_size`)
    width: int
    blocks: int
    kernel: int
    subsampling: tuple[tuple[int, int, int, int], ...]  # per convolution: (kernel parameters, stride, span, padding)
    sub_out: int
    block_causal: int  # a block's depthwise-separable convolution (runs at T' + k - 1 positions)
    block_rest: int
    proj: tuple[int, int]  # up, down

    def batch_terms(self, batch: Mapping[str, Any], cost: Any) -> dict[str, float]:
        """FLOPs of the clips of one collated micro-batch as the `audio`, `audio_attention` and `projector` terms,
        under `cost`'s backward factors. No clips (or no `<|audio|>` token): no terms."""
        features = batch.get("audio_input_features")
        if features is None or not bool((batch["input_ids"] == self.audio_token_id).any()):
            return {}  # the model skips its clips without audio tokens
        clips, t, m = (int(x) for x in features.shape)
        return self._terms(clips, t, m, cost)

    def sample_terms(self, tokens, items, cost: Any) -> dict[str, Any]:
        """The `batch_terms` of N samples from their audio tokens and clips (float64 arrays [N]; `CountsItself`): a
        clip of n tokens is taken as n x the subsampling's strides frames (one token per subsampled frame, the
        extractor's compression being the encoder's time reduction, as `preset_processor` checks). Clips are padded
        to the processor's window in a batch; that window is a processor setting the model does not hold, so a
        clip counts its own length."""
        import numpy as np

        tokens, items = np.asarray(tokens, dtype=np.float64), np.asarray(items, dtype=np.float64)
        per_clip = np.divide(tokens, items, out=np.zeros_like(tokens), where=items > 0)
        strides = math.prod(stride for _, stride, _, _ in self.subsampling if stride > 1)
        return self._terms(items, per_clip * strides, self.mel_bins, cost)

    def _terms(self, clips, t, m, cost: Any) -> dict[str, Any]:
        """The terms of `clips` clips of `t` frames of `m` mel bins each (scalars, or numpy arrays elementwise)."""
        first, rest = cost.weight_factor("vision", input_layer=True), cost.weight_factor("vision")
        flops = 0
        for i, (numel, stride, span, pad) in enumerate(self.subsampling):
            if stride > 1:
                t, m = (t + 2 * pad - span) // stride + 1, (m + 2 * pad - span) // stride + 1
            flops += (first if i == 0 else rest) * numel * t * m
        flops += rest * ((self.sub_out + self.blocks * self.block_rest) * t + self.blocks * self.block_causal * (t + self.kernel - 1))
        proj = cost.weight_factor("projector", input_layer=True) * self.proj[0] + cost.weight_factor("projector") * self.proj[1]
        return {"audio": clips * flops, "audio_attention": clips * cost.attention_factor("vision") * 4.0 * self.width * self.blocks * t * t,
                "projector": clips * proj * t}


@dataclass(frozen=True)
class Phi4AudioCost:
    """The cost rule of Phi-4-multimodal's audio encoder (`phi4_audio_cost`); called as `rule(model, encoder)`."""

    def __call__(self, model: Any, encoder: Any) -> Phi4AudioShape:
        embed_path = encoder.path.rsplit(".", 1)[0]  # the audio embedding around the encoder
        embed, tower = submodule(model, embed_path), submodule(model, encoder.path)
        a = getattr(model.config, encoder.config_key)
        block = tower.encoders[0]
        causal = _matrices([block.conv.dw_sep_conv_1d])
        return Phi4AudioShape(
            paths=(embed_path,), audio_token_id=int(a.audio_token_id), mel_bins=int(a.input_size), width=int(a.hidden_size), blocks=int(a.num_blocks), kernel=int(a.kernel_size),
            subsampling=tuple((m.weight.numel(), m.stride[0], m.kernel_size[0], m.padding[0]) for m in tower.embed.conv if hasattr(m, "weight")),
            sub_out=_matrices([tower.embed.out]), block_causal=causal, block_rest=_matrices([block]) - causal,
            proj=(_matrices([embed.up_proj_for_speech]), _matrices([embed.down_proj_for_speech])))


def phi4_audio_cost() -> Phi4AudioCost:
    """The cost rule of the conformer audio encoder (`Phi4AudioShape`), read from the model (any device, meta
    included) and `model.config.audio_config`. Picklable."""
    return Phi4AudioCost()


# --------------------------------------------------------------------------------------------------------------------
# Packed rows: each sample's audio projected as it is alone
# --------------------------------------------------------------------------------------------------------------------


def per_sample_audio_projection(model: Any, path: str = "model") -> bool:
    """Give the inner `Phi4MultimodalModel` at `path` of `model` (a `Phi4MultimodalForCausalLM`, unwrapped) a forward
    that embeds a packed row's media per sample (`_forward_per_sample_audio`, module docstring), in place: an instance
    attribute, so wrappers applied later (peft, FSDP2, DDP, DeepSpeed) call it through their own forward and hooks.
    Idempotent; returns False when it was there already."""
    inner = submodule(model, path)
    if getattr(inner.forward, "__func__", None) is _forward_per_sample_audio:
        return False
    inner.forward = types.MethodType(_forward_per_sample_audio, inner)
    return True


def per_sample_rope(model: Any, path: str = "model") -> bool:
    """Give the rotary embedding of the inner `Phi4MultimodalModel` at `path` of `model` a forward that computes a
    packed row's cos / sin one sample at a time (`_rope_per_sample`, module docstring), in place (an instance
    attribute, as `per_sample_audio_projection`). Idempotent; returns False when it was there already."""
    rotary = submodule(model, path).rotary_emb
    if getattr(rotary.forward, "__func__", None) is _rope_per_sample:
        return False
    rotary.forward = types.MethodType(_rope_per_sample, rotary)
    return True


def _rope_per_sample(self, x: Any, position_ids: Any):
    """`Phi4MultimodalRotaryEmbedding.forward` (transformers 5.24) of `self`; under LongRoPE (whose factors
    transformers' `dynamic_rope_update` picks from the largest position id alone) and for a packed row (position ids
    [1, T] starting at 0 and restarting at 0 per sample), the class's forward on each sample's positions,
    concatenated: each sample's factors chosen by its own length. Returns (cos, sin), each [1, T, rotary dim] in
    `x`'s dtype."""
    import torch

    forward = type(self).forward
    if self.rope_type != "longrope" or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return forward(self, x, position_ids)
    starts = torch.nonzero(position_ids[0] == 0).squeeze(1).tolist()
    if len(starts) < 2 or starts[0] != 0:  # one sample, or not a packed row from its start: the class's one choice
        return forward(self, x, position_ids)
    bounds = [*starts, position_ids.shape[1]]
    pieces = [forward(self, x, position_ids[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat([cos for cos, _ in pieces], dim=1), torch.cat([sin for _, sin in pieces], dim=1)


def _forward_per_sample_audio(self, input_ids: Any = None, inputs_embeds: Any = None, image_pixel_values: Any = None,
                              image_sizes: Any = None, image_attention_mask: Any = None, audio_input_features: Any = None,
                              audio_embed_sizes: Any = None, audio_attention_mask: Any = None, **kwargs: Any):
    """`Phi4MultimodalModel.forward` (transformers 5.24) of `self`, except for a packed row [1, T] (`packed_cu_seqlens`
    int32 [S + 1] in `kwargs`) holding both `<|image|>` and `<|audio|>` tokens: its input embeddings are then
    `packed_embeddings` (each clip projected by its own sample's pair) and the class's forward runs on them. Any
    other input (padded batches, generation, a row without images or without audio) goes to the class's forward as
    it is. Returns the class's `BaseModelOutputWithPast`."""
    media = dict(image_pixel_values=image_pixel_values, image_sizes=image_sizes, image_attention_mask=image_attention_mask,
                 audio_input_features=audio_input_features, audio_embed_sizes=audio_embed_sizes,
                 audio_attention_mask=audio_attention_mask)
    cu = kwargs.get("packed_cu_seqlens")
    if (cu is not None and input_ids is not None and inputs_embeds is None and image_pixel_values is not None
            and audio_input_features is not None):
        inputs_embeds = packed_embeddings(self, input_ids, cu, **media)
        input_ids, media = None, {}
    return type(self).forward(self, input_ids=input_ids, inputs_embeds=inputs_embeds, **media, **kwargs)


def packed_embeddings(inner: Any, input_ids: Any, cu_seqlens: Any, *, image_pixel_values: Any, image_sizes: Any,
                      image_attention_mask: Any, audio_input_features: Any, audio_embed_sizes: Any,
                      audio_attention_mask: Any) -> Any:
    """Input embeddings [1, T, hidden] of one packed row `input_ids` [1, T] of the samples bounded by `cu_seqlens`
    (int [S + 1], cumulative tokens) for the inner model `inner` (`Phi4MultimodalModel`): what
    `Phi4MultimodalFeatureEmbedding.forward` (transformers 5.24) computes, except that each clip goes through
    `_for_vision_speech` when its own sample holds an `<|image|>` token and `_for_speech` otherwise (the class picks
    one pair for the whole batch). The clips (`audio_input_features` [N, frames, mel bins], in row order, as the
    collator concatenates them) are encoded together in one call, as the class does; clip i fills the next
    `audio_embed_sizes[i]` `<|audio|>` positions of the row. Raises ValueError for more than one row."""
    import torch
    from torch import nn

    if input_ids.shape[0] != 1:
        raise ValueError(f"a packed row is one row, got input_ids of shape {tuple(input_ids.shape)}")
    extend, config = inner.embed_tokens_extend, inner.config
    image_id, audio_id = config.vision_config.image_token_id, config.audio_config.audio_token_id
    embeds = inner.embed_tokens(input_ids)
    ids = input_ids[0]
    is_image, is_audio = ids == image_id, ids == audio_id
    if not bool(is_image.any()) or not bool(is_audio.any()):  # one pair for every clip: the class's own code
        pixels = image_pixel_values if bool(is_image.any()) else None  # no sample holds an image: `_for_speech`
        return extend(input_ids, embeds, image_pixel_values=pixels, audio_input_features=audio_input_features,
                      image_sizes=image_sizes, image_attention_mask=image_attention_mask, audio_embed_sizes=audio_embed_sizes,
                      audio_attention_mask=audio_attention_mask)
    with torch.no_grad():
        cu = torch.as_tensor(cu_seqlens, device=ids.device).long()
        segment = torch.searchsorted(cu[1:], torch.arange(ids.shape[0], device=ids.device), right=True)  # [T]
        with_image = torch.zeros(cu.numel() - 1, dtype=torch.bool, device=ids.device)
        with_image[segment[is_image]] = True
        sizes = torch.as_tensor(audio_embed_sizes, device=ids.device).long().reshape(-1)
        audio_positions = torch.nonzero(is_audio, as_tuple=True)[0]
        first_token = torch.cumsum(sizes, 0) - sizes  # each clip's first token among the row's audio tokens
        clip_vision = with_image[segment[audio_positions[first_token]]]  # [N]

    image_embeds = extend.image_embed(input_ids, embeds, image_pixel_values=image_pixel_values, image_sizes=image_sizes,
                                      image_attention_mask=image_attention_mask)
    audio = extend.audio_embed
    dtype, device = audio.up_proj_for_speech.bias.dtype, audio.up_proj_for_speech.bias.device
    hidden = audio.encoder(audio_input_features.to(device=device, dtype=dtype), audio_attention_mask)  # [N, T', d]
    parts, order = [], []
    for vision, up, down in ((False, audio.up_proj_for_speech, audio.down_proj_for_speech),
                             (True, audio.up_proj_for_vision_speech, audio.down_proj_for_vision_speech)):
        index = torch.nonzero(clip_vision == vision, as_tuple=True)[0]
        if index.numel():  # a pair no clip uses stays out of the graph, as in the class's forward
            parts.append(down(nn.functional.gelu(up(hidden[index]))))
            order.append(index)
    projected = torch.cat(parts)[torch.argsort(torch.cat(order))]  # back to clip order
    merged = torch.cat([projected[i, : int(n)] for i, n in enumerate(sizes)]).to(dtype=embeds.dtype, device=embeds.device)
    audio_embeds = audio.drop(embeds.index_put((torch.zeros_like(audio_positions), audio_positions), merged))
    keep_image = is_image[None, :, None]
    return image_embeds * keep_image + audio_embeds * ~keep_image  # the class's merge


# --------------------------------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------------------------------


class Phi4MultimodalSpec(FamilySpec):
    """Phi-4-multimodal: images (dynamic-HD crops), audio (conformer), 1-D positions."""

    def num_audio_tokens(self, samples: int, sampling_rate: int, processor_or_config: Any) -> int:
        """`<|audio|>` tokens of one clip of `samples` samples at `sampling_rate` Hz (resampled to the extractor's rate
        first), cut at the processor's window (`processor_or_config`: the processor; a model config assumes the
        published extractor and no window). Returns a token count (module docstring)."""
        extractor = setting(processor_or_config, "audio_processor", default=processor_or_config)
        fe = {k: int(setting(extractor, k, default=v)) for k, v in PUBLISHED_AUDIO.items()}
        n = resampled_length(int(samples), int(sampling_rate), fe["sampling_rate"])
        window = setting(processor_or_config, "audio_window")
        return audio_tokens(min(n, int(window)) if window else n, **fe)

    def image_processor(self, **kwargs: Any):
        """`Phi4ImageProcessor` (transformers' computation without torchvision) with preset settings `kwargs`."""
        return image_processor_class()(**kwargs)

    def make_processor(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None, *,
                       audio_processor: Any = None, audio_window: int = 16_000 * 30, **kwargs: Any):
        """`Phi4MultimodalProcessor` over `image_processor`, `audio_processor` (a `Phi4MultimodalFeatureExtractor`; the
        published one where None) and `tokenizer`, clips padded to `audio_window` samples (`phi4_processor_class`)."""
        import transformers

        extractor = audio_processor if audio_processor is not None else transformers.Phi4MultimodalFeatureExtractor()
        extractor.n_samples = int(audio_window)  # the window, under the name Whisper-style extractors give it
        cls = phi4_processor_class(getattr(transformers, self.processor_class))
        return cls(image_processor=image_processor, audio_processor=extractor, tokenizer=tokenizer, chat_template=chat_template,
                   audio_window=audio_window)

    def image_only_processor(self, ref: str, *, trust_remote_code: bool = False):
        """The saved processor at `ref` with `Phi4ImageProcessor` and the window processor (module docstring)."""

        import transformers

        saved = json.loads((Path(ref) / "processor_config.json").read_text())  # a built folder (no Hub id without torchvision)
        image = image_processor_class()(**{k: v for k, v in saved["image_processor"].items() if k != "image_processor_type"})
        audio = transformers.Phi4MultimodalFeatureExtractor(**{k: v for k, v in saved["audio_processor"].items() if k != "feature_extractor_type"})
        tokenizer = transformers.AutoTokenizer.from_pretrained(ref, trust_remote_code=trust_remote_code)
        template = Path(ref) / "chat_template.jinja"
        return self.make_processor(tokenizer, image, template.read_text() if template.exists() else None, audio_processor=audio,
                                   audio_window=int(saved.get("audio_window", 16_000 * 30)))

    def preset_processor(self, tokenizer: Any, chat_template: str | None, kwargs: Mapping[str, Any], config: Mapping[str, Any]):
        """The processor of a preset: `processor:` settings `image` (image processor), `audio` (feature extractor) and
        `audio_window_seconds`. Raises ModelError when the crops are not 32 patches a side, or the extractor's
        compression is not the audio encoder's `time_reduction`."""
        import transformers

        image_kwargs, audio_kwargs = dict(kwargs.get("image") or {}), dict(kwargs.get("audio") or {})
        image = self.image_processor(**image_kwargs)
        audio = transformers.Phi4MultimodalFeatureExtractor(**audio_kwargs)
        side = int(image.size["height"]) // int(image.patch_size)
        if side != MASK_SIDE:
            raise ModelError(f"the preset's crops are {side} patches a side; Phi-4's image-token count holds for {MASK_SIDE}",
                             hint="set processor.image.size.height = 32 x processor.image.patch_size")
        reduction = int((config.get("audio_config") or {}).get("time_reduction", 8))
        if audio.audio_compression_rate != reduction:
            raise ModelError(f"the preset's audio_compression_rate is {audio.audio_compression_rate}, but its audio encoder "
                             f"reduces time by {reduction}", hint="set processor.audio.audio_compression_rate to audio_config.time_reduction")
        window = int(float(kwargs.get("audio_window_seconds", 30)) * audio.sampling_rate)
        return self.make_processor(tokenizer, image, chat_template, audio_processor=audio, audio_window=window)

    def config_kwargs(self, data: dict[str, Any]) -> dict[str, Any]:
        """`Phi4MultimodalConfig`'s layout: the text settings (`text_config` of the preset) at the top level, the image
        and audio token ids in `vision_config` and `audio_config` (where the model reads them)."""
        data = dict(data)
        # without a tokenizer (counting on the meta device) no published id may stay: they lie past a tiny vocabulary
        text = {"pad_token_id": None, "bos_token_id": None, **dict(data.pop("text_config", None) or {})}
        # kept at the top level as well, where code reading any family's config looks for them
        image_id, audio_id = data.get("image_token_id"), data.get("audio_token_id")
        vision, audio = dict(data.get("vision_config") or {}), dict(data.get("audio_config") or {})
        if image_id is not None:
            vision["image_token_id"] = image_id
        if audio_id is not None:
            audio["audio_token_id"] = audio_id
        return {**text, **data, "vision_config": vision, "audio_config": audio}

    def position_hook(self, model: Any, image_token_id: int | None) -> Callable[[dict], dict] | None:
        """None: the collator's (1, T) per-sample positions are right as they are. Training calls this hook with the
        model exactly when rows are packed (`vlmctl.train.setup.prepare_model`: after the attention backend is set,
        before peft and the parallel wrappers), so it also prepares the model for packed rows
        (`per_sample_audio_projection`: each sample's clips projected as if it were alone; `per_sample_rope`: each
        sample's LongRoPE factors chosen by its own length)."""
        per_sample_audio_projection(model, self.language_model)
        per_sample_rope(model, self.language_model)
        return None

    def processor_outputs(self, outputs: Mapping[str, Any], processor: Any) -> Mapping[str, Any]:
        """One sample's outputs with every image's crops padded to 1 + `dynamic_hd` (zero crops, masks of ones, as
        transformers pads within one call), so images of different samples concatenate along dim 0; the model reads
        only an image's own crops (`image_sizes`)."""
        pixels = outputs.get("image_pixel_values")
        if pixels is None:
            return outputs
        import torch

        most = 1 + int(processor.image_processor.dynamic_hd)
        extra = most - pixels.shape[1]
        if extra <= 0:
            return outputs
        mask = outputs["image_attention_mask"]
        return {**outputs,
                "image_pixel_values": torch.cat([pixels, pixels.new_zeros(pixels.shape[0], extra, *pixels.shape[2:])], dim=1),
                "image_attention_mask": torch.cat([mask, mask.new_ones(mask.shape[0], extra, *mask.shape[2:])], dim=1)}


PHI4_MULTIMODAL = register(Phi4MultimodalSpec(
    name="phi4_multimodal",
    model_types=("phi4_multimodal",),
    model_class="Phi4MultimodalForCausalLM",
    config_class="Phi4MultimodalConfig",
    processor_class="Phi4MultimodalProcessor",
    encoders={
        # one SigLIP-style tower over each image's crops; its MLP has no gate, its patch embedding is a Conv2d
        "image": EncoderSpec(path="model.embed_tokens_extend.image_embed.img_processor", modalities=("image",),
                             layer_classes=("Phi4MultimodalVisionEncoderLayer",), cost=phi4_image_cost(), kernels=(),
                             data_keys=("image_pixel_values", "image_sizes", "image_attention_mask")),
        "audio": EncoderSpec(path="model.embed_tokens_extend.audio_embed.encoder", modalities=("audio",),
                             layer_classes=("Phi4MultimodalAudioConformerEncoderLayer",), cost=phi4_audio_cost(), kernels=(),
                             data_keys=("audio_input_features", "audio_embed_sizes", "audio_attention_mask"),
                             config_key="audio_config", token_rule="num_audio_tokens"),
    },
    projector=("model.embed_tokens_extend.image_embed.img_projection_up", "model.embed_tokens_extend.image_embed.img_projection_down",
               "model.embed_tokens_extend.audio_embed.up_proj_for_speech", "model.embed_tokens_extend.audio_embed.down_proj_for_speech",
               "model.embed_tokens_extend.audio_embed.up_proj_for_vision_speech",
               "model.embed_tokens_extend.audio_embed.down_proj_for_vision_speech"),
    language_model="model",
    decoder_layer_classes=("Phi4MultimodalDecoderLayer",),
    modalities={"image": IMAGE, "audio": AUDIO},
    visual_token_rule=phi4_image_rule,
    supports_packing=True,
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", IMAGE, AUDIO),
    extra_special_tokens={"audio_token": AUDIO},
    config_token_ids={"image_token_id": IMAGE, "audio_token_id": AUDIO},
    image_processor_class="Phi4MultimodalImageProcessor",
    tiny_preset="tiny-phi4-multimodal",
    notes="Phi-4-multimodal: images (dynamic-HD crops) + audio + text; packed rows project each sample's audio by its own images.",
))
