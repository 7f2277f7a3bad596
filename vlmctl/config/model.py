"""`model` section: compose a vision encoder (or an audio encoder) + LLM, or fine-tune an existing VLM (`base`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from vlmctl.config.base import ModelRef, ProjectPath, Section

PRESET_DIR = Path(__file__).resolve().parents[1] / "models" / "presets"
"""The shipped size presets, one YAML file each (`vlmctl model presets`)."""


def preset_names() -> list[str]:
    """Names of the shipped size presets (`model.preset`, or `model.vision` / `model.llm` with init: random)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def unknown_preset(name: str) -> str:
    """The message for a preset name that is not shipped: the closest names (case aside), or where they are listed."""
    import difflib  # only for a wrong name: loading the config does not load it

    names = preset_names()
    lower = {n.lower(): n for n in names}
    key = str(name).lower()
    close = [lower[key]] if key in lower else [lower[c] for c in difflib.get_close_matches(key, list(lower), n=2, cutoff=0.6)]
    guess = f"did you mean {' or '.join(close)}? " if close else ""
    return f"unknown preset {name!r}: {guess}`vlmctl model presets` lists the {len(names)} presets"


class ModelSection(Section):
    vision: ModelRef | None = Field(None, description="Vision encoder: Hub id, local path, or a size preset name with init: random (compose mode).")
    llm: ModelRef | None = Field(None, description="Causal language model: Hub id, local path, or a size preset name with init: random (compose mode).")
    audio: ModelRef | None = Field(None, description="Audio encoder instead of model.vision (compose mode): a Whisper checkpoint (Hub id or local path; its encoder half is used, with init: random only its config). With model.llm it builds Qwen2AudioForConditionalGeneration: the encoder, a linear projector, the LLM.")
    projector: Literal["mlp2x_gelu", "linear", "pixel_shuffle", "perceiver"] = Field("mlp2x_gelu", description="Connector from visual features to the LLM's embedding space (compose mode): mlp2x_gelu / linear build LLaVA (one token per patch); pixel_shuffle builds Idefics3 (patches / pixel_shuffle_scale**2 tokens per view); perceiver builds Idefics2 (perceiver_queries tokens per image); SigLIP encoders only for the last two. The perceiver's queries see no patch order of their own: model.perceiver_init=region starts each on its own cell of the picture. Trained jointly with the encoder on `vlmctl demo` it still gave up left/right for content (resamplers losing spatial locality: Honeybee, arXiv:2312.06742); with the vision tower and connector frozen it answered every question type (docs/benchmarks.md). pixel_shuffle keeps layout by construction.")
    pixel_shuffle_scale: int = Field(2, ge=1, description="model.projector=pixel_shuffle: side of the patch blocks merged into one visual token (2: 4 patches per token); must divide the encoder's patch grid.")
    perceiver_queries: int = Field(64, ge=1, description="model.projector=perceiver: learned latent queries of the perceiver resampler = visual tokens per image (Idefics2: 64).")
    perceiver_depth: int = Field(3, ge=1, description="model.projector=perceiver: cross-attention blocks of the perceiver resampler (Idefics2: 3).")
    perceiver_init: Literal["region", "random"] = Field("region", description="model.projector=perceiver: how the resampler starts. region: visual token i attends to cell i of a raster grid over the picture (keys keep the position part of the encoder's output, seeded from flat pictures, no data), so the visual tokens keep where things are, as pixel shuffle's do; random: random latents over near-uniform attention, which pool the patches as a set (vlmctl.models.connectors.seed_perceiver_regions; docs/benchmarks.md).")
    perceiver_heads: int = Field(16, ge=1, description="model.projector=perceiver: attention heads of the resampler (Idefics2: 16); must divide the LLM's hidden size.")
    base: ModelRef | None = Field(None, description="Existing VLM to fine-tune: Hub id, local path, or a preset name with init: random.")
    preset: str | None = Field(None, description="Whole-model size preset for init: random (e.g. tiny, qwen2.5-vl-3b); `vlmctl model presets` lists them (also `vlmctl model build --help`).")
    init: Literal["pretrained", "random"] = Field("pretrained", description="pretrained: load weights; random: build from configs only (no downloads).")
    family: str | None = Field(None, description="Model family override (a name of `vlmctl model build --list`, e.g. llava, qwen2_5_vl, idefics2, idefics3); detected when unset. In compose mode (model.vision + model.llm) it picks the layout among the composing families: llava_onevision builds LLaVA-OneVision (anyres tiles and video) instead of the projector's default.")
    output_dir: ProjectPath = Field(Path("outputs/model"), description="Where `model build` writes the Hugging Face checkpoint.")
    tokenizer: ModelRef | None = Field(None, description="Tokenizer to use instead of the LLM's (path or Hub id); random-init presets train one on the data when unset.")
    chat_template: str | None = Field(None, description="Jinja chat template (inline text or a path to a .jinja file); default: the LLM's own.")
    vision_feature_layer: int = Field(-2, description="Hidden layer of the vision encoder whose features feed the projector (LLaVA-1.5 uses -2).")
    vision_feature_select_strategy: Literal["auto", "default", "full"] = Field("auto", description="default drops the CLS token, full keeps all patches; auto = full for encoders without CLS (SigLIP).")
    image_size: int | None = Field(None, gt=0, description="Input resolution of the vision encoder in pixels (default: the encoder's own).")
    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="Dtype of the saved weights.")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the Hub (off unless you trust the repository).")

    @field_validator("preset")
    @classmethod
    def _shipped_preset(cls, value: str | None) -> str | None:
        # checked with the config: a wrong name stops every command at once, not after torch is imported
        if value is not None and value not in preset_names():
            raise ValueError(unknown_preset(value))
        return value

    @model_validator(mode="after")
    def _one_mode(self) -> "ModelSection":
        if self.base is not None and (self.vision is not None or self.llm is not None or self.audio is not None):
            raise ValueError("set either model.base (fine-tune an existing VLM) or model.vision / model.audio + model.llm (compose), not both")
        if self.audio is not None and self.vision is not None:
            raise ValueError("set model.vision (a vision-language model) or model.audio (an audio-language model), not both")
        if self.audio is not None and self.preset is not None:
            raise ValueError("set model.preset or model.audio + model.llm, not both")
        if self.audio is not None and "projector" in self.model_fields_set and self.projector != "linear":
            raise ValueError("model.audio builds Qwen2-Audio, whose projector is one linear layer: model.projector must be linear (or unset)")
        # a value other than the default (a resolved config.yaml spells the default out for every projector)
        for key, projector in (("pixel_shuffle_scale", "pixel_shuffle"), ("perceiver_queries", "perceiver"),
                               ("perceiver_depth", "perceiver"), ("perceiver_heads", "perceiver"),
                               ("perceiver_init", "perceiver")):
            if getattr(self, key) != type(self).model_fields[key].default and self.projector != projector:
                raise ValueError(f"model.{key} applies to model.projector={projector} only")
        return self
