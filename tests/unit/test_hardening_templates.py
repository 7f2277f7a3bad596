"""A chat template's time limit holds wherever it renders: the main thread, other threads (serve answers each
request in a thread), and forked worker processes (data prepare's pool); a rendering that ends in time leaves
nothing behind for the code that runs after it."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from vlmctl.errors import DataError

HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
NORMAL = "{% for m in messages %}{{ m['role'] }}: {{ m['content'][0]['text'] }}\n{% endfor %}"


@pytest.fixture
def short_limit(monkeypatch):
    from vlmctl.data import tokens

    monkeypatch.setattr(tokens, "RENDER_SECONDS", 0.5)


def counter_with_template(template: str):
    from vlmctl.data.tokens import TokenCounter, _template_renderer

    counter = TokenCounter.__new__(TokenCounter)  # the parts `render` uses: a folder-less counter with a template
    counter.folder, counter.image_token = None, "<image>"
    counter._apply_template = _template_renderer(template, {})
    return counter


def chat():
    from vlmctl.data.sample import Sample

    return Sample(id="s", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}], images=[])


def outcome(template: str) -> str:
    """What rendering `template` in the calling thread or process ends in: the text, or the error's message."""
    started = time.monotonic()
    try:
        text = counter_with_template(template).render(chat())
    except DataError as exc:
        return f"DataError after {time.monotonic() - started:.1f} s: {exc.message}"
    return text


def test_a_hanging_template_is_stopped_in_another_thread(short_limit):
    with ThreadPoolExecutor(2) as pool:
        hang, normal = pool.submit(outcome, HANG), pool.submit(outcome, NORMAL)
        assert normal.result(timeout=30) == "user: hi\nassistant: yo\n"
        result = hang.result(timeout=30)  # without the limit, 10^10 loop steps: hours
    assert result.startswith("DataError") and "did not finish rendering one conversation in 0.5 s" in result
    assert float(result.split()[2]) < 5


def test_a_hanging_template_is_stopped_in_a_forked_worker(short_limit):
    outcome(NORMAL)  # the parent has rendered before (its watchdog thread runs): the child needs its own
    with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        result = pool.submit(outcome, HANG).result(timeout=60)
    assert result.startswith("DataError") and "did not finish rendering" in result


def test_threads_rendering_at_once_are_each_limited(short_limit):
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(outcome, [HANG, HANG, NORMAL], timeout=60))
    assert [r.startswith("DataError") for r in results] == [True, True, False]


def test_a_render_that_ends_in_time_leaves_no_late_interruption(monkeypatch):
    from vlmctl.data import tokens

    monkeypatch.setattr(tokens, "RENDER_SECONDS", 0.05)
    late: list[BaseException] = []

    def work():
        try:
            for _ in range(200):  # many renders close to the limit, then time well past each deadline
                counter_with_template(NORMAL).render(chat())
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                sum(range(1000))
        except BaseException as exc:  # noqa: BLE001 - anything arriving here is the bug under test
            late.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and late == []


def test_serve_style_request_rendering_in_a_thread_is_stopped(short_limit):
    # serve answers each request in a worker thread (asyncio.to_thread); a processor whose template never ends
    from vlmctl.inference.prompt import GenerationRequest, render_request

    def endless(*_, **__):
        while True:
            pass

    processor = SimpleNamespace(apply_chat_template=endless)
    request = GenerationRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], images=[], id="r")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(render_request, request, processor)
        with pytest.raises(DataError, match="did not finish rendering"):
            future.result(timeout=30)
