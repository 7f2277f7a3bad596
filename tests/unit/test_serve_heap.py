"""`vlmctl serve`'s garbage collector: its pauses counted per generation, the heap alive after start-up frozen out of
its collections (objects made later still collected), /health reporting both, and the heap given back when the
server stops."""

from __future__ import annotations

import gc
import json
import urllib.request
import weakref

import pytest

from vlmctl.serve.heap import GCPauses, freeze_heap, unfreeze_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_pauses_are_counted_per_generation_until_removed():
    pauses = GCPauses().install()
    try:
        gc.collect(0)
        gc.collect()
        counted = pauses.describe()
        assert counted["collections"][0] >= 1 and counted["collections"][2] >= 1
        assert counted["seconds"][2] > 0 and counted["longest_seconds"] > 0
    finally:
        pauses.remove()
    gc.collect()
    assert pauses.describe()["collections"] == counted["collections"]
    assert pauses not in gc.callbacks


def test_the_frozen_heap_is_skipped_and_what_comes_later_is_still_collected():
    kept = Node()
    alive = weakref.ref(kept)
    try:
        frozen = freeze_heap()
        assert frozen > 0 and 0 < gc.get_freeze_count() <= frozen  # frozen objects freed since leave the count
        del kept
        gc.collect()
        assert alive() is not None  # in the permanent generation: no collection looks at it
        later = Node()
        dropped = weakref.ref(later)
        del later
        gc.collect()
        assert dropped() is None  # made after the freeze: collected as before
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # given back to the collector


@pytest.mark.parametrize("freeze", [True, False])
def test_the_server_freezes_its_heap_reports_its_collections_and_gives_the_heap_back(tiny_models, freeze):
    pytest.importorskip("starlette")
    from vlmctl.inference import load_for_generation
    from vlmctl.serve import ServeSettings, running_server

    folder = tiny_models("tiny-qwen2.5-vl")
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    before = gc.get_freeze_count()  # what other code of this process froze, if anything
    with running_server(model, processor, ServeSettings(port=0, freeze_heap=freeze), name="tiny", model_dir=folder) as url:
        gc.collect()  # counted by the server's callback: it runs in this process
        with urllib.request.urlopen(f"{url}/health", timeout=30) as reply:
            state = json.load(reply)["gc"]
        assert (state["frozen"] > before) == freeze
        assert state["collections"][2] >= 1 and state["seconds"][2] > 0
    assert gc.get_freeze_count() == (0 if freeze else before)  # a heap it froze given back, none other touched
    assert not any(isinstance(c, GCPauses) for c in gc.callbacks)
