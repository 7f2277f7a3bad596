"""`vlmctl serve`'s engine in a process of its own (`serve.engine_process`): it answers what the engine in a thread
answers (plain, streamed, several choices, log-probs, pictures prepared by processor workers), profiles in its own
process, frees the slot of a client that left, reports its start-up errors as the server's own, and a child that
dies fails the requests in flight and later ones without hanging the server."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from vlmctl.serve import ServeSettings, running_server  # noqa: E402


def picture(rgb) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 48), rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(text: str, rgb=None) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": picture(rgb)}}] if rgb else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=60) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def post(url: str, path: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}{path}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


QUESTIONS = [("What color is it?", (200, 30, 30)), ("Name a shape.", None), ("Is it blue?", (30, 30, 220))]


def answers(url: str) -> list:
    """Greedy answers with log-probs, a streamed one, and two sampled choices of one seeded request."""
    c = client(url)
    out = []
    for text, rgb in QUESTIONS:
        reply = c.chat.completions.create(model="tiny", messages=ask(text, rgb), max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
        choice = reply.choices[0]
        out.append((choice.message.content, choice.finish_reason, reply.usage.completion_tokens,
                    [(t.token, round(t.logprob, 4), [(a.token, round(a.logprob, 4)) for a in t.top_logprobs])
                     for t in choice.logprobs.content]))
    stream = c.chat.completions.create(model="tiny", messages=ask(*QUESTIONS[0]), max_tokens=6, temperature=0, stream=True)
    out.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    sampled = c.chat.completions.create(model="tiny", messages=ask(*QUESTIONS[2]), max_tokens=6, temperature=1.0,
                                        n=2, seed=7, logprobs=True)
    out.append(sorted([t.token for t in ch.logprobs.content] for ch in sampled.choices))
    return out


def test_the_engine_process_answers_as_the_engine_thread_and_profiles_in_its_own_process(tiny_models, tmp_path):
    from vlmctl.inference import load_for_generation

    folder = tiny_models("tiny-qwen2.5-vl")
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    with running_server(model, processor, ServeSettings(port=0, max_batch_size=4), name="tiny", model_dir=folder) as url:
        in_thread = answers(url)
        status, facts = health(url)
        assert status == 200 and facts["engine"] == "thread"
    del model
    settings = ServeSettings(port=0, max_batch_size=4, processor_workers=1, profile_dir=tmp_path / "prof")
    with running_server(None, None, settings, name="tiny", model_dir=folder) as url:
        in_process = answers(url)
        status, facts = health(url)
        assert status == 200 and facts["engine"] == "process" and facts["engine_alive"]
        assert facts["engine_pid"] != os.getpid()
        assert facts["processor_workers"] == 1 and facts["collated_prefills"] > 0  # prepared tensors crossed the pipe
        assert facts["admitted_requests"] == len(QUESTIONS) + 2 and facts["tokens_generated"] > 0
        assert facts["engine_gc"]["frozen"] > 0  # the child froze its own heap
        status, started = post(url, "/start_profile")
        assert status == 200 and started["recording"]
        assert post(url, "/start_profile")[0] == 409  # the child's ProfileStateError, rebuilt here
        client(url).chat.completions.create(model="tiny", messages=ask(*QUESTIONS[0]), max_tokens=3, temperature=0)
        status, stopped = post(url, "/stop_profile")
        assert status == 200 and (tmp_path / "prof").is_dir() and any((tmp_path / "prof").rglob("ops.txt"))
    assert in_process == in_thread
    assert len(in_process[-1]) == 2 and all(in_process[-1])


def test_a_client_that_leaves_frees_its_slot_in_the_engine_process(tiny_models):
    folder = tiny_models("tiny-qwen2.5-vl")
    with running_server(None, None, ServeSettings(port=0, max_batch_size=2), name="tiny", model_dir=folder) as url:
        c = client(url)
        whole = c.chat.completions.create(model="tiny", messages=ask("Count."), max_tokens=400, temperature=0)
        assert whole.choices[0].finish_reason == "length"  # this answer, uncut, runs to all 400 tokens
        before = health(url)[1]["tokens_generated"]
        stream = c.chat.completions.create(model="tiny", messages=ask("Count."), max_tokens=400, temperature=0, stream=True)
        next(iter(stream))
        stream.close()  # the client goes away at its first chunk
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, facts = health(url)
            if facts["running"] == 0 and facts["queued"] == 0:
                break
            time.sleep(0.05)
        assert facts["running"] == 0 and facts["tokens_generated"] - before < 400  # the child stopped the row early
        reply = c.chat.completions.create(model="tiny", messages=ask("Again?"), max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens >= 1  # the freed slot serves the next client


def test_the_engine_process_start_up_error_is_the_servers_own(tiny_models):
    from vlmctl.config.train import TrainSection
    from vlmctl.errors import UsageError
    from vlmctl.serve.server import make_state

    folder = tiny_models("tiny-qwen2.5-vl")
    settings = ServeSettings(port=0, train=TrainSection(attn_implementation="flash_attn"), device="cpu")
    with pytest.raises(UsageError) as raised:  # raised in the child by load_for_serving, rebuilt here with its hint
        make_state(None, None, settings, "tiny", model_dir=folder)
    assert "flash" in raised.value.message and raised.value.hint


def test_a_dead_engine_process_fails_the_requests_in_flight_and_later_ones(tiny_models):
    folder = tiny_models("tiny-qwen2.5-vl")
    with running_server(None, None, ServeSettings(port=0, max_batch_size=2), name="tiny", model_dir=folder) as url:
        pid = health(url)[1]["engine_pid"]
        failed = []

        def long_answer():
            try:
                stream = client(url).chat.completions.create(model="tiny", messages=ask("Count."), max_tokens=3000,
                                                             temperature=1.0, seed=2, stream=True)
                for _ in stream:
                    pass
            except Exception as exc:  # noqa: BLE001 - what the client sees
                failed.append(exc)
            else:
                failed.append(None)

        thread = threading.Thread(target=long_answer)
        thread.start()
        deadline = time.monotonic() + 60
        while health(url)[1].get("running", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive() and failed and failed[0] is not None  # the stream ended in an error, not silence
        status, facts = health(url)
        assert status == 503 and facts["status"] == "engine_stopped" and facts["engine_alive"] is False
        with pytest.raises(openai.APIStatusError) as refused:
            client(url).chat.completions.create(model="tiny", messages=ask("Still there?"), max_tokens=3)
        assert refused.value.status_code == 503 and "engine's process has stopped" in str(refused.value)


def test_the_stream_interval_reaches_the_engine_process(tiny_models):
    """`stream_interval=4` in the child: a streamed 12-token answer's deltas come at tokens 1, 4 and 8 (and at its
    end, when text is left to send), not at each token (the engine's own test checks the text they join to)."""
    from vlmctl.inference import GenerationRequest
    from vlmctl.serve.engine import Job
    from vlmctl.serve.engine_process import EngineProcess

    engine = EngineProcess(tiny_models("tiny-qwen2.5-vl"), device="cpu", max_batch_size=2, max_length=256,
                           stream_interval=4)
    try:
        engine.wait_ready(120)
        events, done = [], threading.Event()

        def sink(event):
            events.append(event)
            if event[0] in ("end", "error"):
                done.set()

        rendered = engine.render(GenerationRequest(messages=ask("Count.")))
        assert engine.submit(Job(rendered, max_tokens=12, temperature=0.0, sink=sink))
        assert done.wait(60)
    finally:
        engine.close(timeout=10)
    finished = [e for e in events if e[0] == "done"]
    assert finished and finished[0][2:] == ("length", 12)
    assert len([e for e in events if e[0] == "delta"]) in (3, 4)
