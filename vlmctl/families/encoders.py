"""The encoders of a family: one `EncoderSpec` per encoder in front of the language model (a vision tower, an
audio tower), with what the rest of vlmctl needs of it, so that no module outside `vlmctl.families` reads a model's
attributes or a family's name to decide how to wrap, count, accelerate or feed it.

    for name, enc in family.encoders.items():            # "image", "audio", ...
        tower = model.get_submodule(enc.path)
        shape = enc.cost(model, enc)                      # VisionShape / AudioShape for the cost model
        enc.kernels                                       # GPU kernels train.kernels applies to it

An encoder spec holds:

- `path`: its module path on the loaded `*ForConditionalGeneration` model; `part`: the stage / freeze part its
  parameters belong to (`vision`: `train.freeze: [vision]` freezes every encoder, as `stage: finetune` does);
- `layer_classes`: its repeated blocks (class names): the FSDP2 / activation-checkpointing units (empty:
  discovered as the longest list of identical blocks);
- `modalities`: the content parts it encodes (an image encoder may also encode videos) and `data_keys`: the
  processor outputs that feed it (`pixel_values`, `image_grid_thw`, `input_features`, ...);
- `cost`: its cost rule, `(model, encoder) -> VisionShape | AudioShape | CountsItself`, what
  `vlmctl.train.flops.CostModel` counts its FLOPs from (`vision_cost`, `audio_cost`; a `CountsItself` result: an
  encoder the generic terms do not fit, which counts its own FLOPs per batch and per sample);
- `kernels`: the exact GPU kernels `vlmctl.train.kernels.apply_encoder_kernels` may apply to it (`KERNELS`),
  `varlen`: its attention takes per-image boundaries from flash-named implementations, `config_key` / `attention`:
  its sub-config and the attention it keeps under vlmctl's varlen kernel (`vlmctl.train.kernels.set_attention`),
  and `sequence_split`: its images can be spread over sequence-parallel ranks;
- `token_rule`: the family method giving the placeholder tokens of one item (`num_visual_tokens`,
  `num_video_tokens`, `num_audio_tokens`).

The shapes below are the cost rules' results; their formulas and sources are in `vlmctl.train.flops`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from vlmctl.errors import ModelError

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

CLS_VISION_TYPES = frozenset({"clip_vision_model", "clip", "vit", "dinov2", "chinese_clip_vision_model", "metaclip_2_vision_model"})
"""Vision encoder `model_type`s whose output starts with a CLS token (LLaVA's `default` strategy drops it)."""

KERNELS = ("aligned_mlp", "patch_embed_gemm", "compiled_rotary")
"""Encoder kernels `vlmctl.train.kernels` implements: the width-aligned gated MLP of each block, the patch
embedding as one GEMM (a Conv3d whose kernel equals its stride), the compiled vision rotary function."""

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "image_num_patches",
              "aspect_ratio_ids", "aspect_ratio_mask", "token_type_ids")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "video_second_per_grid")
"""Video tensors: patches, grids and seconds per temporal patch (Qwen2.5-VL's `second_per_grid_ts`, the Qwen-Omni
processors' `video_second_per_grid`), each [N, ...] per clip."""
AUDIO_KEYS = ("input_features", "feature_attention_mask")

WRAPPER_PREFIXES = ("", "base_model.model.", "_orig_mod.", "module.")
"""Prefixes peft (base_model.model.), torch.compile (_orig_mod.) and DDP (module.) put before module names."""


