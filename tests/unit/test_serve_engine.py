"""`vlmctl.serve.engine`: jobs batched on one model give `generate`'s answers, a bad job fails alone, rows stop at
their stop strings and max_tokens."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

from vlmctl.inference import GenerationRequest, generate, load_for_generation
from vlmctl.inference.prompt import RenderedRequest
from vlmctl.serve.engine import Engine, Job

TEXTS = ["What color is the square?", "Name a primary color.", "How many sides?", "red blue green"]


def png(rgb) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), rgb).save(buf, format="PNG")
    return buf.getvalue()


def request(text: str, rgb=None) -> GenerationRequest:
    parts = [{"type": "image", "index": 0}] if rgb else []
    return GenerationRequest(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                             images=[png(rgb)] if rgb else [])


class Events:
    """A job's sink: the events, and a flag set by its last one."""

    def __init__(self):
        self.events, self.finished = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event[0] in ("end", "error"):
            self.finished.set()

    def text(self, choice: int = 0) -> str:
        return "".join(e[2] for e in self.events if e[0] == "delta" and e[1] == choice)

    def of(self, kind: str) -> list[tuple]:
        return [e for e in self.events if e[0] == kind]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    folder: Path = tmp_path_factory.mktemp("engine") / "tiny"
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder, dtype="fp32"), tokenizer_texts=TEXTS * 5)
    return load_for_generation(folder, device="cpu", dtype="fp32")


@pytest.fixture
def engine(loaded):
    engine = Engine(*loaded, max_batch_size=8, max_length=4096)
    yield engine
    engine.close(timeout=60)


def submit_together(engine: Engine, jobs: list[Job]) -> None:
    """Queue all `jobs` before the worker can take any (it waits on the same condition)."""
    with engine._cond:
        for job in jobs:
            assert engine.submit(job)


def test_compatible_jobs_share_one_generate_call_and_answer_as_generate(engine, loaded):
    requests = [request(TEXTS[0], (200, 30, 30)), request(TEXTS[1]), request(TEXTS[2], (30, 30, 200))]
    expected = [g.text for g in generate(*loaded, requests, batch_size=1, max_new_tokens=8)]
    sinks = [Events() for _ in range(4)]
    jobs = [Job(engine.render(r), max_tokens=8, sink=s) for r, s in zip(requests, sinks)]
    sampled = Job(engine.render(requests[0]), max_tokens=8, temperature=0.7, sink=sinks[3], n=2)
    submit_together(engine, [jobs[0], sampled, *jobs[1:]])
    assert all(s.finished.wait(120) for s in sinks)
    assert engine.batches == 2  # the greedy jobs together, the sampling one apart
    assert [s.text() for s in sinks[:3]] == expected
    assert sorted(e[1] for e in sinks[3].of("done")) == [0, 1]  # n=2: two choices
    for sink in sinks[:3]:
        (done,) = sink.of("done")
        assert done[2] in ("stop", "length") and 1 <= done[3] <= 8
        assert sink.of("end")[0][1] > 0  # prompt tokens


def test_a_bad_job_fails_alone(engine, loaded):
    good = [request(TEXTS[0], (200, 30, 30)), request(TEXTS[1])]
    expected = [g.text for g in generate(*loaded, good, batch_size=1, max_new_tokens=6)]
    sinks = [Events() for _ in range(3)]
    # an image placeholder without its image: the model cannot run this row
    broken = RenderedRequest(engine.render(good[0]).text, [], [], [])
    jobs = [Job(engine.render(good[0]), max_tokens=6, sink=sinks[0]), Job(broken, max_tokens=6, sink=sinks[1]),
            Job(engine.render(good[1]), max_tokens=6, sink=sinks[2])]
    submit_together(engine, jobs)
    assert all(s.finished.wait(120) for s in sinks)
    assert sinks[1].of("error") and not sinks[1].of("end")
    assert [sinks[0].text(), sinks[2].text()] == expected and not sinks[0].of("error") and not sinks[2].of("error")


