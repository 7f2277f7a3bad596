"""The engine's own merge of a prompt batch's visual features into its embeddings, for models whose forward would
wait on the device to do it.

transformers' Qwen2-VL and Qwen2.5-VL forwards (transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py,
`Qwen2_5_VLModel.forward`) merge the vision tower's tokens into the prompt's embeddings in three steps that each
read a value back from the device: `get_image_features` splits the tower's output per picture with
`grid_thw.prod(-1).tolist()`, and `get_placeholder_mask` counts the placeholder tokens and checks the count against
the features (the check, and the count formatted into its message). At a serving prefill each read waits for the
decode step in flight and leaves the GPU idle while the host prepares the next launch (docs/benchmarks.md, "the
synchronizing calls of one admission"). The split is undone by the forward itself (`torch.cat` of the pieces), and
the count is known on the host, where the processor wrote the tokens.

`qwen_merge` does the same merge without those reads: the embeddings of `input_ids`, the tower's merged tokens
(`pooler_output`, through `EncoderGraphs` where installed), and `masked_scatter` into the placeholder positions,
with the count checked on the host's copy of the tokens and grids. The model's forward is then given
`inputs_embeds` and no pixels, so it goes straight to its language model. It is used only where the forward is
also given its position ids (the engine computes Qwen-VL's on the host: `FamilySpec.prompt_positions`), since
the forward derives multimodal RoPE positions from `input_ids`, which it no longer gets.

Families name their merge (`FamilySpec.prompt_merge`, a `MERGES` key): Qwen2-VL and Qwen2.5-VL. Qwen3-VL's forward
also hands the language model DeepStack features per layer and keeps its own path.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

_MEDIA = (("pixel_values", "image_grid_thw", "image_token_id", "image"),
          ("pixel_values_videos", "video_grid_thw", "video_token_id", "video"))


def qwen_merge(model, family, inputs: Mapping[str, Any], host: Mapping[str, Any]) -> dict[str, Any] | None:
    """`inputs` (a Qwen2-VL / Qwen2.5-VL prompt batch's processor tensors on the model's device, with
    `position_ids`) with `input_ids` [B, T] and the pixels (`pixel_values` [P, C*t*p*p], `pixel_values_videos`)
    replaced by `inputs_embeds` [B, T, D]: the token embeddings with each placeholder token's row replaced, in order,
    by the vision tower's merged tokens (`pooler_output` [N, D] of every picture, then every clip; the tower is the
    `family`'s image encoder). Equal to what the model's own forward computes (module docstring). `host`: the same
    tensors on the host, where the placeholder count is checked against the grids (t * h * w / merge**2 tokens per
    picture).

    Returns None (the forward's own path) where a tensor it needs is missing: `input_ids` or `position_ids` on the
    device, or the host's `input_ids` and a grid. Raises ValueError when a batch's placeholder tokens do not match
    its pictures' grids (transformers raises the same at this point)."""
    from vlmctl.errors import ModelError
    from vlmctl.families.encoders import submodule

    try:
        tower = submodule(model, family.encoders["image"].path)
    except (KeyError, ModelError):  # a model without the family's tower: the forward's own path
        tower = None
    ids, host_ids = inputs.get("input_ids"), host.get("input_ids")
    if tower is None or ids is None or host_ids is None or inputs.get("position_ids") is None:
        return None
    media = [(pixels, grid, token, what) for pixels, grid, token, what in _MEDIA if inputs.get(pixels) is not None]
    if not media or any(inputs.get(grid) is None or host.get(grid) is None for _, grid, _, _ in media):
        return None
    config = model.config
    merge = int(tower.spatial_merge_size)
    for _, grid, token, what in media:  # on the host: nothing waits for the device
        placeholders = int((host_ids == getattr(config, token)).sum())
        features = int((host[grid].prod(-1) // (merge * merge)).sum())
        if placeholders != features:
            raise ValueError(f"{what} features and {what} tokens do not match: the prompt batch has {placeholders} "
                             f"{what} tokens, its {grid} {features} features")
    embeds = model.get_input_embeddings()(ids)
    for pixels, grid, token, _ in media:
        tokens = tower(inputs[pixels].type(tower.dtype), grid_thw=inputs[grid]).pooler_output
        mask = (ids == getattr(config, token)).unsqueeze(-1)
        embeds = embeds.masked_scatter(mask, tokens.to(embeds.device, embeds.dtype))
    out = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "pixel_values_videos")}
    out["inputs_embeds"] = embeds
    return out


MERGES: dict[str, Callable[..., dict[str, Any] | None]] = {"qwen": qwen_merge}
"""`FamilySpec.prompt_merge` names -> the engine's merge of the visual features (`qwen_merge`'s signature)."""


def merge_for(model, family) -> Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any] | None] | None:
    """The merge `model` of `family` takes at prefill (`MERGES[family.prompt_merge]`, bound to both), or None where
    the engine leaves the merge to the model's forward."""
    merge = MERGES.get(getattr(family, "prompt_merge", None) or "")
    if merge is None:
        return None
    return lambda inputs, host: merge(model, family, inputs, host)


__all__ = ["MERGES", "merge_for", "qwen_merge"]
