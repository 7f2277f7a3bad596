"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): a SigLIP encoder, LLaVA's MLP projector and Qwen2,
with LLaVA-NeXT's anyres tiling capped at `anyres_max_N` (Li et al. 2024, https://arxiv.org/abs/2408.03326).

Module paths (transformers 5.23, checked by tests/unit/test_families_llava_onevision.py):

| part           | path                        |
|----------------|-----------------------------|
| vision tower   | model.vision_tower          |
| projector      | model.multi_modal_projector |
| language model | model.language_model        |
| lm head        | lm_head                     |

As in LLaVA-NeXT (whose helpers this module shares), `model.image_newline` is a parameter that counts with the
language model, and the processor's padded tiles are dropped before batching. Differences: the base view has
`num_image_tokens` features, and a tile grid with more than N tiles' worth of features is shrunk
(`vision_aspect_ratio` "anyres_max_N"). The processor's `batch_num_images` (images per sample) goes to the model,
which tiles only the images of single-image samples. The data pipeline passes a sample's images as one flat list,
which the processor counts as single images: every image is tiled, as the visual-token rule assumes (called with
nested lists `[[img, img]]`, the images of a multi-image sample become one view each and the rule over-counts).

Videos: the family that takes `pixel_values_videos` through the same three parts as its images, hence the one vlmctl
trains video with outside Qwen-VL. `LlavaOnevisionModel.get_video_features` runs every frame through the vision
tower at the tile size, projects it, pools it 2 x 2 (bilinear, `apply_pooling`) and appends `image_newline` once per
clip; `LlavaOnevisionProcessor.replace_video_token` writes frames * ceil(side / 2)**2 + 1 `<video>` tokens with
side**2 = `num_image_tokens` (`llava_onevision_video_tokens`). LLaVA-NeXT-Video (`LlavaNextVideoForConditionalGeneration`)
also takes `pixel_values_videos`, but it is a separate CLIP + Vicuna/Mistral class with its own pooling settings and
no image anyres cap: a family of its own, not this one's layout. transformers' `LlavaOnevisionVideoProcessor` only
resizes each frame to `size` (height x width, bicubic), rescales and normalizes it, but is built on its torchvision
backend; where torchvision is missing, `onevision_frames_processor` stands in (PIL resize, the same normalization,
the same `pixel_values_videos` [videos, frames, 3, H, W]), saved as the class it stands in for. The vision tower
takes one 5-D tensor for all videos of a forward, so the clips of a batch must have as many frames (the data
pipeline's `data.video.min_frames` = `max_frames` does that; `vlmctl.data.modalities.video.concat_videos` says so
otherwise).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from vlmctl.errors import ModelError
from vlmctl.families.llava_next import LlavaNextSpec, anyres_tokens, drop_padded_tiles
from vlmctl.families.encoders import image_encoder, vision_cost
from vlmctl.families.registry import register
from vlmctl.families.spec import FamilySpec, setting, split_source

# numpy, PIL and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up)
# must not pay for them.

PUBLISHED_PINPOINTS = [[384 * r, 384 * c] for r in range(1, 7) for c in range(1, 7)]
"""`LlavaOnevisionConfig`'s default `image_grid_pinpoints` (1 to 6 tiles of 384 px a side)."""


def _max_tiles(aspect_ratio: str) -> int:
    # "anyres_max_9" -> 9 (LlavaOnevisionProcessor strips the prefix the same way)
    return int(aspect_ratio.strip("anyres_max_"))


