"""VLM families: one `FamilySpec` per family, in a registry. Everything that differs between families lives here.

    from vlmctl.families import get_family, detect_family
    spec = get_family("qwen2_5_vl")
    vision = model.get_submodule(spec.vision_tower)
"""

from vlmctl.families.spec import (
    CLS_VISION_TYPES,
    FAMILIES,
    PARTS,
    Family,
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

__all__ = [
    "CLS_VISION_TYPES", "FAMILIES", "PARTS", "Family", "count_parameters", "decoder_layer_classes", "decoder_layers",
    "detect_family", "get_family", "part_of_parameter", "parts", "vision_layer_classes", "vision_layers",
]
