"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: one spec class (`QwenVLSpec`) and one factory (`qwen_vl`), three entries.

Module paths (transformers 5.23, checked by tests/unit/test_families_qwen_vl.py):

| family     | vision tower | projector                                               | language model       |
|------------|--------------|---------------------------------------------------------|----------------------|
| qwen2_vl   | model.visual | model.visual.merger                                     | model.language_model |
| qwen2_5_vl | model.visual | model.visual.merger                                     | model.language_model |
| qwen3_vl   | model.visual | model.visual.merger, model.visual.deepstack_merger_list | model.language_model |

The projector (the patch merger) sits *inside* the vision tower module (see `spec.part_of_parameter`). Images
and videos: dynamic resolution (`smart_resize` to multiples of patch * merge, one token per merge x merge block),
`image_grid_thw` / `video_grid_thw` passed to `forward`, and 3-D mRoPE position ids (temporal, height, width) that a
packed row gets from `position_hook` (`mrope_prepare`, images and videos, with Qwen2.5-VL's `second_per_grid_ts`).

Videos: frames sampled by vlmctl (`vlmctl.data.modalities.video`) go to the processor's `videos=` with their
metadata (frames, rate); the video processor turns them into `pixel_values_videos` [patches, C * temporal_patch_size *
patch * patch] and `video_grid_thw` [videos, 3] (t = frames / 2). Qwen2-VL and Qwen2.5-VL use transformers'
`Qwen2VLVideoProcessor` (frames resized one by one within per-frame pixel bounds) and write t * h * w / 4 video tokens
per clip. Qwen3-VL (and Qwen3-VL-MoE) use `Qwen3VLVideoProcessor` (16 px patches, mean and std 0.5, pixel bounds over
the whole clip), and its processor writes per temporal patch a timestamp text `<1.2 seconds>`, then
`<|vision_start|>`, h * w / 4 video tokens and `<|vision_end|>` (`qwen3_video_tokens` counts them with the
tokenizer); its `get_rope_index` places every temporal patch as a t = 1 grid of its own. Both video processors need
torchvision; where it is not installed, `qwen_video`'s stand-ins give the same outputs from transformers'
torchvision-free Qwen2-VL image processor (resize, rescale, normalize, patchify per frame), frames paired along the
temporal patch as the library's `patchify` pairs them (tests/unit/test_video_qwen.py and test_video_qwen3.py compare
them with the library's own code).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable

from vlmctl.errors import ModelError
from vlmctl.families.encoders import KERNELS, image_encoder, vision_cost
from vlmctl.families.registry import register
from vlmctl.families.spec import DECODER_TP_PLAN, FamilySpec, VisualTokenRule, is_packed, setting, split_source

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# So are the vlmctl modules that load numpy and transformers when imported.

QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Special tokens of the Qwen-VL tokenizers that the processors and chat templates use."""


# --------------------------------------------------------------------------------------------------------------------
# Visual tokens
# --------------------------------------------------------------------------------------------------------------------


def qwen_tokens(width: int, height: int, *, patch: int, merge: int, min_pixels: int, max_pixels: int) -> int:
    """Qwen2-VL / 2.5-VL / 3-VL: resize to multiples of patch*merge inside [min_pixels, max_pixels], then one token
    per merge x merge block of patches.

    Source: transformers `qwen2_vl.image_processing_qwen2_vl.smart_resize` and `Qwen2VLProcessor`:
    tokens = (H' / patch) * (W' / patch) / merge**2 with (H', W') = smart_resize(H, W, patch * merge, ...).
    """
    # The PIL module imports without torchvision (the default one does not).
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // patch) * (w // patch) // (merge * merge)


def qwen_visual_tokens(width: int, height: int, source: Any, *, default_patch: int, default_min: int, default_max: int) -> int:
    """`qwen_tokens` with the settings read from `source` (a processor, an image processor, a model config or a
    dict). From a config, the published processor's `default_min` / `default_max` pixels are assumed."""
    _, improc, cfg = split_source(source)
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        patch = int(setting(vcfg, "patch_size", default=default_patch))
        merge = int(setting(vcfg, "spatial_merge_size", default=2))
        return qwen_tokens(width, height, patch=patch, merge=merge, min_pixels=default_min, max_pixels=default_max)
    size = setting(improc, "size", default={}) or {}
    return qwen_tokens(
        width, height,
        patch=int(setting(improc, "patch_size", default=default_patch)),
        merge=int(setting(improc, "merge_size", default=2)),
        min_pixels=int(setting(improc, "min_pixels", default=None) or size.get("shortest_edge", default_min)),
        max_pixels=int(setting(improc, "max_pixels", default=None) or size.get("longest_edge", default_max)),
    )


def qwen_rule(default_patch: int, default_min: int, default_max: int) -> VisualTokenRule:
    """The visual-token rule of a Qwen-VL version whose published processor uses `default_patch` px patches and
    [`default_min`, `default_max`] pixels (a partial of `qwen_visual_tokens`, so specs pickle)."""
    return partial(qwen_visual_tokens, default_patch=default_patch, default_min=default_min, default_max=default_max)


VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 768 * 28 * 28
"""transformers' `Qwen2VLVideoProcessor.size` defaults (pixels per frame), assumed when counting from a model config."""
QWEN3_VIDEO_MIN_PIXELS, QWEN3_VIDEO_MAX_PIXELS = 128 * 32 * 32, 768 * 32 * 32
"""transformers' `Qwen3VLVideoProcessor.size` defaults (pixels of a whole clip: frames x height x width), assumed when
counting from a model config."""
QWEN3_DEFAULT_FPS = 24.0
"""The rate `Qwen3VLProcessor` assumes for a clip whose metadata has none (frames per second)."""


def qwen_video_tokens(frames: int, width: int, height: int, source: Any, *, default_patch: int = 14) -> int:
    """Video placeholder tokens of one clip of `frames` frames of `width` x `height` pixels under Qwen2-VL's video
    processor: ceil(frames / temporal_patch_size) temporal patches, each (H' / patch) * (W' / patch) / merge**2
    tokens with (H', W') = smart_resize(H, W, patch * merge, size["shortest_edge"], size["longest_edge"]).

    Source: transformers `qwen2_vl.video_processing_qwen2_vl.Qwen2VLVideoProcessor` (`resize`, `patchify`: the last
    frame is repeated to fill the temporal patch) and `Qwen2VLProcessor.replace_video_token` (grid product /
    merge**2). `source`: a processor, a video processor, a dict of its settings (a saved processor_config.json's
    `video_processor`) or a model config (then the published video processor's pixel bounds are assumed).
    """
    patches, per_patch, _ = video_layout(frames, width, height, source, default_patch=default_patch)
    return patches * per_patch


def qwen3_video_tokens(frames: int, width: int, height: int, source: Any, *, fps: float | None = None,
                       default_patch: int = 16) -> int:
    """Tokens Qwen3-VL's processor writes in place of one clip's `<|video_pad|>` (`frames` frames of `width` x
    `height` pixels at `fps` frames per second): per temporal patch, the text `<{seconds:.1f} seconds>` (the patch's
    time, `qwen3_timestamps`), `<|vision_start|>`, the patch's (H' / patch) * (W' / patch) / merge**2 video tokens and
    `<|vision_end|>`, with (H', W') from Qwen3-VL's video `smart_resize` over the whole clip (`video_layout`).

    Source: transformers `qwen3_vl.processing_qwen3_vl.Qwen3VLProcessor.replace_video_token` and `_calculate_timestamps`,
    `qwen3_vl.video_processing_qwen3_vl.Qwen3VLVideoProcessor.resize`. `fps`: the clip's rate, as its `video_metadata`
    gives it to the processor (None: `QWEN3_DEFAULT_FPS`, as the processor assumes). The timestamp text is counted
    with the tokenizer of `source` (a processor, or the settings `TokenCounter` reads from a model folder, with its
    `tokenizer`). Raises ModelError when `source` has no tokenizer (a model config, a video processor alone) or the
    clip has fewer frames than a temporal patch.
    """
    tokenizer = source.get("tokenizer") if isinstance(source, dict) else getattr(source, "tokenizer", None)
    if tokenizer is None:
        raise ModelError("Qwen3-VL video tokens include a timestamp text per temporal patch, counted with the tokenizer: "
                         f"{type(source).__name__} has none", hint="pass the processor (it holds the tokenizer)")
    patches, per_patch, temporal = video_layout(frames, width, height, source, default_patch=default_patch, whole_clip=True)
    start = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
    end = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
    pad = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
    times = qwen3_timestamps(frames, QWEN3_DEFAULT_FPS if fps is None else fps, temporal)
    # the expansion with one video token per patch, between the prompt's own start / end tokens (its context)
    marks = "".join(f"<{seconds:.1f} seconds>{start}{pad}{end}" for seconds in times)
    text = _num_tokens(tokenizer, start + marks + end) - _num_tokens(tokenizer, start + end)
    return text + patches * (per_patch - 1)


def qwen3_timestamps(frames: int, fps: float, temporal: int = 2) -> list[float]:
    """Seconds of each temporal patch of a clip of `frames` frames at `fps`, as `Qwen3VLProcessor._calculate_timestamps`
    computes them for frames 0..frames-1: frame i at i / fps, the last frame repeated to fill the last patch, a
    patch's time the mean of its first and last frame's."""
    indices = list(range(frames)) + [frames - 1] * (-frames % temporal)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


def _num_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of `text` without added special tokens: a transformers tokenizer (ids) or a `tokenizers.Tokenizer`
    (an Encoding)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(getattr(ids, "ids", ids))


def video_layout(frames: int, width: int, height: int, source: Any, *, default_patch: int,
                 whole_clip: bool = False) -> tuple[int, int, int]:
    """(temporal patches, video tokens per temporal patch, temporal patch size) of one clip of `frames` frames of
    `width` x `height` pixels, with the video processor settings of `source` (see `qwen_video_tokens`).

    The frame size: Qwen2-VL's `smart_resize` of one frame into [size["shortest_edge"], size["longest_edge"]] pixels;
    with `whole_clip` (Qwen3-VL) Qwen3-VL's video `smart_resize`, whose bounds hold the pixels of the whole clip
    (frames x height x width), under the per-frame cap when the settings have `cap_pixels_per_frame` true. Raises
    ModelError (`whole_clip`) for fewer frames than a temporal patch.
    """
    video = _video_settings(source)
    cfg = setting(video, "vision_config") if video is not None and not isinstance(video, dict) else (video or {}).get("vision_config")
    low_default, high_default = (QWEN3_VIDEO_MIN_PIXELS, QWEN3_VIDEO_MAX_PIXELS) if whole_clip else (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    cap, max_tokens = False, 768  # Qwen3VLVideoProcessor's cap_pixels_per_frame (None: off) and max_video_tokens
    if cfg is not None:
        patch, merge = int(setting(cfg, "patch_size", default=default_patch)), int(setting(cfg, "spatial_merge_size", default=2))
        temporal, low, high = int(setting(cfg, "temporal_patch_size", default=2)), low_default, high_default
    else:
        size = setting(video, "size", default={}) or {}
        patch, merge = int(setting(video, "patch_size", default=default_patch)), int(setting(video, "merge_size", default=2))
        temporal = int(setting(video, "temporal_patch_size", default=2))
        low = int(setting(video, "min_pixels", default=None) or _get(size, "shortest_edge") or low_default)
        high = int(setting(video, "max_pixels", default=None) or _get(size, "longest_edge") or high_default)
        cap, max_tokens = bool(setting(video, "cap_pixels_per_frame", default=False)), int(setting(video, "max_video_tokens", default=768))
    factor = patch * merge
    if whole_clip:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_resize

        if int(frames) < temporal:
            raise ModelError(f"a Qwen3-VL video clip needs at least {temporal} frames (one temporal patch), got {frames}",
                             hint="keep data.video.min_frames at 2 or more")
        if cap:  # Qwen3VLVideoProcessor.resize with cap_pixels_per_frame
            high = max(min(max_tokens * factor * factor, high // int(frames)), int(low * 1.05)) * int(frames)
        h, w = clip_resize(int(frames), int(height), int(width), temporal_factor=temporal, factor=factor, min_pixels=low, max_pixels=high)
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(int(height), int(width), factor=factor, min_pixels=low, max_pixels=high)
    return -(-int(frames) // temporal), (h // patch) * (w // patch) // (merge * merge), temporal


def _video_settings(source: Any) -> Any:
    """The video processor (or its settings dict, or a model config) of a video-token rule's `source`."""
    if source is None:
        return None
    video = source.get("video_processor") if isinstance(source, dict) else getattr(source, "video_processor", None)
    if video is not None:
        return video
    if hasattr(source, "vision_config") or (isinstance(source, dict) and "vision_config" in source):
        return {"vision_config": setting(source, "vision_config")}
    if hasattr(source, "image_processor") or (isinstance(source, dict) and "image_processor" in source):
        return None  # a processor without a video processor: the published defaults
    return source


def _get(size: Any, key: str) -> Any:
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


# --------------------------------------------------------------------------------------------------------------------
# Position ids (3-D mRoPE)
# --------------------------------------------------------------------------------------------------------------------


def rope_index_fn(model):
    """The Qwen-VL model's own `get_rope_index` (mRoPE positions; a pure function of the config), found on the
    unwrapped model (LoRA wrappers included). Raises ModelError when there is none."""
    for module in model.modules():
        fn = getattr(module, "get_rope_index", None)
        if callable(fn):
            return fn
    raise ModelError("this Qwen-VL model has no get_rope_index method", hint="use a transformers version that supports the family")


def mrope_prepare(model, image_token_id: int | None) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A batch hook (run by `loop.prefetch` ahead of the step) replacing the packed row's (1, T) position ids by the
    (4, 1, T) text + mRoPE position ids computed per sample (`packed_mrope_positions`: images and videos), on CPU
    before the device copy. Padded batches pass through unchanged (the model computes their positions)."""
    rope_index = rope_index_fn(model)
    vision = getattr(getattr(getattr(rope_index, "__self__", None), "config", None), "vision_config", None)
    merge = int(getattr(vision, "spatial_merge_size", None) or 2)

    def prepare(batch: dict[str, Any]) -> dict[str, Any]:
        if not is_packed(batch):
            return batch
        types = batch.get("mm_token_type_ids")
        if types is None:  # processors without token types: image placeholders are the image tokens
            types = (batch["input_ids"] == image_token_id).long()
        positions = packed_mrope_positions(rope_index, batch["input_ids"], types, batch["seq_lens"],
                                           image_grid_thw=batch.get("image_grid_thw"), video_grid_thw=batch.get("video_grid_thw"),
                                           second_per_grid_ts=batch.get("second_per_grid_ts"), spatial_merge_size=merge)
        return {**batch, "position_ids": positions}

    return prepare


def prompt_mrope_positions(model) -> Callable[[Mapping[str, Any]], Any] | None:
    """The Qwen-VL model's own `compute_3d_position_ids` (what its forward calls when no `position_ids` are given)
    as a function of a prompt batch's host tensors: (3, B, T) positions for prompts with images or videos. Only the
    tensors the method's signature names are passed; the cache is None (a prompt's prefill). A batch of text-only
    prompts gets each row's 1-D positions (counted over its unpadded tokens) in all three sections: the rotary
    positions the language model derives itself from 1-D ones, in the layout pictures give, so text and picture
    prompts of one (rows, length) bucket share one padded prefill (and its CUDA graph). None when the model has no
    such method, or the processor gave no token types (the forward could not compute them either)."""
    owner = next((m for m in model.modules() if callable(getattr(m, "compute_3d_position_ids", None))), None)
    if owner is None:
        return None
    names = set(inspect.signature(owner.compute_3d_position_ids).parameters)

    def positions(inputs: Mapping[str, Any]):
        if inputs.get("image_grid_thw") is None and inputs.get("video_grid_thw") is None:
            import torch

            ids = inputs["input_ids"]
            mask = inputs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            return (mask.long().cumsum(dim=-1) - 1).clamp_min(0)[None].expand(3, -1, -1).contiguous()
        if "mm_token_type_ids" in names and inputs.get("mm_token_type_ids") is None:
            return None  # the forward could not compute them either
        values = {key: inputs.get(key) for key in ("input_ids", "image_grid_thw", "video_grid_thw", "attention_mask",
                                                   "second_per_grid_ts", "mm_token_type_ids")}
        values.update(inputs_embeds=None, cache=None, past_key_values=None)
        return owner.compute_3d_position_ids(**{k: v for k, v in values.items() if k in names})

    return positions


def packed_mrope_positions(get_rope_index: Callable[..., tuple[Any, Any]], input_ids, mm_token_type_ids, seq_lens: list[int], *,
                           image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None, spatial_merge_size: int = 2):
    """(4, 1, T) position ids of a packed Qwen-VL row: the 1-D text positions (row 0, restarting per sample, what
    transformers reads to build the packed mask) over the per-sample 3-D mRoPE positions (rows 1-3).

    `get_rope_index` is the model's own, called once per sample with that sample's tokens and its slices of the
    row's `image_grid_thw` [n_images, 3], `video_grid_thw` [n_videos, 3] and `second_per_grid_ts` [n_videos]
    (Qwen2.5-VL: seconds per temporal patch, which space the videos' temporal positions), so every sample gets the
    positions it has unpacked. `input_ids` / `mm_token_type_ids` (0 text, 1 image, 2 video): (1, T).

    A sample's media are the grid rows, in order, whose tokens (t * h * w / `spatial_merge_size`**2 each) make up its
    image / video tokens: a Qwen2-VL video is one run of tokens, a Qwen3-VL video one run per temporal patch (with
    its timestamp text between them). Raises ModelError when a sample's tokens do not end on a grid row.
    """
    import torch

    rows, start, used = [], 0, {1: 0, 2: 0}
    grids = {1: image_grid_thw, 2: video_grid_thw}
    token_types = mm_token_type_ids[0]
    for n in seq_lens:
        ids = input_ids[:, start:start + n]
        types = token_types[start:start + n]
        counts = {kind: _media_count(grids[kind], used[kind], int((types == kind).sum()), spatial_merge_size, kind) for kind in grids}
        if not any(counts.values()):
            pos = torch.arange(n, device=input_ids.device).view(1, 1, -1).expand(3, 1, -1)
        else:
            kwargs: dict[str, Any] = {}
            for kind, key in ((1, "image_grid_thw"), (2, "video_grid_thw")):
                if counts[kind]:
                    kwargs[key] = grids[kind][used[kind]:used[kind] + counts[kind]]
            if counts[2] and second_per_grid_ts is not None:
                kwargs["second_per_grid_ts"] = second_per_grid_ts[used[2]:used[2] + counts[2]]
            pos, _ = get_rope_index(input_ids=ids, mm_token_type_ids=types[None], **kwargs)
        rows.append(pos)
        start += n
        for kind in used:
            used[kind] += counts[kind]
    mrope = torch.cat(rows, dim=-1)
    text = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens]).view(1, 1, -1)
    return torch.cat([text.to(mrope.dtype), mrope], dim=0)


def _media_count(grid_thw, first: int, tokens: int, merge: int, kind: int) -> int:
    """How many rows of `grid_thw` [N, 3], from row `first`, hold `tokens` tokens (t * h * w / merge**2 a row).
    Raises ModelError when they do not add up to exactly `tokens`."""
    taken = count = 0
    while taken < tokens and grid_thw is not None and first + count < len(grid_thw):
        taken += int(grid_thw[first + count].prod()) // (merge * merge)
        count += 1
    if taken != tokens:
        what = "image" if kind == 1 else "video"
        rows = f"rows {first}..{first + count - 1} of {what}_grid_thw hold {taken}" if count else f"{what}_grid_thw has no row left"
        raise ModelError(f"a packed sample has {tokens} {what} tokens, but {rows}",
                         hint="the media tensors must come from the processor call that wrote the sample's tokens")
    return count


# --------------------------------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------------------------------


class QwenVLSpec(FamilySpec):
    """A Qwen-VL version: dynamic-resolution image processor, a video processor, mRoPE positions."""

    def position_hook(self, model, image_token_id: int | None):
        """`mrope_prepare(model, image_token_id)`: packed rows need per-sample 3-D positions."""
        return mrope_prepare(model, image_token_id)  # the module global, so tests can wrap it

    def prompt_positions(self, model):
        """`prompt_mrope_positions(model)`: a prompt's 3-D positions computed on the host."""
        return prompt_mrope_positions(model)

    def image_size_kwargs(self, kwargs: Mapping[str, Any], size: int) -> dict[str, Any]:
        """`model.image_size` caps the pixels per image at size**2 (`max_pixels`; `min_pixels` no larger)."""
        return {**kwargs, "max_pixels": size * size, "min_pixels": min(kwargs.get("min_pixels", 3136), size * size)}

    def default_image_size(self, image_processor: Any) -> int | None:
        """448 px: a square image at the size Qwen-VL examples use (dynamic resolution has no native size)."""
        return 448

    def num_video_tokens(self, frames: int, width: int, height: int, processor_or_config: Any, *, fps: float | None = None) -> int:
        """Tokens the processor writes in place of one clip's `<|video_pad|>`: `qwen_video_tokens` (Qwen2-VL's video
        processor: Qwen2-VL, Qwen2.5-VL; `fps` does not matter), `qwen3_video_tokens` (Qwen3-VL's: the video tokens
        with a timestamp text and vision start / end tokens per temporal patch, counted with the processor's
        tokenizer; `fps`, the clip's rate, sets the timestamps). Raises ModelError for Qwen3-VL without a tokenizer
        in `processor_or_config` (a model config)."""
        if self.video_processor_class == "Qwen3VLVideoProcessor":
            return qwen3_video_tokens(frames, width, height, processor_or_config, fps=fps, default_patch=self._patch)
        return qwen_video_tokens(frames, width, height, processor_or_config, default_patch=self._patch)

    @property
    def _patch(self) -> int:
        return int(self.visual_token_rule.keywords["default_patch"])

    def video_processor(self, image_processor: Any, **settings: Any):
        """The version's video processor with the image processor's patch / merge / temporal patch sizes (and
        `settings`, e.g. a saved video processor's `size`): transformers' class, or where torchvision is missing its
        stand-in (`qwen_video.STAND_INS`: `FramesVideoProcessor` for Qwen2-VL's, used by Qwen2-VL and Qwen2.5-VL;
        `Qwen3FramesVideoProcessor` for Qwen3-VL's, used by Qwen3-VL and Qwen3-VL-MoE).

        Raises ImportError without torchvision for a video processor class without a stand-in (`STAND_IN_FOR`)."""
        import transformers

        kwargs = {"patch_size": image_processor.patch_size, "merge_size": image_processor.merge_size,
                  "temporal_patch_size": image_processor.temporal_patch_size, **settings}
        try:
            return getattr(transformers, self.video_processor_class)(**kwargs)  # ImportError without torchvision
        except ImportError:
            if self.video_processor_class not in STAND_IN_FOR:
                raise
        from vlmctl.families.qwen_video import STAND_INS

        return STAND_INS[self.video_processor_class](**kwargs)

    def image_only_processor(self, ref: str, *, trust_remote_code: bool = False):
        """The saved processor at `ref` with the version's stand-in video processor (`video_processor`, its saved
        settings kept), where transformers' own video processor cannot load (no torchvision); the image-only
        variant (`FamilySpec.image_only_processor`) for a video processor class without a stand-in."""
        processor = super().image_only_processor(ref, trust_remote_code=trust_remote_code)
        try:
            video = self.video_processor(processor.image_processor, **_saved_video_settings(ref))
        except ImportError:
            return processor
        return self._with_frames(processor.image_processor, processor.tokenizer, video, processor.chat_template)

    def make_processor(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None, **kwargs: Any):
        """`FamilySpec.make_processor`, with the version's stand-in video processor (`video_processor`) where
        transformers' needs torchvision and it is not installed."""
        try:
            video = self.video_processor(image_processor)
        except ImportError:
            video = None
        if not _is_stand_in(video):
            return super().make_processor(tokenizer, image_processor, chat_template, **kwargs)
        return self._with_frames(image_processor, tokenizer, video, chat_template, **kwargs)

    def _with_frames(self, image_processor: Any, tokenizer: Any, video: Any, chat_template: str | None, **kwargs: Any):
        import transformers

        cls = _frames_variant(getattr(transformers, self.processor_class))
        return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video, chat_template=chat_template, **kwargs)


STAND_IN_FOR = ("Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor")
"""The video processor classes `qwen_video` has a stand-in for (`qwen_video.STAND_INS`; named here so checking a
processor imports no transformers)."""


def _is_stand_in(video: Any) -> bool:
    return video is not None and getattr(type(video), "stands_for", None) in STAND_IN_FOR


@lru_cache(maxsize=None)
def _frames_variant(cls):
    """`cls` (a Qwen-VL processor class) accepting a `qwen_video` stand-in as its video processor: transformers checks
    sub-processors against `VideoProcessorMixin` by name in its top-level namespace, where the class is not exported
    without torchvision. Saved under the real class's name, so a machine with torchvision loads transformers' own."""

    class WithFrames(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and _is_stand_in(argument):
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    WithFrames.__name__ = WithFrames.__qualname__ = cls.__name__
    return WithFrames


def _saved_video_settings(ref: str) -> dict[str, Any]:
    """The `video_processor` settings saved in `ref`'s processor_config.json (a folder; {} when there are none):
    its pixel bounds and sizes, without the class name."""

    path = Path(ref).expanduser() / "processor_config.json"
    try:
        saved = json.loads(path.read_text()).get("video_processor") or {}
    except (OSError, ValueError):
        return {}
    keep = ("size", "patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "rescale_factor",
            "cap_pixels_per_frame", "max_video_tokens")
    return {k: saved[k] for k in keep if k in saved}


def qwen_vl(name: str, prefix: str, *, patch: int, min_pixels: int, max_pixels: int, decoder_layer: str,
            video_processor: str, projector: tuple[str, ...] = ("model.visual.merger",), tiny_preset: str,
            notes: str = "", sequence_split: bool = False, megatron_layout: str | None = None,
            graph_inputs: str | None = None, prompt_merge: str | None = None) -> QwenVLSpec:
    """The spec of one Qwen-VL version. `prefix` is its transformers class prefix ("Qwen2_5_VL"); `patch`,
    `min_pixels`, `max_pixels` are its published processor's settings (for counts from a config). `graph_inputs`:
    the `encoder_graphs.GRID_INPUTS` name of its tower's precomputed grid inputs (None: the tower is not graphed);
    `prompt_merge`: the `inference.features.MERGES` name of the engine's own merge of its visual features (None: the
    forward's).

    Its one encoder, `model.visual`, takes images and videos; its cost rule merges `spatial_merge_size`^2 patches
    per token and has Qwen2.5-VL's window attention where the config sets `window_size`. `sequence_split`: under
    sequence parallelism the row's images are spread over the ranks (Qwen2-VL / Qwen2.5-VL: the tower takes all
    patches with their `grid_thw` and returns the merged tokens; Qwen3-VL's also returns DeepStack features per
    layer and is not split)."""
    return QwenVLSpec(
        name=name,
        collate_prompts=True,
        prompt_merge=prompt_merge,
        model_types=(name,),
        model_class=f"{prefix}ForConditionalGeneration",
        config_class=f"{prefix}Config",
        processor_class=f"{prefix}Processor",
        encoders={"image": image_encoder("model.visual", layer_classes=(f"{prefix}VisionBlock",), video=True, varlen=True,
                                         cost=vision_cost(merge=True, windows=True), kernels=KERNELS,
                                         sequence_split=sequence_split, graph_inputs=graph_inputs)},
        projector=projector,
        language_model="model.language_model",
        decoder_layer_classes=(decoder_layer,),
        modalities={"image": "<|image_pad|>", "video": "<|video_pad|>"},
        prompts={"image": "<|vision_start|><|image_pad|><|vision_end|>", "video": "<|vision_start|><|video_pad|><|vision_end|>"},
        visual_token_rule=qwen_rule(patch, min_pixels, max_pixels),
        image_grid_args=("image_grid_thw",),
        mrope=True,
        special_tokens=QWEN_TOKENS,
        extra_special_tokens={"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>", "video_token": "<|video_pad|>"},
        config_token_ids={"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                          "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"},
        image_processor_class="Qwen2VLImageProcessor",
        video_processor_class=video_processor,
        tiny_preset=tiny_preset,
        liger_patch=f"apply_liger_kernel_to_{name}",
        lmms_model=name,
        megatron_layout=megatron_layout,
        tensor_parallel_plan=DECODER_TP_PLAN,
        notes=notes,
    )


QWEN2_VL = register(qwen_vl(
    "qwen2_vl", "Qwen2VL", patch=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
    decoder_layer="Qwen2VLDecoderLayer", video_processor="Qwen2VLVideoProcessor", tiny_preset="tiny-qwen2-vl",
    sequence_split=True, graph_inputs="qwen_grid", prompt_merge="qwen",
))
QWEN2_5_VL = register(qwen_vl(
    "qwen2_5_vl", "Qwen2_5_VL", patch=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
    decoder_layer="Qwen2_5_VLDecoderLayer", video_processor="Qwen2VLVideoProcessor", tiny_preset="tiny-qwen2.5-vl",
    sequence_split=True, megatron_layout="bridge_qwen25_vl", graph_inputs="qwen_grid", prompt_merge="qwen",
    notes="Window attention in the vision tower except fullatt_block_indexes.",
))
# Qwen3-VL's published processor: patch 16, shortest_edge 65536, longest_edge 16777216 pixels.
QWEN3_VL = register(qwen_vl(
    "qwen3_vl", "Qwen3VL", patch=16, min_pixels=65536, max_pixels=16777216,
    decoder_layer="Qwen3VLTextDecoderLayer", video_processor="Qwen3VLVideoProcessor", tiny_preset="tiny-qwen3-vl",
    projector=("model.visual.merger", "model.visual.deepstack_merger_list"), megatron_layout="bridge_qwen3_vl",
    notes="DeepStack: features of some vision layers are added to early decoder layers (deepstack_merger_list).",
))
