"""A vision tower's grid-derived inputs computed on the host ahead of the training step (Qwen2-VL, Qwen2.5-VL).

transformers' Qwen-VL vision towers derive their rotary positions, attention segment boundaries and Qwen2.5-VL's
window order from the images' grids `grid_thw` on the device (`transformers/vision_utils.py`): about 15 reads back
to the host per forward of a Qwen2.5-VL tower (`benchmarks/step_syncs.py`), each of which makes the host wait for
everything queued before it. At a step's start that is the last optimizer update, so the device finishes the
update, then idles while the host launches the tower's small kernels one by one. The towers take those inputs
precomputed as keyword arguments (as serve's CUDA graphs pass them, `vlmctl.inference.encoder_graphs`).

Here `TowerInputs.prepare` (a batch hook, run by `loop.prefetch` in its thread) computes them from the host copy of
the batch's image grids with transformers' own helpers, under `KEY`; `loop.to_device` copies them to the device with
the batch; the engine's `inputs(batch)` stages them (`stage`), and a forward pre-hook on the tower hands them to its
next forward. The host then queues the tower while the device still runs the last update. Only images: a video's
forward computes its own. A forward whose patch count differs from the staged inputs' (another batch's) gets none.
"""

from __future__ import annotations

from typing import Any, Callable

from vlmctl.data.collate import TOWER_INPUTS_KEY as KEY  # {keyword argument: host tensor or int}; not a model input

# The inference helpers are imported inside the function that uses them: the engine imports this module, and
# importing vlmctl (the CLI's start-up) must not pay for them.

_STAGED: list = [None]  # the inputs of the next tower forward (`stage`), taken by the tower's pre-hook


def stage(batch: dict[str, Any]) -> None:
    """Stage `batch`'s precomputed tower inputs (or none: a batch without them clears what an earlier batch left) for
    the next forward of a tower that has a `TowerInputs` hook."""
    _STAGED[0] = batch.get(KEY)


class TowerInputs:
    """The forward pre-hook on `tower` and the batch hook computing its inputs: `compute(tower, grid_thw)` returns
    the tower's keyword arguments for images of grids `grid_thw` [N, 3] (host), e.g.
    `encoder_graphs.qwen_grid_inputs`: `position_ids` [P, 2] for P patches, `cu_seqlens`, `max_seqlen`, ..."""

    def __init__(self, tower: Any, compute: Callable[[Any, Any], dict[str, Any]]) -> None:
        self.tower, self.compute = tower, compute
        self.handle = tower.register_forward_pre_hook(self._hook, with_kwargs=True)

    def prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        """`batch` with its images' tower inputs under `KEY` (host tensors); unchanged without images, or where
        transformers has no helpers for them (ImportError)."""
        grid = batch.get("image_grid_thw")
        if grid is None or batch.get("pixel_values") is None:
            return batch
        try:
            inputs = self.compute(self.tower, grid)
        except ImportError:
            return batch
        return {**batch, KEY: inputs}

    def _hook(self, module, args, kwargs):  # noqa: ARG002 - torch's pre-hook signature
        inputs, _STAGED[0] = _STAGED[0], None
        if inputs is None or "forward" in module.__dict__:  # a replaced forward (sequence parallelism's split) computes its own
            return None
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is None or int(inputs["position_ids"].shape[0]) != int(hidden.shape[0]) or any(k in kwargs for k in inputs):
            return None  # not the forward they were computed for
        return args, {**kwargs, **inputs}

    def remove(self) -> None:
        self.handle.remove()


def install_tower_inputs(model: Any, family: Any) -> list[TowerInputs]:
    """A `TowerInputs` on each image encoder of `family` in `model` whose `EncoderSpec.graph_inputs` names a function
    of `encoder_graphs.GRID_INPUTS` (the towers that take their grid-derived inputs precomputed); [] for others.
    Not for sequence parallelism, whose split forward hands each rank's tower a part of the images."""
    from vlmctl.inference.encoder_graphs import grid_towers

    return [TowerInputs(tower, compute) for _, enc, tower, compute in grid_towers(model, family)
            if "image" in getattr(enc, "modalities", ("image",))]


def chain(*hooks: Callable[[dict[str, Any]], dict[str, Any]] | None) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """One batch hook running `hooks` (None ones left out) in order; None when there are none."""
    hooks = tuple(h for h in hooks if h is not None)
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0]

    def run(batch: dict[str, Any]) -> dict[str, Any]:
        for hook in hooks:
            batch = hook(batch)
        return batch

    return run
