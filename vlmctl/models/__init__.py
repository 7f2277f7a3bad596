"""Models: `model build`, and loading built or existing VLMs of a registered family (`vlmctl.families`).

    from vlmctl.models import load_model, build_model
    model, processor, family = load_model("outputs/model")
    vision = model.get_submodule(family.vision_tower)

- `build.py`: `model build` (compose / preset / base), presets under `presets/`;
- `load.py`: `load_model` / `load_processor` of a built folder, a local Hugging Face VLM folder or a Hub id;
- `tokenizer.py`: the locally trained tokenizer of random-init presets.

Family specs (FAMILIES, get_family, ...) live in `vlmctl.families`.
"""

from vlmctl.models.build import BuildResult, build_model, list_presets, load_preset, plan_build
from vlmctl.models.load import load_model, load_processor, read_build_info

__all__ = [
    "load_model", "load_processor", "read_build_info", "build_model", "BuildResult", "plan_build", "list_presets", "load_preset",
]
