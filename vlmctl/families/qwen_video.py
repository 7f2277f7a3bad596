"""Torchvision-free stand-ins for transformers' `Qwen2VLVideoProcessor` and `Qwen3VLVideoProcessor`, for frames vlmctl
has sampled already.

transformers' video processors are built on its torchvision backend (`video_processing_utils.BaseVideoProcessor`);
CPU installs without torchvision get these classes instead (`vlmctl.families.qwen_vl.QwenVLSpec.video_processor`), so
Qwen2-VL, Qwen2.5-VL and Qwen3-VL processors still take `videos=`. One class per video processor, differing in class
attributes (patch size, mean and std, pixel bounds) and in how a clip's frame size is chosen (`frame_size`). The
module is imported only when a processor is built or loaded.
"""

from __future__ import annotations

from typing import Any

from transformers.image_processing_backends import PilBackend
from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.video_processing_utils import VideoProcessorMixin

# numpy and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.


def _get(size: Any, key: str) -> Any:
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


class _ClipFrames(Qwen2VLImageProcessorPil):
    """Qwen2-VL's torchvision-free image processor resizing every frame to the clip's size (`size` of the call:
    height x width px, chosen once per clip by the video processor's `frame_size`), PIL bicubic."""

    def resize(self, image, size, resample, factor, **kwargs):
        return PilBackend.resize(self, image, size=SizeDict(height=size.height, width=size.width), resample=resample)