@dataclass(frozen=True, kw_only=True)
class EncoderSpec:
    """One encoder of a family (module docstring). Compared and hashed by value; pickles by value (module-level
    cost functions)."""

    path: str
    modalities: tuple[str, ...] = ("image",)
    part: str = "vision"
    layer_classes: tuple[str, ...] = ()
    data_keys: tuple[str, ...] = IMAGE_KEYS
    cost: Callable[..., Any] | None = None
    kernels: tuple[str, ...] = ("aligned_mlp",)
    varlen: bool = False
    # the model config's sub-config of this encoder, and the attention implementation the encoder keeps when the
    # language model runs vlmctl's varlen kernel (None: the language model's; `vlmctl.train.kernels.set_attention`)
    config_key: str = "vision_config"
    attention: str | None = "sdpa"
    token_rule: str = "num_visual_tokens"
    # under `train.sequence_parallel` the row's images are spread over the group's ranks
    # (`vlmctl.distributed.sequence.split_vision`): the tower takes all images' patches with their `grid_thw` and
    # returns the merged visual tokens as `pooler_output` (Qwen2-VL, Qwen2.5-VL)
    sequence_split: bool = False
    # the name of the function computing the grid-derived keyword arguments the tower takes precomputed, so the
    # decoding engine can replay its forward from a CUDA graph per image-grid layout
    # (`vlmctl.inference.encoder_graphs.GRID_INPUTS`; None: the tower always runs eagerly)
    graph_inputs: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.kernels) - set(KERNELS)
        if unknown:
            raise ModelError(f"encoder {self.path}: unknown kernels {sorted(unknown)}", hint=f"kernels are {', '.join(KERNELS)}")

    def shape(self, model: Any) -> Any:
        """The cost rule's shape of this encoder of `model` (unwrapped, any device), or None without a rule."""
        return None if self.cost is None else self.cost(model, self)


@runtime_checkable
class CountsItself(Protocol):
    """A cost rule's result for an encoder that counts its own FLOPs (its tower, its projections), where the generic
    terms of `VisionShape` / `AudioShape` do not fit it (Qwen3-Omni's chunked audio encoder, Phi-4-multimodal's crops
    and conformer). `vlmctl.train.flops.CostModel` leaves the parameters under `paths` out of its own counts and adds
    what the two methods return, keyed by `vlmctl.train.flops.TERMS`; `cost` is that cost model, whose backward
    factors (`weight_factor`, `attention_factor`, `trained`, `grad_through`) the encoder applies itself.

    - `paths`: the module paths whose parameters it charges (its encoder's, its projections');
    - `batch_terms(batch, cost) -> {term: FLOPs}`: one collated micro-batch (`vlmctl.data.collate` output);
    - `sample_terms(tokens, items, cost) -> {term: FLOPs}`: N samples from the counts a sampler has before
      collation (compute-balanced batching): `tokens`, the placeholder tokens of the sample's media of this encoder's
      modalities, and `items`, how many such media items it holds (float64 arrays [N]); elementwise, an estimate.
    """

    paths: tuple[str, ...]

    def batch_terms(self, batch: Mapping[str, Any], cost: Any) -> dict[str, float]: ...

    def sample_terms(self, tokens: np.ndarray, items: np.ndarray, cost: Any) -> dict[str, np.ndarray]: ...


def submodule(model: Any, path: str) -> Any:
    """`model.get_submodule(path)`, also under a wrapper prefix (`WRAPPER_PREFIXES`). Raises ModelError."""
    for prefix in WRAPPER_PREFIXES:
        try:
            return model.get_submodule(prefix + path)
        except AttributeError:
            continue
    raise ModelError(f"module {path} not found on {type(model).__name__}", hint="check model.family matches the checkpoint")


