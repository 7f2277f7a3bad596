"""`vlmctl.serve.app`'s event path: the `Relay` hands the worker thread's events to each request's queue in order,
waking the event loop once per burst rather than once per event; a streamed choice whose tokens wait in its queue
sends them as one chunk, and the joined text is the same."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

from vlmctl.serve.app import Relay, _stream


def test_the_relay_keeps_each_queues_order_and_wakes_the_loop_once_per_burst():
    async def main():
        loop = asyncio.get_running_loop()
        relay = Relay(loop)
        queues = [asyncio.Queue() for _ in range(4)]
        sinks = [relay.sink(q) for q in queues]

        def worker():  # what the engine's thread does in a decode step: one event per row, many rows
            for step in range(250):
                for i, sink in enumerate(sinks):
                    sink(("delta", 0, f"{i}:{step}"))

        thread = threading.Thread(target=worker)
        thread.start()
        got = [[] for _ in queues]
        for i, q in enumerate(queues):
            for _ in range(250):
                got[i].append((await asyncio.wait_for(q.get(), 10))[2])
        thread.join()
        return relay, got

    relay, got = asyncio.run(main())
    assert got == [[f"{i}:{step}" for step in range(250)] for i in range(4)]
    assert 1 <= relay.wakeups < 100  # 1,000 events: one call_soon_threadsafe each would be 1,000 wake-ups


def _chunks(events: list[tuple], n: int = 1) -> list[dict | str]:
    async def main():
        queue = asyncio.Queue()
        for event in events[1:]:
            queue.put_nowait(event)
        job = SimpleNamespace(n=n, cancelled=threading.Event())
        out = [piece async for piece in _stream(job, queue, {"id": "x"}, False, events[0], {})]
        assert job.cancelled.is_set()
        return out

    return [json.loads(p[6:]) if p != "data: [DONE]\n\n" else "DONE" for p in asyncio.run(main())]


def test_a_streamed_choices_waiting_tokens_go_out_as_one_chunk_in_order():
    events = [("delta", 0, "Hel"), ("delta", 0, "lo"), ("delta", 1, " wor"), ("delta", 1, "ld"), ("delta", 0, "!"),
              ("done", 0, "stop", 3), ("done", 1, "length", 2), ("end", 7)]
    chunks = _chunks(events, n=2)
    assert chunks[-1] == "DONE"
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"].get("content")) for c in chunks[1:-1]
              if c["choices"][0]["finish_reason"] is None]
    # every token was waiting: joined per run of one choice, in the order they came
    assert deltas == [(0, "Hello"), (1, " world"), (0, "!")]
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks[1:-1]
                if c["choices"][0]["finish_reason"] is not None]
    assert finishes == [(0, "stop"), (1, "length")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