class FramesVideoProcessor(VideoProcessorMixin):
    """Qwen2-VL's video processor without torchvision, for frames vlmctl has sampled already.

    `__call__(videos, video_metadata=None, return_metadata=False, return_tensors=None)`: `videos` is one clip or a
    list of clips, each frames [T, H, W, 3] uint8 (numpy or torch). A clip's frames are resized to `frame_size` (one
    size per clip, PIL bicubic) and go through transformers' `Qwen2VLImageProcessorPil` (rescale, normalize with
    `image_mean` / `image_std`, patchify); consecutive frames are paired along the temporal patch (the last one
    repeated for an odd count), the layout of `Qwen2VLVideoProcessor.patchify`. Returns `pixel_values_videos`
    [sum_t t*h*w, C * temporal * patch**2] and `video_grid_thw` [N, 3] (and `video_metadata`, a list of
    `VideoMetadata`, with `return_metadata`: what Qwen2.5-VL's processor turns into `second_per_grid_ts` and Qwen3-VL's
    into timestamps; `frames_indices` missing from the given metadata are the clip's frames in order, 0..T-1). Raises
    ValueError when asked to sample frames (`do_sample_frames`, `fps`, `num_frames`): vlmctl samples them, from files
    it has checked.

    Saved as `stands_for` (the class it stands in for), so a machine with torchvision loads the real one.
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}  # Qwen2VLVideoProcessor.size: pixels per frame
    patch_size, temporal_patch_size, merge_size = 14, 2, 2
    image_mean = [0.48145466, 0.4578275, 0.40821073]  # OPENAI_CLIP_MEAN / _STD, as Qwen2VLVideoProcessor
    image_std = [0.26862954, 0.26130258, 0.27577711]
    rescale_factor = 1 / 255
    resample = 3  # PIL bicubic, as Qwen2VLVideoProcessor
    do_sample_frames = False
    return_metadata = False
    stands_for = "Qwen2VLVideoProcessor"

    def __init__(self, **kwargs: Any) -> None:
        size = dict(kwargs.pop("size", None) or self.size)
        if (low := kwargs.pop("min_pixels", None)) is not None:
            size["shortest_edge"] = low
        if (high := kwargs.pop("max_pixels", None)) is not None:
            size["longest_edge"] = high
        for key in ("video_processor_type", "processor_class", "image_processor_type"):
            kwargs.pop(key, None)
        super().__init__(size=size, **kwargs)

    def frame_size(self, num_frames: int, height: int, width: int, **kwargs: Any) -> tuple[int, int]:
        """(height, width) px the frames of a clip of `num_frames` frames of `height` x `width` px are resized to:
        Qwen2-VL's `smart_resize` of one frame into [size["shortest_edge"], size["longest_edge"]] pixels, multiples
        of patch * merge (the frame count does not matter)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        return smart_resize(height, width, factor, _get(self.size, "shortest_edge"), _get(self.size, "longest_edge"))

    def _frames_processor(self) -> _ClipFrames:
        return _ClipFrames(
            size={"shortest_edge": _get(self.size, "shortest_edge"), "longest_edge": _get(self.size, "longest_edge")},
            patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size, merge_size=self.merge_size,
            image_mean=list(self.image_mean), image_std=list(self.image_std), rescale_factor=self.rescale_factor,
            resample=self.resample)

    def preprocess(self, videos: Any, **kwargs: Any):
        import numpy as np
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.video_utils import make_batched_metadata, make_batched_videos

        if kwargs.get("do_sample_frames") or kwargs.get("fps") is not None or kwargs.get("num_frames") is not None:
            raise ValueError(f"{type(self).__name__} does not sample frames: pass the frames to use (vlmctl samples them "
                             "when it prepares the data)")
        clips = [np.asarray(v) for v in make_batched_videos(videos)]
        metadata = make_batched_metadata(clips, video_metadata=kwargs.get("video_metadata"))
        for clip, meta in zip(clips, metadata):
            if meta.frames_indices is None:  # the frames given are the clip's frames, in order
                meta.frames_indices = list(range(len(clip)))
        frames_processor = self._frames_processor()
        tp, p = self.temporal_patch_size, self.patch_size
        options = {k: v for k in ("cap_pixels_per_frame",) if (v := kwargs.get(k)) is not None}
        patches, grids = [], []
        for clip in clips:
            h, w = self.frame_size(len(clip), int(clip.shape[1]), int(clip.shape[2]), **options)
            frames = list(clip) + [clip[-1]] * (-len(clip) % tp)  # Qwen2VLVideoProcessor.patchify repeats the last
            out = frames_processor(images=frames, size={"height": h, "width": w}, return_tensors="np")
            grid = out["image_grid_thw"]
            t, gh, gw = len(frames), int(grid[0][1]), int(grid[0][2])
            # per frame: rows (gh*gw) of (C, tp, p, p) with the frame broadcast over tp; keep one copy, pair frames
            x = np.asarray(out["pixel_values"]).reshape(t, gh * gw, -1, tp, p, p)[:, :, :, 0]
            x = x.reshape(t // tp, tp, gh * gw, x.shape[2], p, p).transpose(0, 2, 3, 1, 4, 5)
            patches.append(x.reshape(t // tp * gh * gw, -1))
            grids.append([t // tp, gh, gw])
        data = {"pixel_values_videos": np.concatenate(patches, axis=0).astype(np.float32),
                "video_grid_thw": np.array(grids, dtype=np.int64)}
        result = BatchFeature(data=data, tensor_type=kwargs.get("return_tensors"))
        if kwargs.get("return_metadata") or self.return_metadata:
            result["video_metadata"] = metadata
        return result

    def get_num_of_video_patches(self, num_frames: int, height: int, width: int, videos_kwargs: Any = None) -> int:
        """Patches of one clip of `num_frames` frames [height, width] (the method of the class it stands for)."""
        options = {k: v for k in ("cap_pixels_per_frame",) if (v := (videos_kwargs or {}).get(k)) is not None}
        h, w = self.frame_size(num_frames, height, width, **options)
        return -(-num_frames // self.temporal_patch_size) * (h // self.patch_size) * (w // self.patch_size)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["video_processor_type"] = self.stands_for
        return out


class Qwen3FramesVideoProcessor(FramesVideoProcessor):
    """Qwen3-VL's video processor without torchvision (`FramesVideoProcessor` with Qwen3-VL's settings).

    As `Qwen3VLVideoProcessor`: 16 px patches, mean and std 0.5 (IMAGENET_STANDARD_MEAN / _STD), and `size` bounds the
    pixels of the whole clip, not of one frame: the frame size comes from Qwen3-VL's video `smart_resize` over
    (frames, height, width), optionally capped per frame (`cap_pixels_per_frame`, `max_video_tokens`). A clip needs at
    least `temporal_patch_size` frames (ValueError otherwise). The processor writes a timestamp per temporal patch
    from the returned `video_metadata` (the clip's `fps` and `frames_indices`).
    """

    size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}  # Qwen3VLVideoProcessor.size: pixels of a clip
    patch_size = 16
    image_mean = [0.5, 0.5, 0.5]  # IMAGENET_STANDARD_MEAN / _STD, as Qwen3VLVideoProcessor
    image_std = [0.5, 0.5, 0.5]
    cap_pixels_per_frame = None  # None or False: no cap (transformers' default, with a warning there); True: the cap
    max_video_tokens = 768
    stands_for = "Qwen3VLVideoProcessor"

    def frame_size(self, num_frames: int, height: int, width: int, **kwargs: Any) -> tuple[int, int]:
        """(height, width) px of the frames of a clip of `num_frames` frames of `height` x `width` px: Qwen3-VL's video
        `smart_resize` (t x h x w within [size["shortest_edge"], size["longest_edge"]] pixels, h and w multiples of
        patch * merge), under the per-frame cap when `cap_pixels_per_frame` (the keyword, else the setting) is true,
        as `Qwen3VLVideoProcessor.resize` does. Raises ValueError for fewer frames than `temporal_patch_size`."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        if num_frames < self.temporal_patch_size:
            raise ValueError(f"Qwen3-VL's video processor takes clips of at least {self.temporal_patch_size} frames "
                             f"(its temporal patch), got {num_frames}")
        factor = self.patch_size * self.merge_size
        low, high = int(_get(self.size, "shortest_edge")), int(_get(self.size, "longest_edge"))
        cap = kwargs.get("cap_pixels_per_frame")
        if cap if cap is not None else self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * factor * factor, high // num_frames), int(low * 1.05))
            high = per_frame * num_frames
        return smart_resize(num_frames, height, width, temporal_factor=self.temporal_patch_size, factor=factor,
                            min_pixels=low, max_pixels=high)


STAND_INS = {cls.stands_for: cls for cls in (FramesVideoProcessor, Qwen3FramesVideoProcessor)}
"""transformers' video processor class name -> the stand-in class for it."""