def llava_onevision_tokens(width: int, height: int, source: Any) -> int:
    """LLaVA-OneVision, an image alone in its sample: `anyres_tokens` with `num_image_tokens` = (tile / patch)**2
    features per tile and for the base view, the tile grid capped by `anyres_max_N`; the `default` feature
    strategy drops one.

    Source: transformers `LlavaOnevisionProcessor.replace_image_token` / `_get_number_of_features` (5.23).
    """
    proc, improc, cfg = split_source(source)
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        tile, patch = int(setting(vcfg, "image_size", default=384)), int(setting(vcfg, "patch_size", default=14))
        per_tile = (tile // patch) ** 2
        pinpoints = setting(cfg, "image_grid_pinpoints", default=PUBLISHED_PINPOINTS)
        aspect = setting(cfg, "vision_aspect_ratio", default="anyres_max_9")
        strategy = setting(cfg, "vision_feature_select_strategy", default="full")
    else:
        tile = int(setting(improc, "size")["height"])
        per_tile = int(setting(proc, "num_image_tokens"))
        pinpoints = setting(improc, "image_grid_pinpoints")
        aspect = setting(proc, "vision_aspect_ratio", default="anyres_max_9")
        strategy = setting(proc, "vision_feature_select_strategy", default="full")
    grid = int(math.sqrt(per_tile))
    n = anyres_tokens(height, width, tile=tile, grid=grid, pinpoints=pinpoints, base=per_tile,
                      max_num_patches=_max_tiles(aspect))
    return n - (1 if strategy == "default" else 0)


def llava_onevision_video_tokens(frames: int, width: int, height: int, source: Any) -> int:
    """LLaVA-OneVision, one clip of `frames` frames: frames * ceil(side / 2)**2 + 1 with side**2 = `num_image_tokens`
    (features per frame before the 2 x 2 pooling; one `image_newline` per clip). Every frame is resized to the tile
    size, so `width` x `height` does not matter.

    `source`: a processor (or its saved settings, by attribute or key) with `num_image_tokens`, or a model config
    ((image_size / patch_size)**2). Raises ModelError for a source with neither (a video processor alone).

    Source: transformers `LlavaOnevisionProcessor.replace_video_token` and `LlavaOnevisionModel.get_video_features` /
    `apply_pooling` (5.23).
    """
    proc, _, cfg = split_source(source)
    per_frame = setting(proc if proc is not None else source, "num_image_tokens") if cfg is None else None
    if cfg is not None:
        vcfg = setting(cfg, "vision_config")
        per_frame = (int(setting(vcfg, "image_size", default=384)) // int(setting(vcfg, "patch_size", default=14))) ** 2
    if per_frame is None:
        raise ModelError("LLaVA-OneVision video tokens need the processor's num_image_tokens or the model config",
                         hint="pass the processor (or its settings) or the model config")
    pooled = math.ceil(int(math.sqrt(int(per_frame))) / 2)
    return int(frames) * pooled * pooled + 1


VIDEO_SETTINGS = ("size", "image_mean", "image_std", "rescale_factor", "resample", "do_rescale", "do_normalize")
"""Settings a LLaVA-OneVision video processor shares with the image processor (frames are seen as tiles)."""


@lru_cache(maxsize=None)
def _frames_processor_class():
    """The stand-in class (built on first use: the family module imports no transformers)."""
    from transformers.video_processing_utils import VideoProcessorMixin

    class OnevisionFramesVideoProcessor(VideoProcessorMixin):
        """`LlavaOnevisionVideoProcessor` without torchvision, for frames vlmctl has sampled already.

        `__call__(videos, video_metadata=None, return_tensors=None, ...)`: `videos` is one clip or a list of clips,
        each frames [T, H, W, 3] uint8 (numpy or torch). Each frame is resized to `size` (height x width px, PIL
        bicubic), rescaled by `rescale_factor` and normalized with `image_mean` / `image_std`, as the library's class
        does (its `_preprocess`; its resize is torchvision's antialiased bicubic, so pixels may differ in the last
        bits). Returns `pixel_values_videos` [videos, T, 3, height, width] float32 (a list of [T, 3, H, W] when the
        clips' frame counts differ). Raises ValueError when asked to sample frames (`do_sample_frames`, `fps`,
        `num_frames`): vlmctl samples them, from files it has checked.
        """

        model_input_names = ["pixel_values_videos"]
        size = {"height": 384, "width": 384}  # LlavaOnevisionVideoProcessor's defaults
        image_mean = [0.48145466, 0.4578275, 0.40821073]  # OPENAI_CLIP_MEAN / _STD
        image_std = [0.26862954, 0.26130258, 0.27577711]
        rescale_factor = 1 / 255
        resample = 3  # PIL bicubic
        do_rescale = do_normalize = True
        do_sample_frames = False
        stands_for = "LlavaOnevisionVideoProcessor"

        def __init__(self, **kwargs: Any) -> None:
            for key in ("video_processor_type", "processor_class", "image_processor_type"):
                kwargs.pop(key, None)
            super().__init__(**kwargs)

        def preprocess(self, videos: Any, **kwargs: Any):
            import numpy as np
            from PIL import Image
            from transformers.feature_extraction_utils import BatchFeature
            from transformers.video_utils import make_batched_videos

            if kwargs.get("do_sample_frames") or kwargs.get("fps") is not None or kwargs.get("num_frames") is not None:
                raise ValueError("the LLaVA-OneVision frames processor does not sample frames: pass the frames to use "
                                 "(vlmctl samples them when it prepares the data)")
            h, w = int(self.size["height"]), int(self.size["width"])
            mean = np.asarray(self.image_mean, np.float32).reshape(3, 1, 1)
            std = np.asarray(self.image_std, np.float32).reshape(3, 1, 1)
            out = []
            for clip in make_batched_videos(videos):
                frames = np.asarray(clip)
                if frames.ndim == 4 and frames.shape[1] in (1, 3) and frames.shape[-1] not in (1, 3):
                    frames = frames.transpose(0, 2, 3, 1)  # channels first -> last
                x = np.stack([np.asarray(Image.fromarray(f.astype(np.uint8)).convert("RGB").resize((w, h), int(self.resample)))
                              for f in frames]).astype(np.float32).transpose(0, 3, 1, 2)
                if self.do_rescale:
                    x = x * np.float32(self.rescale_factor)
                if self.do_normalize:
                    x = (x - mean) / std
                out.append(x.astype(np.float32))
            same = len({v.shape for v in out}) == 1
            return BatchFeature(data={"pixel_values_videos": np.stack(out) if same else out},
                                tensor_type=kwargs.get("return_tensors") if same else None)

        def to_dict(self) -> dict[str, Any]:
            out = super().to_dict()
            out["video_processor_type"] = self.stands_for  # a machine with torchvision loads the real class
            return out

    # pickles by reference, through the module's `__getattr__`
    OnevisionFramesVideoProcessor.__module__, OnevisionFramesVideoProcessor.__qualname__ = __name__, "OnevisionFramesVideoProcessor"
    return OnevisionFramesVideoProcessor


def __getattr__(name: str) -> Any:
    if name == "OnevisionFramesVideoProcessor":
        return _frames_processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def onevision_frames_processor(**settings: Any):
    """A torchvision-free `LlavaOnevisionVideoProcessor` stand-in with `settings` (see `_frames_processor_class`)."""
    return _frames_processor_class()(**settings)


def _is_stand_in(video: Any) -> bool:
    return video is not None and getattr(type(video), "stands_for", None) == "LlavaOnevisionVideoProcessor"


@lru_cache(maxsize=None)
def _with_stand_in(cls):
    """`cls` (LlavaOnevisionProcessor) accepting the stand-in as its video processor: transformers checks
    sub-processors against `VideoProcessorMixin` by name in its top-level namespace, where the stand-in is not.
    Saved under the real class's name."""

    class WithFrames(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and _is_stand_in(argument):
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    WithFrames.__name__ = WithFrames.__qualname__ = cls.__name__
    return WithFrames


def _saved_video_settings(ref: str) -> dict[str, Any]:
    """`VIDEO_SETTINGS` of the video processor saved in `ref` (a folder: processor_config.json's `video_processor`,
    else video_preprocessor_config.json); {} when there are none."""

    folder = Path(ref).expanduser()
    for name, key in (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None)):
        try:
            saved = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        saved = saved.get(key) if key else saved
        if saved:
            return {k: saved[k] for k in VIDEO_SETTINGS if k in saved}
    return {}


def compose_pinpoints(tile: int) -> list[list[int]]:
    """Anyres grids of 1 to 6 tiles a side of `tile` px: the published grid (`PUBLISHED_PINPOINTS`) for 384 px tiles."""
    return [[tile * r, tile * c] for r in range(1, 7) for c in range(1, 7)]


COMPOSE_ASPECT_RATIO = "anyres_max_9"  # LlavaOnevisionConfig's default: at most 9 tiles' worth of features


class LlavaOnevisionSpec(LlavaNextSpec):
    """LLaVA-OneVision's build recipe and batching (LLaVA-NeXT's, with its own processor settings). Compose mode
    (`model.family: llava_onevision` with `model.vision` + `model.llm`) builds the same class from any encoder
    LLaVA takes: tiles of the encoder's image size, the published 1-6 tiles a side and anyres_max_9 cap, and the
    video path of the class (the reason to choose it over LLaVA for video)."""

    def compose_config(self, vision_config: Any, text_config: Any, *, token_ids: Mapping[str, int], feature_layer: int,
                       feature_strategy: str, projector_config: Mapping[str, Any]):
        """`LlavaOnevisionConfig` joining the two configs (`compose_pinpoints` of the encoder's image size)."""
        import transformers

        return getattr(transformers, self.config_class)(
            vision_config=vision_config, text_config=text_config, **token_ids,
            vision_feature_layer=feature_layer, vision_feature_select_strategy=feature_strategy,
            image_grid_pinpoints=compose_pinpoints(int(vision_config.image_size)), vision_aspect_ratio=COMPOSE_ASPECT_RATIO,
            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)), **projector_config,
        )

    def compose_processor(self, tokenizer: Any, image_processor: Any, vision_config: Any, feature_strategy: str,
                          chat_template: str | None, projector_config: Mapping[str, Any] | None = None):
        """`LlavaOnevisionProcessor`: anyres tiles of the encoder's size with its normalization, the video processor
        (`video_processor`), `num_image_tokens` = (image_size / patch_size)**2."""
        tile = int(vision_config.image_size)
        improc = self.image_processor(
            size={"height": tile, "width": tile}, image_grid_pinpoints=compose_pinpoints(tile),
            image_mean=getattr(image_processor, "image_mean", None) or [0.5, 0.5, 0.5],
            image_std=getattr(image_processor, "image_std", None) or [0.5, 0.5, 0.5])
        return self.make_processor(tokenizer, improc, chat_template,
                                   num_image_tokens=(tile // int(vision_config.patch_size)) ** 2,
                                   vision_feature_select_strategy=feature_strategy, vision_aspect_ratio=COMPOSE_ASPECT_RATIO)

    def processor_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`num_image_tokens` = (image_size / patch_size)**2, the feature strategy and `vision_aspect_ratio`."""
        vision = config["vision_config"]
        return {"num_image_tokens": (int(vision["image_size"]) // int(vision["patch_size"])) ** 2,
                "vision_feature_select_strategy": config.get("vision_feature_select_strategy", "full"),
                "vision_aspect_ratio": config.get("vision_aspect_ratio", "anyres_max_9")}

    def default_image_size(self, image_processor: Any) -> int | None:
        """The tile side: an image of that side is one tile plus the base view."""
        return int(image_processor.size["height"])

    def processor_outputs(self, outputs: Mapping[str, Any], processor: Any) -> dict[str, Any]:
        """Padded tiles dropped (`drop_padded_tiles`); the images of a multi-image sample are one view each."""
        per_sample = outputs.get("batch_num_images")
        tiled = None if per_sample is None else [int(n) == 1 for n in per_sample.tolist() for _ in range(int(n))]
        return drop_padded_tiles(outputs, processor, tiled)

    def num_video_tokens(self, frames: int, width: int, height: int, processor_or_config: Any, *, fps: float | None = None) -> int:
        """`llava_onevision_video_tokens`: frames * ceil(side / 2)**2 + 1 (`fps` does not matter)."""
        return llava_onevision_video_tokens(frames, width, height, processor_or_config)

    def video_processor(self, image_processor: Any, **settings: Any):
        """`LlavaOnevisionVideoProcessor` with the image processor's tile size, mean, std and rescaling (frames go
        through the vision tower as tiles do), then `settings` (e.g. a saved video processor's); where it needs
        torchvision and that is missing, the stand-in (`onevision_frames_processor`) with the same settings."""
        import transformers

        kwargs = {k: v for k in VIDEO_SETTINGS if (v := getattr(image_processor, k, None)) is not None}
        size = kwargs.get("size")
        if size is not None:
            size = dict(size) if isinstance(size, Mapping) else {"height": size.height, "width": size.width}
            kwargs["size"] = {"height": int(size["height"]), "width": int(size["width"])}
        if "resample" in kwargs:
            kwargs["resample"] = int(kwargs["resample"])
        kwargs.update(settings)
        try:
            return getattr(transformers, self.video_processor_class)(**kwargs)  # ImportError without torchvision
        except ImportError:
            return onevision_frames_processor(**kwargs)

    def make_processor(self, tokenizer: Any, image_processor: Any, chat_template: str | None = None, **kwargs: Any):
        """`FamilySpec.make_processor`, with the stand-in video processor where transformers' needs torchvision."""
        video = self.video_processor(image_processor)
        if not _is_stand_in(video):
            return super().make_processor(tokenizer, image_processor, chat_template, **kwargs)
        return self._with_frames(image_processor, tokenizer, video, chat_template, **kwargs)

    def image_only_processor(self, ref: str, *, trust_remote_code: bool = False):
        """The saved processor at `ref` with the stand-in video processor (its saved settings kept), where
        transformers' own cannot load (no torchvision)."""
        plain = FamilySpec.image_only_processor(self, ref, trust_remote_code=trust_remote_code)
        kwargs = {k: getattr(plain, k) for k in ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio")}
        video = self.video_processor(plain.image_processor, **_saved_video_settings(ref))
        if not _is_stand_in(video):
            return plain
        return self._with_frames(plain.image_processor, plain.tokenizer, video, plain.chat_template, **kwargs)

    def _with_frames(self, image_processor: Any, tokenizer: Any, video: Any, chat_template: str | None, **kwargs: Any):
        import transformers

        cls = _with_stand_in(getattr(transformers, self.processor_class))
        return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video, chat_template=chat_template, **kwargs)


LLAVA_ONEVISION = register(LlavaOnevisionSpec(
    name="llava_onevision",
    model_types=("llava_onevision",),
    model_class="LlavaOnevisionForConditionalGeneration",
    config_class="LlavaOnevisionConfig",
    processor_class="LlavaOnevisionProcessor",
    encoders={"image": image_encoder("model.vision_tower", layer_classes=("SiglipEncoderLayer",), video=True, cost=vision_cost(feature_layer=True))},
    projector=("model.multi_modal_projector",),
    language_model="model.language_model",
    decoder_layer_classes=("Qwen2DecoderLayer",),
    modalities={"image": "<image>", "video": "<video>"},
    visual_token_rule=llava_onevision_tokens,
    image_grid_args=("image_sizes", "batch_num_images"),
    special_tokens=("<|im_start|>", "<|im_end|>", "<image>", "<video>", "<pad>"),
    extra_special_tokens={"video_token": "<video>"},
    config_token_ids={"image_token_id": "<image>", "video_token_id": "<video>"},
    image_processor_class="LlavaOnevisionImageProcessor",
    video_processor_class="LlavaOnevisionVideoProcessor",
    tiny_preset="tiny-llava-onevision",
    compose=True,  # with model.family: llava_onevision; model.projector alone still picks LLaVA
    compose_projectors=("mlp2x_gelu", "linear"),
    lmms_model="llava_hf",
    notes="SigLIP + Qwen2; anyres tiles + a base view, capped at anyres_max_N tiles' worth of features; videos: "
    "frames pooled 2 x 2, one newline per clip.",
))