# --------------------------------------------------------------------------------------------------------------------
# Vision encoders
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageShape:
    """One image as the vision tower sees it: `patches` (t * h * w) and, when known, its patch grid (t, h, w)."""

    patches: int
    grid: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class VisionShape:
    """What a vision tower's costs depend on (`vision_cost` reads it from the config)."""

    width: int  # attention width d_v (heads x head_dim)
    layers: int
    full_layers: int  # layers attending over a whole frame; the others use windows
    patch_size: int
    merge: int  # patches a side merged into one visual token (1: none)
    window: int | None  # merged tokens a side of an attention window (Qwen2.5-VL), None: no windows
    cls: int  # extra positions per image in the tower (CLS token)
    patches_per_token: int  # patches per visual token (merge^2, or Idefics3 pixel shuffle scale^2)
    keep_cls: int  # visual tokens added per image by the CLS position (LLaVA `full` strategy)
    unused_layers: int = 0  # last layers whose output no feature is taken from (LLaVA `vision_feature_layer`)

    def attention_pairs(self, image: ImageShape) -> float:
        """Sum over the tower's layers of sum over attention blocks of s^2 (query-key pairs) for one image."""
        if image.grid is None:
            return self.count_pairs(image.patches)
        t, h, w = image.grid
        full = t * (image.patches // t + self.cls) ** 2
        if self.window is None:
            return self.layers * full
        # windows tile the merged-token grid; each holds merge^2 patches per token
        rows, cols = _window_sq(h // self.merge, self.window), _window_sq(w // self.merge, self.window)
        windowed = t * rows * cols * self.merge**4
        return self.full_layers * full + (self.layers - self.full_layers) * windowed

    def count_pairs(self, patches):
        """`attention_pairs` of one-frame images known by their patch count only: every window is taken as full.
        Elementwise over a numpy array of patch counts."""
        full = (patches + self.cls) ** 2
        if self.window is None:
            return self.layers * full
        side = self.window * self.merge
        windowed = patches * np.minimum(patches, side * side)
        return self.full_layers * full + (self.layers - self.full_layers) * windowed

    def visual_tokens(self, image: ImageShape) -> int:
        """Visual (placeholder) tokens one image becomes in the language model."""
        return image.patches // self.patches_per_token + self.keep_cls


@dataclass(frozen=True)
class VisionCost:
    """The cost rule of a ViT-style vision tower (see `vision_cost`); called as `rule(model, encoder)`."""

    config_key: str = "vision_config"
    merge: bool = False
    windows: bool = False
    pixel_shuffle: str | None = None
    feature_layer: bool = False
    cls_types: frozenset[str] | None = None

    def __call__(self, model: Any, encoder: EncoderSpec) -> VisionShape:
        config = model.config
        v = getattr(config, self.config_key)
        # Qwen2-VL calls the vision width embed_dim (its hidden_size is the language model's).
        width = getattr(v, "embed_dim", None) or getattr(v, "hidden_size", None)
        layers = getattr(v, "depth", None) or getattr(v, "num_hidden_layers", None)
        patch = getattr(v, "patch_size", None)
        if isinstance(patch, (list, tuple)):  # stored as [height, width] by some configs; square patches
            patch = patch[0]
        if not (width and layers and patch):
            raise ModelError(f"the {self.config_key} lacks hidden_size/depth/patch_size; cannot count its FLOPs",
                             hint="use a supported vision encoder config")
        m = int(getattr(v, "spatial_merge_size", None) or 1) if self.merge else 1
        shuffle = int(getattr(config, self.pixel_shuffle, None) or 1) if self.pixel_shuffle else 1
        window_px = getattr(v, "window_size", None) if self.windows else None
        window = int(window_px) // m // int(patch) if window_px else None
        full = set(getattr(v, "fullatt_block_indexes", None) or ()) if window else set(range(layers))
        has_cls = int(getattr(v, "model_type", None) in (CLS_VISION_TYPES if self.cls_types is None else self.cls_types))
        strategy = getattr(config, "vision_feature_select_strategy", None) if self.feature_layer else None
        unused = _unused_layers(getattr(config, "vision_feature_layer", None), int(layers)) if self.feature_layer else 0
        return VisionShape(width=int(width), layers=int(layers), full_layers=len(full & set(range(layers))),
                           patch_size=int(patch), merge=m, window=window or None, cls=has_cls,
                           patches_per_token=(m * shuffle) ** 2, keep_cls=has_cls if strategy == "full" else 0,
                           unused_layers=unused)


def vision_cost(*, config_key: str = "vision_config", merge: bool = False, windows: bool = False,
                pixel_shuffle: str | None = None, feature_layer: bool = False,
                cls_types: frozenset[str] | None = None) -> VisionCost:
    """The cost rule of a ViT-style vision tower configured by `model.config.<config_key>`: width (`embed_dim` or
    `hidden_size`), layers (`depth` or `num_hidden_layers`), `patch_size`. What differs between families is asked
    for explicitly:

    - `merge`: the tower's patch merger joins `spatial_merge_size`^2 neighbouring patches into one visual token
      (Qwen-VL, transformers `Qwen2_5_VLPatchMerger`);
    - `windows`: window attention (Qwen2.5-VL, `get_vision_window_index`): windows of `window_size` px in every
      layer except `fullatt_block_indexes`; a config without `window_size` attends over whole frames;
    - `pixel_shuffle`: the model config key of a pixel shuffle's scale (Idefics3's `scale_factor`): scale^2
      patches per visual token;
    - `feature_layer`: LLaVA's `vision_feature_layer` (layers after it run forward only) and
      `vision_feature_select_strategy: full` (the CLS position becomes a visual token too);
    - `cls_types`: vision `model_type`s whose output starts with a CLS token (default
      `CLS_VISION_TYPES`).

    The rule (a picklable `VisionCost`) raises ModelError when the config lacks width, depth or patch size.
    """
    return VisionCost(config_key=config_key, merge=merge, windows=windows, pixel_shuffle=pixel_shuffle,
                      feature_layer=feature_layer, cls_types=cls_types)


def _unused_layers(feature_layer: Any, layers: int) -> int:
    """Vision layers after the last one features are taken from: `vision_feature_layer` indexes the hidden states
    (0: the embeddings, -1: the last layer's output), an int or a list of ints; None: the last layer."""
    if feature_layer is None:
        return 0
    picks = feature_layer if isinstance(feature_layer, (list, tuple)) else [feature_layer]
    used = max(int(k) if int(k) >= 0 else layers + 1 + int(k) for k in picks)
    return max(0, layers - used)


def _window_sq(n: int, window: int) -> int:
    """Sum of squared chunk lengths when `n` merged rows are cut into windows of `window` (the last one partial),
    as transformers' `get_vision_window_index` cuts them."""
    full, rest = divmod(n, window)
    return full * window**2 + rest**2


# --------------------------------------------------------------------------------------------------------------------
# Audio encoders
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AudioShape:
    """What a Whisper-style audio tower's costs depend on (`audio_cost` reads it): its convolution stem, its
    layers, its pooling."""

    width: int  # attention width d_a (d_model = heads x head_dim)
    layers: int
    window: int  # mel frames of the encoder's input (the feature extractor's window, 2 x max_source_positions)
    stem: tuple[tuple[int, int, int, int], ...]  # per convolution, in order: (kernel parameters, span, stride, padding)
    pool: tuple[int, int] = (1, 1)  # (kernel, stride) of the pooling after the layers; (1, 1): none
    # mel frames per chunk of a clip's real frames (Qwen2.5-Omni: 2 x n_window); None: the whole window is computed
    chunk: int | None = None

    def _stem_out(self, n):
        for _, span, stride, pad in self.stem:
            n = (n + 2 * pad - span) // stride + 1
        return n

    def batch_counts(self, frames: list[int]) -> dict[str, Any]:
        """`counts` summed over the clips of one batch of `frames` mel frames each. With `chunk` (transformers
        `Qwen2_5OmniAudioEncoder.forward`, `chunk_and_pad_features`): each clip's real frames are cut into chunks of
        `chunk` frames (the last one shorter), every chunk of the batch zero-padded to the longest, the stem runs on
        the padded chunks, the layers on each chunk's real output positions, attention within each chunk, and the
        pooling on each clip's positions."""
        if self.chunk is None:
            per_clip = [self.counts(int(f)) for f in frames]
            return {"stem": [sum(c["stem"][i] for c in per_clip) for i in range(len(self.stem))],
                    **{k: sum(c[k] for c in per_clip) for k in ("positions", "pairs", "rows")}}
        chunks = [min(self.chunk, f - start) for f in map(int, frames) for start in range(0, f, self.chunk)]
        longest = max(chunks, default=0)
        stem, n = [], longest
        for _, span, stride, pad in self.stem:
            n = (n + 2 * pad - span) // stride + 1
            stem.append(len(chunks) * n)
        valid = [self._stem_out(c) for c in chunks]
        kernel, stride = self.pool
        rows = sum((self._stem_out(int(f)) - kernel) // stride + 1 for f in frames)
        return {"stem": stem, "positions": sum(valid), "pairs": sum(v * v for v in valid), "rows": rows}

    def counts(self, frames) -> dict[str, Any]:
        """What one clip of `frames` mel frames costs (elementwise over a numpy array of frame counts): `stem`,
        the output positions of each convolution ((n + 2 * padding - span) // stride + 1, torch's Conv1d);
        `positions`, the last one's (the layers' sequence); `pairs`, positions^2 (bidirectional attention per
        layer); `rows`, the pooling's output rows (the projector's input). With `chunk`, one clip as
        `batch_counts` counts it alone (scalars only)."""
        if self.chunk is not None:
            return self.batch_counts([int(frames)])
        stem, n = [], frames
        for _, span, stride, pad in self.stem:
            n = (n + 2 * pad - span) // stride + 1
            stem.append(n)
        kernel, stride = self.pool
        return {"stem": stem, "positions": n, "pairs": n * n, "rows": (n - kernel) // stride + 1}


@dataclass(frozen=True)
class AudioCost:
    """The cost rule of a Whisper-style audio tower (see `audio_cost`); called as `rule(model, encoder)`."""

    config_key: str = "audio_config"
    chunk_key: str | None = None

    def __call__(self, model: Any, encoder: EncoderSpec) -> AudioShape:
        import torch

        a = getattr(model.config, self.config_key)
        width, layers = getattr(a, "d_model", None), getattr(a, "encoder_layers", None)
        positions = getattr(a, "max_source_positions", None)
        tower = submodule(model, encoder.path)
        convs = [m for m in tower.modules() if isinstance(m, torch.nn.Conv1d)]
        if not (width and layers and positions and convs):
            raise ModelError(f"the {self.config_key} lacks d_model/encoder_layers/max_source_positions, or its tower has no "
                             "convolution stem; cannot count its FLOPs", hint="use a Whisper-style audio encoder (qwen2_audio)")
        stem = tuple((int(c.weight.numel()), int(c.dilation[0]) * (int(c.kernel_size[0]) - 1) + 1, int(c.stride[0]),
                      int(c.padding[0])) for c in convs)
        pools = [m for m in tower.modules() if isinstance(m, (torch.nn.AvgPool1d, torch.nn.MaxPool1d))]
        pool = (1, 1)
        if pools:
            kernel, stride = pools[0].kernel_size, pools[0].stride
            kernel, stride = (k[0] if isinstance(k, tuple) else k for k in (kernel, stride or kernel))
            pool = (int(kernel), int(stride))
        chunk = 2 * int(getattr(a, self.chunk_key)) if self.chunk_key else None
        return AudioShape(width=int(width), layers=int(layers), window=int(positions) * math.prod(s for _, _, s, _ in stem),
                          stem=stem, pool=pool, chunk=chunk)


def audio_cost(*, config_key: str = "audio_config", chunk_key: str | None = None) -> AudioCost:
    """The cost rule of a Whisper-style audio tower (Qwen2-Audio, Qwen2.5-Omni: transformers
    `Qwen2AudioEncoder.forward`, Whisper's encoder plus an average pooling): the tower's `Conv1d`s in registration
    order (the stem, Whisper's conv1 and conv2), its average or max pooling, and from `model.config.<config_key>`
    d_model, encoder_layers and max_source_positions (the window is max_source_positions x the stem's strides, the
    length the encoder requires). Every clip is computed over the whole window (Qwen2-Audio), unless `chunk_key`
    names the audio config's half chunk (Qwen2.5-Omni's `n_window`): then only a clip's real frames, in chunks of
    2 x that many frames (`AudioShape.chunk`). The rule (a picklable `AudioCost`) raises ModelError when a key, the
    stem or the tower is missing."""
    return AudioCost(config_key=config_key, chunk_key=chunk_key)


def image_encoder(path: str, *, layer_classes: tuple[str, ...] = (), cost: Callable[..., Any] | None = None,
                  video: bool = False, **kwargs: Any) -> EncoderSpec:
    """An image encoder at `path` (`video`: it also encodes videos, fed by `VIDEO_KEYS`); `cost` defaults to the
    plain `vision_cost()`."""
    return EncoderSpec(path=path, modalities=("image", "video") if video else ("image",), layer_classes=layer_classes,
                       data_keys=IMAGE_KEYS + (VIDEO_KEYS if video else ()), cost=cost or vision_cost(), **kwargs)


def audio_encoder(path: str, *, layer_classes: tuple[str, ...] = (), cost: Callable[..., Any] | None = None,
                  **kwargs: Any) -> EncoderSpec:
    """A Whisper-style audio encoder at `path`, fed by `AUDIO_KEYS`; `cost` defaults to `audio_cost()`. Its
    blocks have no gated MLP to align: no kernels."""
    kwargs.setdefault("kernels", ())
    kwargs.setdefault("config_key", "audio_config")
    return EncoderSpec(path=path, modalities=("audio",), layer_classes=layer_classes, data_keys=AUDIO_KEYS,
                       cost=cost or audio_cost(config_key=kwargs["config_key"]), token_rule="num_audio_tokens", **kwargs)


def encoders_by_modality(encoders: Mapping[str, EncoderSpec]) -> dict[str, str]:
    """modality -> the name of the encoder that encodes it."""
    return {m: name for name, enc in encoders.items() for m in enc.modalities}
