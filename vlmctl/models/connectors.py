"""Compose-mode connectors (`model.projector`): how each choice maps onto the layout of the compose family that
holds it (`vlmctl.families.compose_family(projector)`).

| projector      | family layout                     | visual tokens per encoder view          |
|----------------|-----------------------------------|-----------------------------------------|
| `mlp2x_gelu`   | LLaVA (`multi_modal_projector`)   | one per patch (LLaVA-1.5)               |
| `linear`       | LLaVA (`multi_modal_projector`)   | one per patch (LLaVA-1.0)               |
| `pixel_shuffle`| Idefics3 (`connector`)            | patches / scale**2 (space-to-depth, then one linear map) |
| `perceiver`    | Idefics2 (`connector`)            | `perceiver_queries`, whatever the image size (perceiver resampler) |

The token counts themselves are the family's visual-token rule (`FamilySpec.num_visual_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlmctl.config.model import ModelSection
from vlmctl.errors import ConfigError


@dataclass(frozen=True)
class ProjectorSpec:
    """How a projector choice (`model.projector`) maps onto its compose family's layout.

    `config`: the family config keys that select it (passed to `compose_config` / `compose_processor`);
    `init`: adjusts the freshly initialized projector module; `feature_select`: whether the layout reads
    `model.vision_feature_layer` / `vision_feature_select_strategy` (LLaVA does; Idefics2 / Idefics3 take the
    encoder's last layer); `token_divisor`: encoder patches per visual token (pixel shuffle); `queries`: a fixed number
    of visual tokens per image, whatever its size (perceiver resampler; 0: none).
    """

    name: str
    config: dict[str, Any]
    init: Callable[[Any], None] | None = None
    feature_select: bool = True
    token_divisor: int = 1
    queries: int = 0


def _init_linear(projector) -> None:
    # `linear` = LLaVA's two layers with an identity activation; linear_2 starts as the identity so the projector is
    # exactly one linear map at initialization (LLaVA-1.0's projector, Liu et al. 2023).
    import torch

    with torch.no_grad():
        projector.linear_2.weight.copy_(torch.eye(projector.linear_2.weight.shape[0], dtype=projector.linear_2.weight.dtype))
        if projector.linear_2.bias is not None:
            projector.linear_2.bias.zero_()


PROJECTORS: dict[str, ProjectorSpec] = {
    "mlp2x_gelu": ProjectorSpec("mlp2x_gelu", {"projector_hidden_act": "gelu", "multimodal_projector_bias": True}),
    "linear": ProjectorSpec("linear", {"projector_hidden_act": "linear", "multimodal_projector_bias": True}, init=_init_linear),
}
"""The fixed-setting projectors; `projector_spec` builds the ones with settings (`pixel_shuffle`, `perceiver`)."""


def _init_perceiver(connector) -> None:
    """Initialize Idefics2's connector (`Idefics2Connector`: `modality_projection` MLP + `perceiver_resampler`) after
    its linear layers were reset: RMSNorm weights to one and the latents [queries, llm_hidden] drawn from N(0, 1).

    transformers' `_init_weights` sets every latent to one (modeling_idefics2.py, 5.23), so all queries would start
    identical and give identical visual tokens; the Perceiver (Jaegle et al. 2021, arXiv:2103.03206) starts from
    random latents. The composed-pretrained path also leaves the norms uninitialized (`to_empty`), hence the ones."""
    import torch

    with torch.no_grad():
        for module in connector.modules():
            if not isinstance(module, torch.nn.Linear) and isinstance(getattr(module, "weight", None), torch.nn.Parameter) and module.weight.dim() == 1:
                module.weight.fill_(1.0)  # RMSNorm gains
        latents = connector.perceiver_resampler.latents
        latents.copy_(torch.randn(latents.shape, dtype=torch.float32).to(latents.dtype))


def projector_spec(model: ModelSection, name: str | None = None) -> ProjectorSpec:
    """The `ProjectorSpec` of `name` (default `model.projector`) with the section's settings.

    `pixel_shuffle` (Idefics3's connector, Laurençon et al. 2024, https://arxiv.org/abs/2408.12637): space-to-depth
    by `model.pixel_shuffle_scale` s, so an encoder view of (H/p) x (W/p) patches becomes (H/p/s) x (W/p/s) tokens
    of s**2 times the width, then one linear map to the LLM's width.

    `perceiver` (Idefics2's connector, Laurençon et al. 2024, arXiv:2405.02246; `Idefics2Connector` in transformers'
    modeling_idefics2.py): the encoder's [patches, vision_hidden] features go through a SwiGLU MLP to the LLM's width,
    then `model.perceiver_depth` blocks of `model.perceiver_heads`-head attention from `model.perceiver_queries` learned
    latents over [latents + patches] resample them to [perceiver_queries, llm_hidden] visual tokens per image.

    Raises ConfigError for an unknown name.
    """
    name = name or model.projector
    if name in PROJECTORS:
        return PROJECTORS[name]
    if name == "pixel_shuffle":
        s = model.pixel_shuffle_scale
        return ProjectorSpec(name, {"scale_factor": s}, feature_select=False, token_divisor=s * s)
    if name == "perceiver":
        config = {"resampler_n_latents": model.perceiver_queries, "resampler_depth": model.perceiver_depth,
                  "resampler_n_heads": model.perceiver_heads}
        return ProjectorSpec(name, config, init=_init_perceiver, feature_select=False, queries=model.perceiver_queries)
    raise ConfigError(f"unknown model.projector {name!r}", hint=f"one of: {', '.join([*PROJECTORS, 'pixel_shuffle', 'perceiver'])}")


def check_connector(model: ModelSection, projector: ProjectorSpec, vision_config: Any, text_config: Any = None) -> None:
    """Refuse settings the connector's layout cannot take, before any weights load: feature-layer settings for a
    layout without them, a pixel-shuffle scale that does not divide the encoder's patch grid (the connector reshapes
    the (H/p) x (W/p) grid into blocks of s x s), perceiver heads that do not divide the LLM's hidden size (each head
    is hidden / heads wide; `text_config` may be a preset's dict). Raises ConfigError."""
    if not projector.feature_select:
        fixed = [k for k in ("vision_feature_layer", "vision_feature_select_strategy") if k in model.model_fields_set]
        if fixed:
            raise ConfigError(f"model.{fixed[0]} does not apply to model.projector={projector.name}",
                              hint="remove it: this layout reads the vision encoder's last layer (after its post-layernorm)")
    if projector.token_divisor > 1:
        side = int(vision_config.image_size) // int(vision_config.patch_size)
        scale = int(round(projector.token_divisor ** 0.5))
        if side % scale:
            raise ConfigError(
                f"model.pixel_shuffle_scale={scale} does not divide the encoder's {side} x {side} patch grid "
                f"({vision_config.image_size} px / patch {vision_config.patch_size})",
                hint=f"use a scale dividing {side}" + (f" (e.g. {min(d for d in range(2, side + 1) if side % d == 0)})" if side > 1 else ""),
            )
    if projector.queries and text_config is not None:
        hidden = int(text_config["hidden_size"] if isinstance(text_config, dict) else text_config.hidden_size)
        heads = model.perceiver_heads
        if hidden % heads:
            nearest = min((d for d in range(1, hidden + 1) if hidden % d == 0), key=lambda d: abs(d - heads))
            raise ConfigError(f"model.perceiver_heads={heads} does not divide the LLM's hidden size {hidden}",
                              hint=f"use a divisor of {hidden} (e.g. {nearest})")
