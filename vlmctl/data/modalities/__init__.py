"""Modality units, registered by name: each kind of media decodes, counts its tokens and collates through one.

    unit = get_unit("image")
    pil = unit.decode(sample.media["image"])                  # bytes -> processor inputs
    kwargs = unit.processor_inputs(sample.media["image"])     # {"images": [...]} for the processor call
    n = unit.num_tokens(sample.images[0], family, processor)  # visual tokens, from the family spec
    units = units_for(family)                                 # the modalities a family takes

Registered: `image` (`image.ImageUnit`), `video` (`video.VideoUnit`: clips decoded with PyAV, the processor's
`videos=`; Qwen-VL: `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`) and `audio` (`audio.AudioUnit`:
clips decoded with soundfile and stored as 16-bit mono FLAC, the processor's `audio=`; Qwen2-Audio:
`input_features`, `feature_attention_mask`). A new unit subclasses `base.ModalityUnit` and is added to `UNITS`;
samples with parts of a modality that has no unit are refused with a DataError where they are encoded.
"""

from __future__ import annotations

from typing import Any

from vlmctl.data.modalities.audio import AudioUnit
from vlmctl.data.modalities.base import ModalityUnit, placeholder_token_ids
from vlmctl.data.modalities.image import ImageUnit
from vlmctl.data.modalities.video import VideoUnit
from vlmctl.data.sample import MODALITIES
from vlmctl.errors import DataError

UNITS: dict[str, ModalityUnit] = {"image": ImageUnit(), "video": VideoUnit(), "audio": AudioUnit()}
"""Modality name -> unit, in the order of `MODALITIES`."""


def get_unit(name: str) -> ModalityUnit:
    """The unit of modality `name`. Raises DataError when there is none (yet)."""
    unit = UNITS.get(name)
    if unit is None:
        raise DataError(f"no modality unit handles {name!r} parts (units: {sorted(UNITS)})",
                        hint="drop those parts from the data, or use a vlmctl version that supports them")
    return unit


def units_for(family: Any = None) -> list[ModalityUnit]:
    """The units of the modalities `family` takes (`ModalityUnit.accepted_by`: the keys of its spec's
    `modalities` map; images only for a spec without one, or `family=None`). Modalities without a unit yet are
    left out."""
    return [unit for unit in UNITS.values() if unit.accepted_by(family)]


def media_token_ids(processor: Any) -> set[int]:
    """Ids of every placeholder token the processor expands into media tokens (image, and video or audio where
    the processor has them), whether or not a unit handles that modality yet."""
    ids: set[int] = set()
    for name in MODALITIES:
        ids |= placeholder_token_ids(processor, name)
    return ids


__all__ = ["UNITS", "AudioUnit", "ImageUnit", "ModalityUnit", "VideoUnit", "get_unit", "media_token_ids", "placeholder_token_ids", "units_for"]
