"""`data` section: where the raw sources are and how `data prepare` turns them into shards."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from vlmctl.config.base import ProjectPath, Section

DataFormat = Literal["auto", "llava", "sharegpt", "messages", "parquet", "webdataset", "hf", "llamafactory", "preference"]

EnergonFormat = Literal["auto", "vqa", "captioning", "crude"]

DEFAULT_MAX_IMAGE_PIXELS = 64_000_000
"""64 megapixels (8000 x 8000): larger pictures are rejected as image_too_large before they are decoded."""


class DataSource(Section):
    path: str = Field(..., description="File, folder or glob of the source (relative to the project file); a dataset id for format `hf`.")
    format: DataFormat = Field("auto", description="Input format: auto|llava|sharegpt|messages|parquet|webdataset|hf|llamafactory|preference (auto picks llamafactory for a file named dataset_info.json, preference for records with chosen/rejected or rejected_response).")
    dataset: str | None = Field(None, description="format llamafactory: the data set's name in LLaMA-Factory's dataset_info.json (the source's path); its file_name, formatting (sharegpt or alpaca), columns and tags are honoured (docs/formats.md).")
    name: str | None = Field(None, description="Short name for reports; defaults to the file name.")
    image_root: ProjectPath | None = Field(None, description="Folder that relative image paths are resolved against (default: the source file's folder). Image paths must resolve inside it, the source's folder or data.media_roots.")
    weight: float = Field(1.0, gt=0, description="Relative sampling weight of this source during training.")
    columns: dict[str, str] | None = Field(None, description="Column mapping for `parquet`/`hf` sources, e.g. {images: image, texts: qa}.")
    split: str = Field("train", description="Split to read for `hf` sources.")
    max_samples: int | None = Field(None, gt=0, description="Read at most this many samples from the source.")

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> "DataSource":
        # Hub dataset ids stay as they are; everything else is a local path or glob.
        base = (info.context or {}).get("base_dir")
        if self.format != "hf" and base is not None:
            p = Path(self.path).expanduser()
            if not p.is_absolute():
                # object.__setattr__ avoids re-running validation on assignment.
                object.__setattr__(self, "path", str(Path(base) / p))
        return self


class DataExport(Section):
    energon_format: EnergonFormat = Field(
        "auto",
        description="Shape of `data prepare --export energon` (see docs/formats.md): vqa (VQASample: image, question, answer; "
        "VidQASample: video, question, answer when every sample has one video), captioning (CaptioningSample: image, "
        "caption), crude (any conversation, with audio clips or several media, read with vlmctl's cooker), or auto: "
        "captioning when every sample is one image, one question and one answer with an empty or generic caption "
        "prompt, else vqa when every sample is one image (or every sample one video), one question and one answer, else "
        "crude. Clips are stored as prepared (Matroska video, FLAC audio) and decoded by energon's AVDecoder. An explicit "
        "vqa or captioning fails on the first sample that does not fit.",
    )


DEFAULT_VIDEO_FPS = 2.0
"""Frames sampled per second of video: qwen-vl-utils' and LLaMA-Factory's default (`video_fps: 2.0`)."""


class DataVideo(Section):
    fps: float = Field(
        DEFAULT_VIDEO_FPS, gt=0,
        description="Frames sampled per second of video at `data prepare` (uniformly over the clip), before the max_frames cap.",
    )
    max_frames: int = Field(
        64, ge=2,
        description="At most this many frames per clip; a longer clip is sampled more sparsely. Counts are rounded down to an even number (video encoders take frames in temporal patches of 2).",
    )
    min_frames: int = Field(
        4, ge=2,
        description="Clips with fewer decodable frames are rejected as video_too_short (4: transformers' Qwen2-VL video processor's min_frames).",
    )
    min_pixels: int = Field(
        16 * 16, gt=0,
        description="Sampled frames smaller than this many pixels (width x height) are scaled up to it, keeping the aspect ratio (LLaMA-Factory's video_min_pixels).",
    )
    max_pixels: int = Field(
        256 * 256, gt=0,
        description="Sampled frames larger than this many pixels are scaled down to it, keeping the aspect ratio (LLaMA-Factory's video_max_pixels); the model's processor may resize again to its patch grid.",
    )
    max_seconds: float = Field(
        600.0, gt=0,
        description="Clips longer than this many seconds (read from the header, before decoding) are rejected as video_too_long.",
    )

    @model_validator(mode="after")
    def _check(self) -> "DataVideo":
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"data.video.min_pixels ({self.min_pixels}) is above data.video.max_pixels ({self.max_pixels})")
        if self.min_frames > self.max_frames:
            raise ValueError(f"data.video.min_frames ({self.min_frames}) is above data.video.max_frames ({self.max_frames})")
        return self


DEFAULT_AUDIO_RATE = 16_000
"""Samples per second of stored audio: the rate of Whisper-family feature extractors (Whisper, Qwen2-Audio)."""


class DataAudio(Section):
    sampling_rate: int = Field(
        DEFAULT_AUDIO_RATE, ge=8000, le=192_000,
        description="Sample rate (Hz) clips are stored at: `data prepare` down-mixes every clip to mono and resamples it (soxr) to this rate. Use the model's feature-extractor rate (16000 for Whisper-family encoders, Qwen2-Audio); training resamples again where the model's rate differs.",
    )
    min_seconds: float = Field(
        0.1, ge=0,
        description="Clips shorter than this many seconds (and empty ones) are rejected as audio_too_short (0.1 s: the shortest clip a Whisper-style encoder turns into two or more tokens).",
    )
    max_seconds: float = Field(
        30.0, gt=0,
        description="Clips longer than this many seconds (read from the header, before decoding) are rejected as audio_too_long; 30 s is the window of Whisper-family feature extractors, which cut longer clips.",
    )

    @model_validator(mode="after")
    def _check(self) -> "DataAudio":
        if self.min_seconds >= self.max_seconds:
            raise ValueError(f"data.audio.min_seconds ({self.min_seconds:g}) must be below data.audio.max_seconds ({self.max_seconds:g})")
        return self


class DataSection(Section):
    sources: list[DataSource] = Field(default_factory=list, description="Raw data sources to read (see docs/formats.md).")
    prepared_dir: ProjectPath = Field(Path("data/prepared"), description="Where `data prepare` writes train/val Parquet shards and manifest.json.")
    val_ratio: float = Field(0.05, ge=0, lt=1, description="Fraction of samples held out for validation (split by a hash of the sample).")
    kind: Literal["auto", "sft", "preference"] = Field(
        "auto", description="What the data is: auto (preference pairs when the sources hold pairs, else conversations; mixing both fails), sft (pairs are kept as their chosen conversation), preference (every sample must be a pair: others are rejected as missing_response). See docs/formats.md, Preference data.",
    )
    max_length: int = Field(4096, gt=0, description="Maximum tokens per sample (text + visual tokens); longer samples are dropped as too_long.")
    min_image_side: int = Field(28, gt=0, description="Images whose shorter side is below this many pixels are rejected as image_too_small.")
    shard_size_mb: int = Field(256, gt=0, description="Target size of one Parquet shard in MB.")
    num_proc: int | None = Field(None, gt=0, description="Worker processes for `data prepare` (default: all cores).")
    dedup: bool = Field(True, description="Drop samples whose normalized text and image bytes repeat an earlier sample.")
    duplicate_ids: Literal["reject", "keep"] = Field(
        "reject", description="A sample whose id repeats an earlier sample's id in the same source: reject (as duplicate_id) or keep (only counted in the manifest).",
    )
    max_image_pixels: int = Field(
        DEFAULT_MAX_IMAGE_PIXELS, gt=0,
        description="Images with more pixels (width x height, read from the header before decoding) are rejected as image_too_large; default 64 megapixels. Pillow refuses more than about 179 megapixels whatever this says.",
    )
    media_roots: list[ProjectPath] = Field(
        default_factory=list,
        description="Folders besides each source's own folder and image_root that image paths may point into (symlinks are resolved first); paths anywhere else are rejected as outside_root.",
    )
    min_kept_fraction: float = Field(
        0.5, ge=0, le=1,
        description="`data prepare` fails when a source keeps less than this fraction of its records; rejections by your own limits (duplicate, duplicate_id, image_too_small, image_too_large, video_too_short, video_too_long, audio_too_short, audio_too_long, too_long) do not count. 0 turns the check off.",
    )
    export: DataExport = Field(default_factory=DataExport, description="How `data prepare --export` writes its export.")
    video: DataVideo = Field(default_factory=DataVideo, description="How `data prepare` samples and checks video clips (see docs/formats.md, Video).")
    audio: DataAudio = Field(default_factory=DataAudio, description="How `data prepare` checks and stores audio clips (see docs/formats.md, Audio).")
