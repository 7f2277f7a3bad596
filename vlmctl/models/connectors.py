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

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.


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


def region_cells(queries: int, side: int):
    """[queries, side * side] bool: which patches of a `side` x `side` grid (raster order) each query of a
    `rows` x `cols` grid of cells owns (`rows` the largest divisor of `queries` up to its square root). A query owns
    the patches whose centre lies in its cell and, where queries outnumber patches, the patch holding its cell's
    centre, so every query owns at least one patch."""
    import torch

    rows = max(d for d in range(1, int(queries ** 0.5) + 1) if queries % d == 0)
    cols = queries // rows
    q = torch.arange(queries)
    p = torch.arange(side * side)
    qr, qc = (q // cols).float(), (q % cols).float()
    pr, pc = (p // side).float(), (p % side).float()
    # the patch's centre inside the query's cell (coordinates in [0, 1) of the picture)
    centre_in = (((pr[None] + 0.5) / side * rows).floor() == qr[:, None]) & (((pc[None] + 0.5) / side * cols).floor() == qc[:, None])
    # the cell's centre inside the patch
    cell_in = (((qr[:, None] + 0.5) / rows * side).floor() == pr[None]) & (((qc[:, None] + 0.5) / cols * side).floor() == pc[None])
    return centre_in | cell_in


def seed_perceiver_regions(vlm, vision_path: str, connector_path: str, *, gap: float = 20.0, pictures: int = 16,
                           seed: int = 0) -> list[float]:
    """Start Idefics2's perceiver resampler as a region pooler (`model.perceiver_init: region`): visual token i
    attends to the patches of cell i of a raster grid over the picture (`region_cells`), so the visual tokens keep
    where things are, as pixel shuffle's do, instead of pooling the patches as a set.

    No data is needed. `pictures` flat pictures (one random colour each, [pictures, 3, S, S] normalized pixels in
    [-1, 1], S the encoder's `image_size`) run through the vision tower and the modality projection; the mean of
    each patch's normalized context over them, less its mean over patches, is the part of the context
    [P, hidden] that only where the patch is decides. With U an orthonormal basis of that part (rank
    r <= min(P - 1, hidden / 2)) and A r other directions orthogonal to U:

    - every block's key projection becomes U U^T (keys keep only their position part);
    - the latents [queries, hidden] become the position codes of their cells written in A, so their own keys are
      zero and a query does not attend to the latents; their scale is the RMS of the value path's output
      (o_proj(v_proj(context))), so the residual does not hide what a query reads;
    - each block's query projection becomes s U A^T, with s such that on the flat pictures a query's logit on its
      own patches exceeds its others by `gap` on average. Later blocks share U and A (their query input keeps the
      latents in its residual) and are scaled on the latents the earlier blocks produce. With gap 20 a query of the
      demo's 16-query model puts 93% of its attention on its own patch on the flat pictures, 52% on real ones.

    Needs square attention projections (heads x head_dim = hidden, as `model.projector: perceiver` builds) and an
    encoder whose output depends on where a patch is (SigLIP's learned position table; `Idefics2Spec.init_random`
    for random encoders). Costs one encoder forward of `pictures` pictures (about a minute on a 2-core CPU for
    SigLIP-so400m). Returns, per block, the mean attention share of a query on its own patches (of all its keys:
    patches and latents) on the flat pictures; an empty list, with the resampler left as it was, when the encoder's
    output carries no position or a block cannot be seeded (none is then). Keeping locality in a resampler: Honeybee (Cha et al. 2024, arXiv:2312.06742);
    Qwen-VL adds 2D position encodings to its resampler's queries and keys for the same reason (Bai et al. 2023,
    arXiv:2308.12966)."""
    import torch

    vision = vlm.get_submodule(vision_path)
    connector = vlm.get_submodule(connector_path)
    resampler = connector.perceiver_resampler
    param = resampler.latents
    size, patch = int(vision.config.image_size), int(vision.config.patch_size)
    side = size // patch
    gen = torch.Generator().manual_seed(seed)
    colours = torch.rand(pictures, 3, 1, 1, generator=gen) * 2 - 1
    pixels = colours.expand(pictures, 3, size, size).to(param.device, param.dtype)
    shares: list[float] = []
    with torch.no_grad():
        context = connector.modality_projection(vision(pixel_values=pixels).last_hidden_state).float()
        if context.shape[1] != side * side:
            return shares
        mask = torch.ones(pictures, context.shape[1], dtype=torch.long, device=param.device)
        hidden = context.shape[-1]
        own = region_cells(param.shape[0], side).to(param.device)                # [queries, P]
        if any(layer.self_attn.q_proj.weight.shape != (hidden, hidden) or layer.self_attn.k_proj.weight.shape != (hidden, hidden)
               for layer in resampler.layers):
            return shares
        start = {k: v.clone() for k, v in resampler.state_dict().items()}  # put back if a block cannot be seeded
        for index, layer in enumerate(resampler.layers):
            attn = layer.self_attn
            ctx = layer.input_context_norm(context.to(param.dtype)).float()      # [n, P, hidden]
            if index == 0:
                found = _position_basis(ctx, gen)
                if found is None:
                    return _restore(resampler, start)
                position, u, a = found
                cells = own.float() / own.sum(1, keepdim=True)
                codes = (cells @ position) @ u @ a.T                            # [queries, hidden], in span(a)
                value_rms = attn.o_proj(attn.v_proj(ctx.to(param.dtype))).float().pow(2).mean().sqrt()
                codes = codes / codes.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
                resampler.latents.copy_((codes * value_rms).to(param.dtype))
            latents = _block_input(resampler, index, context.to(param.dtype), mask).float()   # [n, queries, hidden]
            queries = layer.input_latents_norm(latents.to(param.dtype)).float() @ a @ u.T
            keys = ctx @ u @ u.T
            heads, dim = attn.num_heads, attn.head_dim
            n, q_len = queries.shape[:2]
            logits = torch.einsum("nihd,njhd->nhij", queries.view(n, q_len, heads, dim),
                                  keys.view(n, -1, heads, dim)) * attn.scaling       # [n, heads, queries, P] at s = 1
            spread = logits[..., own].mean() - logits[..., ~own].mean() if (~own).any() else logits[..., own].mean()
            if spread <= 0:
                return _restore(resampler, start)
            scale = gap / spread.item()
            attn.k_proj.weight.copy_((u @ u.T).to(param.dtype))
            attn.q_proj.weight.copy_((scale * u @ a.T).to(param.dtype))
            # the latents' keys are zero: logit 0 each, next to the patches'
            weights = torch.cat([logits * scale, logits.new_zeros(*logits.shape[:-1], q_len)], -1).softmax(-1)
            shares.append((weights[..., :own.shape[1]] * own).sum(-1).mean().item())
    return shares


def _restore(resampler, state) -> list[float]:
    """Put the resampler's parameters back to `state` (a block could not be seeded: none is) and return []."""
    resampler.load_state_dict(state)
    return []


def _position_basis(ctx, gen):
    """(position [P, hidden], U [hidden, r], A [hidden, r]) of the normalized context `ctx` [n, P, hidden] of flat
    pictures: the part of each patch's context that only its place decides (mean over pictures less the mean over
    patches), an orthonormal basis U of its span (r <= hidden / 2) and r random orthonormal directions A orthogonal
    to U. None when the context does not depend on where a patch is."""
    import torch

    hidden = ctx.shape[-1]
    position = ctx.mean(0) - ctx.mean((0, 1))
    if position.pow(2).mean().sqrt() < 1e-4 * ctx.pow(2).mean().sqrt():
        return None
    basis, values, _ = torch.linalg.svd(position.T, full_matrices=False)
    rank = min(int((values > values[0] * 1e-3).sum()), hidden // 2)
    u = basis[:, :rank]
    other = torch.randn(hidden, rank, generator=gen).to(u)
    a, _ = torch.linalg.qr(other - u @ (u.T @ other))
    return position, u, a


def _block_input(resampler, index: int, context, mask):
    """The latents [n, queries, hidden] that block `index` of the resampler receives for `context` [n, P, hidden]."""
    seen = {}

    def grab(module, args, kwargs):
        seen["latents"] = args[0] if args else kwargs["latents"]

    hook = resampler.layers[index].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        resampler(context=context, attention_mask=mask)
    finally:
        hook.remove()
    return seen["latents"]
