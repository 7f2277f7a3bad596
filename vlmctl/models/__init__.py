"""Models: `model build`, and loading built or existing VLMs of a registered family (`vlmctl.families`).

    from vlmctl.models import load_model, build_model, get_family
    model, processor, family = load_model("outputs/model")
    vision = model.get_submodule(family.vision_tower)

- `build.py`: `model build` (compose / preset / base), presets under `presets/`;
- `load.py`: `load_model` / `load_processor` of a built folder, a local Hugging Face VLM folder or a Hub id;
- `tokenizer.py`: the locally trained tokenizer of random-init presets.

The family names re-exported here (FAMILIES, get_family, ...) live in `vlmctl.families`.
"""

from vlmctl.families import (
    FAMILIES,
    PARTS,
    Family,
    FamilySpec,
    count_parameters,
    decoder_layer_classes,
    decoder_layers,
    detect_family,
    get_family,
    part_of_parameter,
    parts,
    vision_layer_classes,
    vision_layers,
)
from vlmctl.models.build import BuildResult, build_model, list_presets, load_preset, plan_build
from vlmctl.models.load import load_model, load_processor, read_build_info

__all__ = [
    "FAMILIES", "PARTS", "Family", "FamilySpec", "get_family", "detect_family", "count_parameters", "part_of_parameter", "parts",
    "decoder_layer_classes", "vision_layer_classes", "decoder_layers", "vision_layers", "load_model",
    "load_processor", "build_model", "BuildResult", "plan_build", "list_presets", "load_preset", "read_build_info",
]
