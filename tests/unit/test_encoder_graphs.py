"""`vlmctl.inference.encoder_graphs`: a Qwen-VL vision tower run with its grid-derived inputs precomputed, and
replayed through the graph path's buffers, gives the tower's own output; layouts are keyed by their grids; a forward
that trains, or a tower whose capture fails, runs as it is."""

from __future__ import annotations

import pytest
import torch

from vlmctl.families.registry import FAMILIES
from vlmctl.inference import load_for_generation
from vlmctl.inference.encoder_graphs import EncoderGraphs, install_encoder_graphs, qwen_grid_inputs


class Replayed:
    """A stand-in for a CUDA graph on the CPU: `replay()` runs what was captured again, over the same buffers."""

    def __init__(self, run):
        self.run, self.replays = run, 0

    def replay(self):
        self.replays += 1
        self.run()


def _tower_inputs(model, grids, seed=0):
    tower = model.model.visual
    cfg = model.config.vision_config
    per_patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    patches = sum(t * h * w for t, h, w in grids)
    g = torch.Generator().manual_seed(seed)
    return tower, torch.randn(patches, per_patch, generator=g), torch.tensor(grids)


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny-qwen2-vl"])
def test_the_graph_path_gives_the_towers_own_output(tiny_models, preset):
    """Two layouts (one picture; two of other sizes), each seen three times with new pixels: the first call of a
    layout runs with the precomputed inputs, the next ones replay through the input and output buffers; every output
    equals the tower's own forward exactly (fp32), and the second layout never reuses the first's inputs."""
    model, _ = load_for_generation(tiny_models(preset), device="cpu", dtype="fp32")
    graphs = [0]

    def record(run):
        graphs[0] += 1
        return Replayed(run)

    tower = model.model.visual
    wrapped = EncoderGraphs(tower, qwen_grid_inputs, record).install()
    try:
        with torch.inference_mode():
            for seed in range(3):
                for grids in ([(1, 8, 8)], [(1, 4, 8), (1, 8, 12)]):
                    _, x, grid = _tower_inputs(model, grids, seed)
                    got = tower(x, grid_thw=grid).pooler_output.clone()
                    wrapped.remove()
                    want = tower(x, grid_thw=grid).pooler_output
                    wrapped.install()
                    assert torch.equal(got, want), (grids, seed)
        assert graphs[0] == 2 and wrapped.captures == 2 and wrapped.replays == 4 and not wrapped.reason
    finally:
        wrapped.remove()


def test_training_forwards_and_failed_captures_run_the_tower_as_it_is(tiny_models):
    model, _ = load_for_generation(tiny_models("tiny-qwen2.5-vl"), device="cpu", dtype="fp32")
    tower, x, grid = _tower_inputs(model, [(1, 8, 8)])
    with torch.inference_mode():
        want = tower(x, grid_thw=grid).pooler_output

    def broken(run):
        raise RuntimeError("operation not permitted when stream is capturing")

    wrapped = EncoderGraphs(tower, qwen_grid_inputs, broken).install()
    try:
        out = tower(x, grid_thw=grid).pooler_output  # grad on: the class's forward, nothing kept
        assert out.requires_grad and not wrapped.entries
        with torch.inference_mode():
            for _ in range(3):
                assert torch.equal(tower(x, grid_thw=grid).pooler_output, want)
        assert "capture failed" in wrapped.reason and wrapped.replays == 0 and not wrapped.entries
    finally:
        wrapped.remove()
    assert "forward" not in tower.__dict__


def test_layouts_past_the_limit_are_dropped_oldest_first(tiny_models):
    model, _ = load_for_generation(tiny_models("tiny-qwen2.5-vl"), device="cpu", dtype="fp32")
    wrapped = EncoderGraphs(model.model.visual, qwen_grid_inputs, Replayed, max_graphs=2).install()
    try:
        with torch.inference_mode():
            for side in (4, 8, 12, 8):
                _, x, grid = _tower_inputs(model, [(1, side, side)])
                model.model.visual(x, grid_thw=grid)
        assert [k[2] for k in wrapped.entries] == [((1, 12, 12),), ((1, 8, 8),)]
        assert wrapped.new_layouts == 3  # 4, 8 and 12 met first; 8 again is a capture
    finally:
        wrapped.remove()


