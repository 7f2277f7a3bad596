"""CUDA graphs of a vision tower's forward at prefill, one per image-grid layout.

A prompt's images go through the vision tower once, at its prefill. For the small images of a chat turn or a VQA
set the tower is bound by the host, not the GPU: Qwen2.5-VL's 32 blocks launch some 600 kernels from Python, about
80 ms of host time on one H200 for a prefill of 16 pictures of 64 px against a few ms of GPU work. Replayed from a
CUDA graph the same forward is one launch.

A graph fixes every shape and every index the tower derives from the images' grids (rotary positions, attention
segment boundaries, Qwen2.5-VL's window order). transformers' Qwen-VL towers compute those on the host from
`grid_thw` (`grid_thw.tolist()` in transformers/vision_utils.py), which a capture cannot do, and take them
precomputed as keyword arguments instead (`get_vision_position_ids(..., kwargs=kwargs)` and its siblings pop them).
So a graph is keyed by the patch tensor's shape and dtype and the grids' values; the grid-derived tensors are
computed once per key (`GRID_INPUTS`, named by the family's `EncoderSpec.graph_inputs`), moved to the device and
kept with the graph; the patches are copied into the graph's input buffer before each replay and the merged visual
tokens copied out of its output buffer.

Pictures of one size (a serving client's camera, a VQA set of one resolution) are padded to a power-of-two count
with blank pictures of that size (`padded_count`): each attends only within its own picture (the grid's segment
boundaries), so the real pictures' tokens are what they would be alone, and a prefill of any number of them meets
one of a few layouts instead of one per count. Pictures of mixed sizes keep their exact layout.

A key is captured at its second use (its first runs eagerly with the precomputed arguments), so one-off layouts
cost no capture; at most `max_graphs` are kept (the least recently used is dropped) and a layout of more than
`max_patches` patches always runs eagerly. A capture that fails turns the graphs off for the tower, and `reason`
says why; the eager forward is unchanged. Only under `torch.no_grad`/inference mode (a forward that trains never
takes this path).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

# torch and transformers are imported inside the functions that use them: importing vlmctl must not pay for them.


def qwen_grid_inputs(tower, grid_thw) -> dict[str, Any]:
    """The keyword arguments a Qwen2-VL / Qwen2.5-VL vision tower (transformers >= 5.17) takes precomputed for images
    of grids `grid_thw` [N, 3] (temporal, height, width in patches): `position_ids` [P, 2], `cu_seqlens` [S + 1]
    int32 with `max_seqlen`, and with window attention (`tower.window_size`) `window_index` [P / merge^2],
    `cu_window_seqlens` and `max_window_seqlen`, all on the tower's device. Computed by transformers' own helpers
    (transformers/vision_utils.py), so they are the values the tower would compute. Raises ImportError on a
    transformers without those helpers."""
    from transformers import vision_utils as vu

    device = grid_thw.device
    out: dict[str, Any] = {"position_ids": vu.get_vision_position_ids(grid_thw, tower.spatial_merge_size)}
    cu = vu.get_vision_cu_seqlens(grid_thw)
    out["cu_seqlens"], out["max_seqlen"] = cu, int((cu[1:] - cu[:-1]).max())
    if getattr(tower, "window_size", None) and hasattr(tower, "fullatt_block_indexes"):
        index, cu_window = vu.get_vision_window_index(grid_thw, spatial_merge_size=tower.spatial_merge_size,
                                                      window_size=tower.window_size, patch_size=tower.patch_size)
        out.update(window_index=index, cu_window_seqlens=cu_window, max_window_seqlen=int((cu_window[1:] - cu_window[:-1]).max()))
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in out.items()}


def padded_count(grids: list[list[int]], patches: int, max_patches: int) -> int:
    """How many pictures a layout of `grids` (rows of temporal, height, width in patches) of `patches` patches in
    all is run as: the next power of two of their count where every grid is the same and the padded layout stays
    within `max_patches`, else their own count."""
    n = len(grids)
    size = 1 << (n - 1).bit_length()  # the next power of two (runner.bucket's, which would import runner in a cycle)
    if size == n or any(g != grids[0] for g in grids) or patches // n * size > max_patches:
        return n
    return size


GRID_INPUTS: dict[str, Callable[[Any, Any], dict[str, Any]]] = {"qwen_grid": qwen_grid_inputs}
"""`EncoderSpec.graph_inputs` names -> the function computing a tower's grid-derived keyword arguments."""


