"""`vlmctl.serve.engine`: jobs decoded together on one model give `generate`'s answers, a job joins the rows being
decoded, a bad job fails alone, rows stop at their stop strings and max_tokens."""

from __future__ import annotations

import io
import threading
import time
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


def test_jobs_of_any_settings_decode_together_and_answer_as_generate(engine, loaded):
    requests = [request(TEXTS[0], (200, 30, 30)), request(TEXTS[1]), request(TEXTS[2], (30, 30, 200))]
    expected = [g.text for g in generate(*loaded, requests, batch_size=1, max_new_tokens=8)]
    sinks = [Events() for _ in range(4)]
    jobs = [Job(engine.render(r), max_tokens=8, sink=s) for r, s in zip(requests, sinks)]
    sampled = Job(engine.render(requests[0]), max_tokens=8, temperature=0.7, sink=sinks[3], n=2)
    submit_together(engine, [jobs[0], sampled, *jobs[1:]])
    assert all(s.finished.wait(120) for s in sinks)
    assert engine.rows > engine.batches  # greedy and sampled rows shared decode steps
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


def test_a_job_whose_client_leaves_while_it_decodes_ends_with_499(engine):
    """The client leaves after the first text (its job is cancelled from the worker's own event): the job's last
    event is a 499, so the handler waiting for its answer ends then, not at the server's shutdown."""
    sink = Events()
    job = Job(engine.render(request(TEXTS[0])), max_tokens=200, temperature=1.0, seed=3, sink=sink)

    def leave_at_first_text(event):
        sink(event)
        if event[0] == "delta":
            job.cancelled.set()

    job.sink = leave_at_first_text
    engine.submit(job)
    assert sink.finished.wait(120)
    assert sink.events[-1] == ("error", 499, "the request was cancelled while it was decoded", "client_closed"), sink.events[-3:]
    assert not sink.of("done") and not sink.of("end") and len(sink.of("delta")) <= 2


def test_a_seed_decides_the_sampled_answer(engine):
    def sampled(seed: int) -> str:
        sink = Events()
        engine.submit(Job(engine.render(request(TEXTS[1])), max_tokens=12, temperature=1.5, seed=seed, sink=sink))
        assert sink.finished.wait(120)
        return sink.text()

    first = sampled(1)
    assert sampled(1) == first
    assert any(sampled(seed) != first for seed in range(2, 8))  # other seeds, other samples


def test_a_job_joins_the_rows_being_decoded(loaded):
    """A second client's job starts while the first one's answer is still being decoded: both are decoded in the
    same steps, and neither waits for the other to end."""
    engine = Engine(*loaded, max_batch_size=4, max_length=4096)
    try:
        first, second = Events(), Events()
        engine.submit(Job(engine.render(request(TEXTS[0])), max_tokens=200, sink=first))
        deadline = time.monotonic() + 60
        while engine.running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.submit(Job(engine.render(request(TEXTS[1])), max_tokens=4, sink=second))
        assert second.finished.wait(120) and first.finished.wait(120)
        assert engine.rows > engine.batches  # some steps decoded both rows
        assert engine.describe()["decode"] == "eager" and engine.describe()["slots"] == 4
    finally:
        engine.close(timeout=60)


def test_announcements_are_counted_until_submitted_or_withdrawn(loaded):
    engine = Engine(*loaded, max_batch_size=2, max_length=4096)
    try:
        engine.announce()
        engine.announce()
        assert engine.arriving == 2
        engine.submit(Job(engine.render(request(TEXTS[2])), max_tokens=4, sink=(alone := Events())), announced=True)
        engine.withdraw()
        assert alone.finished.wait(60) and engine.arriving == 0
    finally:
        engine.close(timeout=60)


def test_a_rows_text_decoded_piece_by_piece_equals_the_whole_decode(loaded):
    from vlmctl.inference.engine import Request, _Choice
    from vlmctl.inference.sampling import SamplingParams

    tok = loaded[1].tokenizer
    text = "What color is the square? Ünïcödé 漢字 🙂 red blue green."
    sequences = [tok(text * 3, add_special_tokens=False).input_ids,
                 [(i * 37) % len(tok) for i in range(80)]]  # ids in no particular order: partial characters, specials
    for ids in sequences:
        row = _Choice(Request(RenderedRequest("", [], [], []), SamplingParams(max_tokens=1000)), 0, 0, tok, set())
        for token in ids:
            row.out.token_ids.append(token)
            assert row._advance() == tok.decode(row.out.token_ids, skip_special_tokens=True)


def test_queue_seconds_count_each_jobs_wait_from_the_queue_to_its_prefill(loaded):
    """With one slot the second of two jobs queued together waits until the first has ended: the engine's
    `queue_seconds` holds at least that wait, and both are counted as admitted."""
    engine = Engine(*loaded, max_batch_size=1, max_length=4096)
    try:
        ended: dict[str, float] = {}

        def timed(name, events):
            def sink(event):
                if event[0] in ("end", "error"):
                    ended[name] = time.perf_counter()
                events(event)
            return sink

        first, second = Events(), Events()
        jobs = [Job(engine.render(request(TEXTS[0])), max_tokens=12, sink=timed("first", first)),
                Job(engine.render(request(TEXTS[1])), max_tokens=2, sink=timed("second", second))]
        submit_together(engine, jobs)
        assert first.finished.wait(120) and second.finished.wait(120)
        described = engine.describe()
        assert described["admitted_requests"] == 2
        assert jobs[1].queued_at is not None and jobs[0].queued_at <= jobs[1].queued_at
        assert described["queue_seconds"] >= ended["first"] - jobs[1].queued_at > 0
    finally:
        engine.close(timeout=60)
