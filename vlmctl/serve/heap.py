"""The interpreter's garbage collector in a serving process: its pauses counted, and the start-up heap frozen.

    pauses = GCPauses().install()   # every collection's generation and seconds (gc.callbacks)
    frozen = freeze_heap()          # after the model is loaded and the engine warmed up: objects moved out of reach
    ...
    pauses.describe()               # {"collections": [g0, g1, g2], "seconds": [...], "longest_seconds", "frozen"}
    pauses.remove(); unfreeze_heap()

CPython's cyclic collector stops every thread of the process while it runs, and a collection of the oldest generation
walks every object still alive. Once torch, transformers and a model are loaded that is about half a million
objects (160 ms for one full collection on a 2-core CPU machine; 0.34-0.45 s on an H200 host serving the 3B preset,
docs/benchmarks.md). The decoding loop allocates objects at every step (token lists, events, tensors' Python wrappers),
and some outlive the young generations, so such collections keep coming back (once in about 2,300 requests at 32
clients there), each one a pause of every client's stream and a gap on the GPU. `gc.freeze()` (Python 3.7+, the `gc` module's documentation)
moves every object alive at that moment into a permanent generation that collections skip; the objects made later are
collected as before. vLLM freezes its engine's heap after warm-up in the same way (`freeze_gc_heap` at the end of
`compile_or_warm_up_model`), and SGLang logs long collections for the same reason.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


class GCPauses:
    """Counts the collector's runs per generation (0, 1, 2) and the seconds they took, from `gc.callbacks`. The
    callback runs on whichever thread triggered the collection, with the interpreter lock held, so it only reads a
    clock and adds. `install()` / `remove()` register and unregister it; `describe()` reads the counts."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0  # seconds of the longest single collection
        self.froze = 0  # objects `freeze_heap` moved out of the collector's reach for this server (0: it froze none)
        self._started: dict[int, float] = {}  # per thread: a collection runs on the thread that triggered it

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.perf_counter()
            return
        started = self._started.pop(ident, None)
        generation = int(info.get("generation", 2))
        if started is None or not 0 <= generation <= 2:
            return
        took = time.perf_counter() - started
        self.collections[generation] += 1
        self.seconds[generation] += took
        self.longest = max(self.longest, took)

    def install(self) -> "GCPauses":
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def describe(self) -> dict[str, Any]:
        """{"collections": runs per generation, "seconds": seconds per generation (rounded to 0.1 ms),
        "longest_seconds": the longest run, "frozen": the objects `freeze_heap` froze for this server (`froze`)}.
        The count is the one taken when the heap was frozen: `gc.get_freeze_count()` walks the permanent generation,
        which held the interpreter lock for 20-40 ms per /health on a 2-core CPU with a tiny model's 400,000 objects."""
        return {"collections": list(self.collections), "seconds": [round(s, 4) for s in self.seconds],
                "longest_seconds": round(self.longest, 4), "frozen": self.froze}


def freeze_heap() -> int:
    """Collect what is garbage now, then move every object still alive into the permanent generation that
    collections skip (`gc.freeze`); returns how many objects it holds. Call it once start-up is done (model loaded,
    graphs captured), before serving."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_heap() -> None:
    """Put the frozen objects back into the oldest generation (`gc.unfreeze`), so a process that goes on after
    serving (tests, `serve --check`) collects them again."""
    gc.unfreeze()


__all__ = ["GCPauses", "freeze_heap", "unfreeze_heap"]