def test_only_towers_that_take_precomputed_inputs_are_wrapped(tiny_models):
    """Qwen2-VL and Qwen2.5-VL name their grid inputs; Qwen3-VL (DeepStack outputs) and LLaVA do not. Installing
    again (a new engine) replaces the earlier wrapper; `enabled=False` only removes it."""
    assert FAMILIES["qwen2_5_vl"].encoders["image"].graph_inputs == "qwen_grid"
    assert FAMILIES["qwen3_vl"].encoders["image"].graph_inputs is None
    model, _ = load_for_generation(tiny_models("tiny-qwen2.5-vl"), device="cpu", dtype="fp32")
    first = install_encoder_graphs(model, FAMILIES["qwen2_5_vl"], None)
    second = install_encoder_graphs(model, FAMILIES["qwen2_5_vl"], None)
    assert model.model.visual.__dict__["forward"] is second["image"] is not first["image"]
    assert install_encoder_graphs(model, FAMILIES["qwen2_5_vl"], None, enabled=False) == {}
    assert "forward" not in model.model.visual.__dict__
    llava, _ = load_for_generation(tiny_models("tiny"), device="cpu", dtype="fp32")
    assert install_encoder_graphs(llava, FAMILIES["llava"], None) == {}


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny-qwen2-vl"])
def test_pictures_of_one_size_share_the_layout_of_the_next_power_of_two(tiny_models, preset):
    """Three, then three, then four pictures of one size run as the same four-picture layout (blank pictures after
    the real ones): one layout, captured and replayed at its second use, replayed at its third; each output is the tower's own
    for the real pictures alone. Pictures of mixed sizes keep their exact layout."""
    from vlmctl.inference.encoder_graphs import padded_count

    assert [padded_count([[1, 8, 8]] * n, 64 * n, 16384) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert padded_count([[1, 8, 8], [1, 8, 8], [1, 4, 8]], 160, 16384) == 3  # mixed sizes: as they are
    assert padded_count([[1, 8, 8]] * 3, 192, 200) == 3  # four would pass max_patches
    model, _ = load_for_generation(tiny_models(preset), device="cpu", dtype="fp32")
    tower = model.model.visual
    wrapped = EncoderGraphs(tower, qwen_grid_inputs, Replayed).install()
    try:
        with torch.inference_mode():
            for seed, count in enumerate((3, 3, 4)):
                _, x, grid = _tower_inputs(model, [(1, 8, 8)] * count, seed)
                out = tower(x, grid_thw=grid)
                wrapped.remove()
                want = tower(x, grid_thw=grid)
                wrapped.install()
                assert out.pooler_output.shape == want.pooler_output.shape
                assert torch.allclose(out.pooler_output, want.pooler_output, atol=1e-5, rtol=1e-5), (count, seed)
                assert torch.allclose(out.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=1e-5)
        assert [k[2] for k in wrapped.entries] == [((1, 8, 8),) * 4]
        assert wrapped.captures == 1 and wrapped.replays == 2 and not wrapped.reason
    finally:
        wrapped.remove()


class Unread(torch.Tensor):
    """A grid whose values must not be copied to the host (`tolist` would wait for the device on a GPU)."""

    def tolist(self):
        raise AssertionError("the grid was read from its tensor")


def test_a_hinted_grid_is_read_from_the_hosts_copy_and_the_hints_then_clear(tiny_models):
    """With the host's copy of a forward's grid given (`hint`, as the engine's prefill gives the processor's host
    tensors), the layout is found without reading the grid's tensor, and the output is the tower's own; a grid of
    another tensor, or after the hints are cleared, is read from its tensor."""
    model, _ = load_for_generation(tiny_models("tiny-qwen2.5-vl"), device="cpu", dtype="fp32")
    tower, x, grid = _tower_inputs(model, [(1, 8, 8), (1, 8, 8), (1, 8, 8)])
    wrapped = EncoderGraphs(tower, qwen_grid_inputs, lambda run: Replayed(run)).install()
    try:
        with torch.inference_mode():
            want = tower(x, grid_thw=grid).pooler_output.clone()  # the layout met (its inputs computed from `grid`)
            unread = grid.as_subclass(Unread)
            wrapped.hint(unread, grid)
            got = tower(x, grid_thw=unread).pooler_output.clone()  # padded to 4 pictures, captured: no read
            assert torch.equal(got, want) and wrapped.captures == 1 and wrapped.replays == 1
            wrapped.hints.clear()
            with pytest.raises(AssertionError, match="read from its tensor"):
                tower(x, grid_thw=unread)
            wrapped.hint(grid.clone(), grid)  # another tensor of the same values: not the one the forward gets
            with pytest.raises(AssertionError, match="read from its tensor"):
                tower(x, grid_thw=unread)
    finally:
        wrapped.remove()