class EncoderGraphs:
    """Replay `tower`'s forward (a Qwen-VL vision tower: `forward(hidden_states [P, C*T*p*p], grid_thw [N, 3])`
    returning `last_hidden_state` [P, D] and `pooler_output` [tokens, D_out]) from CUDA graphs (module docstring).

    `inputs`: the grid-derived keyword arguments of a grid (`GRID_INPUTS`). `record(run)`: captures `run()` (device
    work only) into a CUDA graph and returns it (`ModelRunner._capture_run`: warm-up runs, the runner's memory
    pool); None keeps every call eager with the precomputed arguments (how the CPU tests check them). Installed as
    the tower's instance `forward` by `install`; `remove` restores the class's."""

    def __init__(self, tower, inputs: Callable[[Any, Any], dict[str, Any]], record: Callable | None, *,
                 max_graphs: int = 32, max_patches: int = 16384):
        self.tower, self.inputs, self.record = tower, inputs, record
        self.forward = type(tower).forward
        self.max_graphs, self.max_patches = int(max_graphs), int(max_patches)
        self.entries: OrderedDict[tuple, dict[str, Any]] = OrderedDict()  # key -> grid inputs, buffers, graph
        self.replays = 0  # forwards replayed from a graph
        self.captures = 0
        self.new_layouts = 0  # layouts met for the first time (each ran eagerly: the slowest forward of a layout)
        self.reason = ""  # why graphs stopped (a failed capture), else ""
        self.hints: dict[int, tuple[Any, list]] = {}  # id(device grid) -> (that tensor, its rows on the host): `hint`

    def hint(self, grid_thw, rows) -> None:
        """The host's copy `rows` (a CPU tensor) of the device tensor `grid_thw`, for the next forward given that very
        tensor: the grids are then read without copying them from the device, which waits for every kernel queued
        before (a decode step in flight). The caller clears `hints` after the forward."""
        self.hints[id(grid_thw)] = (grid_thw, rows.tolist())

    def _rows(self, grid_thw) -> list:
        hinted = self.hints.get(id(grid_thw))
        if hinted is not None and hinted[0] is grid_thw and len(hinted[1]) == grid_thw.shape[0]:
            return hinted[1]
        return grid_thw.tolist()

    def install(self) -> "EncoderGraphs":
        self.tower.forward = self
        return self

    def remove(self) -> None:
        self.tower.__dict__.pop("forward", None)

    @property
    def graph_count(self) -> int:
        return sum(1 for e in self.entries.values() if e.get("graph") is not None)

    def __call__(self, hidden_states, grid_thw=None, **kwargs):
        import torch

        if (kwargs or grid_thw is None or torch.is_grad_enabled() or self.reason
                or hidden_states.shape[0] > self.max_patches):
            return self.forward(self.tower, hidden_states, grid_thw, **kwargs)
        grids = self._rows(grid_thw)
        count = padded_count(grids, hidden_states.shape[0], self.max_patches)
        if count == len(grids):
            return self._layout(hidden_states, grid_thw, grids)
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # blank pictures of the same grid after the real ones; their patches and tokens are cut off the outputs
        patches, extra = hidden_states.shape[0], count - len(grids)
        padded = torch.cat([hidden_states, hidden_states.new_zeros(patches // len(grids) * extra, hidden_states.shape[1])])
        out = self._layout(padded, torch.cat([grid_thw, grid_thw[-1:].expand(extra, -1)]), grids + [grids[-1]] * extra)
        tokens = out.pooler_output.shape[0] // count * len(grids)
        return BaseModelOutputWithPooling(last_hidden_state=out.last_hidden_state[:patches],
                                          pooler_output=out.pooler_output[:tokens])

    def _layout(self, hidden_states, grid_thw, grids: list):
        """The forward of one layout (`grids`: `grid_thw`'s rows, read on the host): precomputed inputs at its first
        use, a capture at its second, replays after."""
        key = (tuple(hidden_states.shape), hidden_states.dtype, tuple(tuple(int(v) for v in row) for row in grids))
        entry = self.entries.get(key)
        if entry is None:
            try:
                entry = {"grid": grid_thw.clone(), "inputs": self.inputs(self.tower, grid_thw)}
            except Exception as exc:  # noqa: BLE001 - a transformers without the helpers: eager, and say why
                self.reason = f"grid inputs failed: {type(exc).__name__}: {str(exc)[:200]}"
                return self.forward(self.tower, hidden_states, grid_thw)
            self._keep(key, entry)
            self.new_layouts += 1
            return self.forward(self.tower, hidden_states, grid_thw, **dict(entry["inputs"]))
        self.entries.move_to_end(key)
        if self.record is None:
            return self.forward(self.tower, hidden_states, entry["grid"], **dict(entry["inputs"]))
        if entry.get("graph") is None:
            entry["x"] = hidden_states.clone()
            try:
                out = self.forward(self.tower, entry["x"], entry["grid"], **dict(entry["inputs"]))
                entry["last"], entry["pooled"] = out.last_hidden_state.clone(), out.pooler_output.clone()
                entry["graph"] = self.record(lambda: self._run(entry))
                self.captures += 1
            except Exception as exc:  # noqa: BLE001 - a tower that cannot be captured runs eagerly, and says why
                self.reason = f"vision graph capture failed: {type(exc).__name__}: {str(exc)[:200]}"
                self.entries.clear()
                return self.forward(self.tower, hidden_states, grid_thw)
        entry["x"].copy_(hidden_states)
        entry["graph"].replay()
        self.replays += 1
        return self._output(entry)

    def _run(self, entry: dict[str, Any]) -> None:
        """The forward over the entry's buffers: every device op, no host synchronization (what is captured)."""
        out = self.forward(self.tower, entry["x"], entry["grid"], **dict(entry["inputs"]))
        entry["last"].copy_(out.last_hidden_state)
        entry["pooled"].copy_(out.pooler_output)

    def _output(self, entry: dict[str, Any]):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # the pooled tokens are cloned (the next replay rewrites the buffer); the patches' last states are the buffer
        return BaseModelOutputWithPooling(last_hidden_state=entry["last"], pooler_output=entry["pooled"].clone())

    def _keep(self, key: tuple, entry: dict[str, Any]) -> None:
        self.entries[key] = entry
        while len(self.entries) > self.max_graphs:
            self.entries.popitem(last=False)


def grid_towers(model, family) -> list[tuple[str, Any, Any, Callable[[Any, Any], dict[str, Any]]]]:
    """(encoder name, its `EncoderSpec`, its tower module in `model`, its `GRID_INPUTS` function) of each encoder of
    `family` whose `EncoderSpec.graph_inputs` names one: the towers that take their grid-derived inputs precomputed.
    Encoders `model` lacks are left out."""
    from vlmctl.errors import ModelError
    from vlmctl.families.encoders import submodule

    towers = []
    for name, enc in getattr(family, "encoders", {}).items():
        inputs = GRID_INPUTS.get(getattr(enc, "graph_inputs", None) or "")
        if inputs is None:
            continue
        try:
            towers.append((name, enc, submodule(model, enc.path), inputs))
        except ModelError:  # a model without that module: nothing to do
            continue
    return towers


def install_encoder_graphs(model, family, record: Callable | None, enabled: bool = True) -> dict[str, EncoderGraphs]:
    """`EncoderGraphs` installed on each encoder of `family` in `model` whose `EncoderSpec.graph_inputs` names a
    `GRID_INPUTS` function (`grid_towers`; with `enabled`; those an earlier engine installed are removed first:
    graphs belong to one engine's pool); {encoder name: its graphs}."""
    installed = {}
    for name, _, tower, inputs in grid_towers(model, family):
        if isinstance(tower.__dict__.get("forward"), EncoderGraphs):
            tower.__dict__["forward"].remove()
        if enabled:
            installed[name] = EncoderGraphs(tower, inputs, record).install()
    return installed


__all__ = ["EncoderGraphs", "GRID_INPUTS", "grid_towers", "install_encoder_graphs", "padded_count", "qwen_grid_inputs"]
