"""A torchvision-free stand-in for transformers' `Qwen2VLVideoProcessor`, for frames vlmctl has sampled already.

transformers' video processors are built on its torchvision backend (`video_processing_utils.BaseVideoProcessor`);
CPU installs without torchvision get this class instead (`vlmctl.families.qwen_vl.QwenVLSpec.video_processor`), so
Qwen2-VL and Qwen2.5-VL processors still take `videos=`. It is imported only when a processor is built or loaded.
"""

from __future__ import annotations

from typing import Any

from transformers.video_processing_utils import VideoProcessorMixin


def _get(size: Any, key: str) -> Any:
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


class FramesVideoProcessor(VideoProcessorMixin):
    """Qwen2-VL's video processor without torchvision, for frames vlmctl has sampled already.

    `__call__(videos, video_metadata=None, return_metadata=False, return_tensors=None)`: `videos` is one clip or a
    list of clips, each frames [T, H, W, 3] uint8 (numpy or torch). Every frame goes through transformers'
    `Qwen2VLImageProcessorPil` (smart_resize into `size` pixels, rescale, normalize with the CLIP mean and std,
    patchify); consecutive frames are paired along the temporal patch (the last one repeated for an odd count), the
    layout of `Qwen2VLVideoProcessor.patchify`. Returns `pixel_values_videos` [sum_t t*h*w, C * temporal * patch**2]
    and `video_grid_thw` [N, 3] (and `video_metadata`, a list of `VideoMetadata`, with `return_metadata`, which
    Qwen2.5-VL's processor turns into `second_per_grid_ts`). Raises ValueError when asked to sample frames
    (`do_sample_frames`, `fps`, `num_frames`): vlmctl samples them, from files it has checked.

    Saved as `Qwen2VLVideoProcessor` (the class it stands in for), so a machine with torchvision loads the real one.
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}  # Qwen2VLVideoProcessor.size
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

    def _frames_processor(self):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(
            size={"shortest_edge": _get(self.size, "shortest_edge"), "longest_edge": _get(self.size, "longest_edge")},
            patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size, merge_size=self.merge_size,
            image_mean=list(self.image_mean), image_std=list(self.image_std), rescale_factor=self.rescale_factor,
            resample=self.resample)

    def preprocess(self, videos: Any, **kwargs: Any):
        import numpy as np
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.video_utils import make_batched_metadata, make_batched_videos

        if kwargs.get("do_sample_frames") or kwargs.get("fps") is not None or kwargs.get("num_frames") is not None:
            raise ValueError("FramesVideoProcessor does not sample frames: pass the frames to use (vlmctl samples them "
                             "when it prepares the data)")
        clips = [np.asarray(v) for v in make_batched_videos(videos)]
        metadata = make_batched_metadata(clips, video_metadata=kwargs.get("video_metadata"))
        frames_processor = self._frames_processor()
        tp = self.temporal_patch_size
        patches, grids = [], []
        for clip in clips:
            frames = list(clip) + [clip[-1]] * (-len(clip) % tp)  # Qwen2VLVideoProcessor.patchify repeats the last
            out = frames_processor(images=frames, return_tensors="np")
            grid = out["image_grid_thw"]
            t, gh, gw = len(frames), int(grid[0][1]), int(grid[0][2])
            p = self.patch_size
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
        """Patches of one clip of `num_frames` frames [height, width] (Qwen2VLVideoProcessor's method)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor, _get(self.size, "shortest_edge"), _get(self.size, "longest_edge"))
        return -(-num_frames // self.temporal_patch_size) * (h // self.patch_size) * (w // self.patch_size)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["video_processor_type"] = self.stands_for
        return out