def test_stop_strings_cut_the_answer_and_context_is_limited(loaded):
    engine = Engine(*loaded, max_length=64)
    try:
        full = generate(*loaded, [request(TEXTS[1])], max_new_tokens=16)[0].text
        assert len(full) >= 4, "the tiny model's answer is too short to cut"
        stop = full[2:4]
        sink = Events()
        engine.submit(Job(engine.render(request(TEXTS[1])), max_tokens=16, stop=[stop], sink=sink))
        assert sink.finished.wait(120)
        assert sink.text() == full[: full.find(stop)].strip() and sink.of("done")[0][2] == "stop"
        too_long = Events()
        engine.submit(Job(engine.render(request(TEXTS[1])), max_tokens=60, sink=too_long))
        assert too_long.finished.wait(120)
        assert too_long.of("error")[0][1] == 400 and too_long.of("error")[0][3] == "context_length_exceeded"
    finally:
        engine.close(timeout=60)
    assert not engine.submit(Job(engine.render(request(TEXTS[1]))))  # closed: nothing is queued


def test_a_job_whose_client_left_is_not_generated(engine, loaded):
    kept, left = Events(), Events()
    gone = Job(engine.render(request(TEXTS[0])), max_tokens=8, sink=left)
    gone.cancelled.set()
    submit_together(engine, [gone, Job(engine.render(request(TEXTS[1])), max_tokens=8, sink=kept)])
    assert kept.finished.wait(120) and left.finished.wait(120)
    assert left.events == [("error", 499, "the client closed the connection", "client_closed")]
    assert kept.text() == generate(*loaded, [request(TEXTS[1])], max_new_tokens=8)[0].text


def test_a_seed_decides_the_sampled_answer(engine):
    def sampled(seed: int) -> str:
        sink = Events()
        engine.submit(Job(engine.render(request(TEXTS[1])), max_tokens=12, temperature=1.5, seed=seed, sink=sink))
        assert sink.finished.wait(120)
        return sink.text()

    first = sampled(1)
    assert sampled(1) == first
    assert any(sampled(seed) != first for seed in range(2, 8))  # other seeds, other samples


def test_the_worker_waits_for_an_announced_request_and_batches_it(loaded):
    engine = Engine(*loaded, max_batch_size=8, max_length=4096, batch_window_s=30.0)
    try:
        sinks = [Events(), Events()]
        engine.announce()  # the second request is on its way (rendering) when the first is queued
        engine.submit(Job(engine.render(request(TEXTS[0])), max_tokens=4, sink=sinks[0]))
        assert not sinks[0].finished.wait(0.5)  # the worker waits for the announced one
        engine.submit(Job(engine.render(request(TEXTS[1])), max_tokens=4, sink=sinks[1]), announced=True)
        assert all(s.finished.wait(120) for s in sinks)
        assert engine.batches == 1
        # the two clients come back: the first one's job waits for as many rows as the previous call had
        again = [Events(), Events()]
        engine.submit(Job(engine.render(request(TEXTS[2])), max_tokens=4, sink=again[0]))
        assert not again[0].finished.wait(0.5)
        engine.submit(Job(engine.render(request(TEXTS[3])), max_tokens=4, sink=again[1]))
        assert all(s.finished.wait(120) for s in again) and engine.batches == 2
    finally:
        engine.close(timeout=60)


def test_a_withdrawn_announcement_ends_the_wait_of_a_lone_client(loaded):
    engine = Engine(*loaded, max_batch_size=8, max_length=4096, batch_window_s=30.0)
    try:
        engine.announce()
        engine.submit(Job(engine.render(request(TEXTS[2])), max_tokens=4, sink=(alone := Events())))
        engine.withdraw()
        assert alone.finished.wait(20) and engine.batches == 1  # well before the 30 s window
    finally:
        engine.close(timeout=60)


def test_a_rows_text_decoded_piece_by_piece_equals_the_whole_decode(loaded):
    from vlmctl.serve.engine import _Row

    tok = loaded[1].tokenizer
    text = "What color is the square? Ünïcödé 漢字 🙂 red blue green."
    sequences = [tok(text * 3, add_special_tokens=False).input_ids,
                 [(i * 37) % len(tok) for i in range(80)]]  # ids in no particular order: partial characters, specials
    for ids in sequences:
        row = _Row(Job(RenderedRequest("", [], [], []), max_tokens=1000), 0, tok, set())
        for token in ids:
            row.tokens.append(token)
            assert row._advance() == tok.decode(row.tokens, skip_special_tokens=True)
