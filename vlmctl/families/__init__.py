"""VLM families: one module per family, each registering one `FamilySpec`. Everything that differs between
families (module paths, modalities, visual-token rule, build recipe, position ids, integrations) lives here.

    from vlmctl.families import get_family, detect_family
    spec = get_family("qwen2_5_vl")
    vision = model.get_submodule(spec.vision_tower)

- `spec.py`: the `FamilySpec` class and helpers over a loaded model (parts, parameter counts, layer discovery);
- `encoders.py`: `EncoderSpec`, a family's named encoders (module path, part, layer classes, cost rule, kernels, data
  keys) and the cost rules (`vision_cost`, `audio_cost`) the cost model counts each encoder by;
- `registry.py`: `FAMILIES`, `register`, `get_family`, `detect_family`, `compose_family`, `family_table`;
- `llava.py` (the compose family), `qwen_vl.py` (qwen2_vl, qwen2_5_vl, qwen3_vl), `qwen3_vl_moe.py`, `idefics3.py`,
  `smolvlm.py`, `idefics2.py`, `internvl.py`, `gemma3.py`, `llava_next.py`, `llava_onevision.py`, `mistral3.py`,
  `qwen2_audio.py` (audio), `qwen2_5_omni.py`, `qwen3_omni.py` and `phi4_multimodal.py` (audio and images): the families, each with its table of module paths.

docs/adding-a-family.md shows how to add a family (one module + one test).
"""

from vlmctl.families.encoders import EncoderSpec
from vlmctl.families.registry import FAMILIES, compose_audio_family, compose_family, detect_family, family_table, get_family, register
from vlmctl.families.spec import (
    CLS_VISION_TYPES,
    PARTS,
    Family,
    FamilySpec,
    count_parameters,
    decoder_layer_classes,
    decoder_layers,
    encoder_layers,
    encoder_of_parameter,
    float8_linears,
    has_cls_token,
    part_of_parameter,
    parts,
    vision_layer_classes,
    vision_layers,
)

# The built-in families register themselves on import, in this order.
from vlmctl.families import llava, qwen_vl, idefics3, idefics2, internvl, gemma3, llava_next, llava_onevision, qwen3_vl_moe, mistral3, smolvlm, qwen2_audio, qwen2_5_omni, qwen3_omni, phi4_multimodal  # noqa: E402, F401  isort: skip

__all__ = [
    "CLS_VISION_TYPES", "FAMILIES", "PARTS", "EncoderSpec", "Family", "FamilySpec", "compose_audio_family", "compose_family",
    "count_parameters", "decoder_layer_classes", "decoder_layers", "detect_family", "encoder_layers", "encoder_of_parameter",
    "family_table", "float8_linears", "get_family", "has_cls_token",
    "part_of_parameter", "parts", "register", "vision_layer_classes", "vision_layers",
]
