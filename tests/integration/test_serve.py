"""`vlmctl serve` as a client sees it: a real server process on a free local port, inside a project whose data
limits it takes (data.max_image_pixels, data.max_length), driven with the official `openai` client: plain and
streaming answers (equal to `vlmctl.inference.generate`'s), images as data: URLs and local paths, a multi-turn
conversation, 8 concurrent clients, the bad inputs (each a 4xx in OpenAI's error shape, the server answering the
next request), and SIGTERM draining a stream in flight."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from serve_helpers import reference, tiny_model  # noqa: E402,F401 - fixtures (the model loaded here gives `generate`'s answers)
from vlmctl.serve import free_port  # noqa: E402

TEXTS = ["What color is the square?", "Name a primary color.", "What shape is in the picture?", "A square.",
         "And what color is it?", "red blue green yellow"]
COLORS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (230, 230, 20), (20, 20, 20), (240, 240, 240), (200, 30, 200), (30, 200, 200)]
MAX_LENGTH = 512


def png(rgb, size=32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return buf.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def ask(text: str, image: bytes | None = None) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}] if image else []
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def start_server(model: Path, cwd: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vlmctl", "serve", str(model), "--device", "cpu", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("the server did not answer /health within 120 s")


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """`vlmctl serve` in a project (max 2000 pixels per image, 512 tokens per prompt + answer) with a media root."""
    project = tmp_path_factory.mktemp("project")
    (project / "vlmctl.yaml").write_text(f"data:\n  max_image_pixels: 2000\n  max_length: {MAX_LENGTH}\n")
    media = project / "pictures"
    media.mkdir()
    (media / "red.png").write_bytes(png(COLORS[0]))
    proc, url = start_server(tiny_model, project, "--media-root", str(media), "--max-body-mb", "1")
    yield url, media, project
    assert stop(proc) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


def generated(reference, messages: list[dict], max_new_tokens: int) -> str:
    """`vlmctl.inference.generate`'s greedy answer to OpenAI-shaped messages (images as data: URLs)."""
    from vlmctl.inference import GenerationRequest, generate

    canonical, images = [], []
    for m in messages:
        content = []
        for part in m["content"]:
            if part["type"] == "text":
                content.append({"type": "text", "text": part["text"]})
            else:
                images.append(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))
                content.append({"type": "image", "index": len(images) - 1})
        canonical.append({"role": m["role"], "content": content})
    model, processor = reference
    return generate(model, processor, [GenerationRequest(messages=canonical, images=images)], batch_size=1,
                    max_new_tokens=max_new_tokens)[0].text


def test_models_health_and_a_plain_answer_equal_to_generate(client, server, reference):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with urllib.request.urlopen(f"{server[0]}/health") as resp:
        health = json.loads(resp.read())
    assert health["status"] == "ok"
    # served in the dtype and with the attention training's plan picks for the project on this machine (padded rows)
    from vlmctl.config import load_config
    from vlmctl.config.plan import DeviceFacts, build_plan

    train = load_config(server[2] / "vlmctl.yaml").train
    plan = build_plan(train.model_copy(update={"packing": False}), DeviceFacts.here(cuda=False))
    assert (health["dtype"], health["attn_implementation"]) == (plan.precision.value, plan.attention.value) == ("fp32", "sdpa")
    messages = [ask("Name a primary color.")]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert choice.message.content == generated(reference, messages, 12)
    model, processor = reference
    from vlmctl.inference import GenerationRequest, render_prompt

    prompt, _ = render_prompt(GenerationRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "Name a primary color."}]}]),
                              processor)
    assert answer.usage.prompt_tokens == len(processor.tokenizer(prompt, add_special_tokens=False).input_ids)
    assert 1 <= answer.usage.completion_tokens <= 12
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_streaming_pieces_join_to_the_plain_answer(client):
    messages = [ask("What color is the square?", png(COLORS[2]))]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage.prompt_tokens == plain.usage.prompt_tokens and usage.completion_tokens == plain.usage.completion_tokens


def test_an_image_as_data_url_or_local_path_and_a_multi_turn_conversation(client, server, reference):
    url, media, _ = server
    question = "What color is the square?"
    by_url = client.chat.completions.create(model="tiny", messages=[ask(question, png(COLORS[0]))], max_tokens=10, temperature=0)
    local = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(media / "red.png")}},
                                         {"type": "text", "text": question}]}
    by_path = client.chat.completions.create(model="tiny", messages=[local], max_tokens=10, temperature=0)
    assert by_path.choices[0].message.content == by_url.choices[0].message.content
    assert by_url.choices[0].message.content == generated(reference, [ask(question, png(COLORS[0]))], 10)
    other = client.chat.completions.create(model="tiny", messages=[ask(question, png(COLORS[2]))], max_tokens=10, temperature=0)
    assert other.usage.prompt_tokens == by_url.usage.prompt_tokens  # the image's visual tokens are counted
    turns = [ask("What shape is in the picture?", png(COLORS[1])),
             {"role": "assistant", "content": [{"type": "text", "text": "A square."}]}, ask("And what color is it?")]
    reply = client.chat.completions.create(model="tiny", messages=turns, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == generated(reference, turns, 10)
    assert reply.usage.prompt_tokens > by_url.usage.prompt_tokens


def test_eight_concurrent_clients_each_get_their_own_answer(client, server):
    prompts = [[ask(f"What color is the square? {TEXTS[i % len(TEXTS)]}", png(COLORS[i]))] for i in range(8)]
    alone = [client.chat.completions.create(model="tiny", messages=p, max_tokens=12, temperature=0).choices[0].message.content
             for p in prompts]
    before = json.loads(urllib.request.urlopen(f"{server[0]}/health").read())

    def one(i: int) -> str:
        if i % 2:  # half of them stream
            stream = client.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=12, temperature=0, stream=True)
            return "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
        return client.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=12, temperature=0).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, range(8)))
    assert together == alone
    after = json.loads(urllib.request.urlopen(f"{server[0]}/health").read())
    steps, rows = after["batches"] - before["batches"], after["rows"] - before["rows"]
    assert 1 <= steps < 8 * 11 and rows / steps > 1.5  # the clients' rows shared decode steps (continuous batching)


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def declared_body(url: str, length: int) -> tuple[int, dict]:
    """POST headers that announce a `length`-byte body, send none of it, and read the answer."""
    import http.client
    from urllib.parse import urlparse

    conn = http.client.HTTPConnection(urlparse(url).netloc, timeout=60)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(length))
    conn.endheaders()
    resp = conn.getresponse()
    try:
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_bad_requests_get_4xx_openai_errors_and_the_server_answers_the_next(client, server):
    url, media, project = server
    outside = project / "outside.png"
    outside.write_bytes(png(COLORS[0]))
    good = {"model": "tiny", "messages": [ask("Name a primary color.")], "max_tokens": 4}
    cases = {
        "not json": (b"{not json", 400),
        "no messages": (json.dumps({"model": "tiny"}).encode(), 400),
        "unknown model": (json.dumps({**good, "model": "gpt-4o"}).encode(), 404),
        "image over data.max_image_pixels": (json.dumps({**good, "messages": [ask("color?", png(COLORS[0], size=64))]}).encode(), 400),
        "not an image": (json.dumps({**good, "messages": [ask("color?", b"not a picture")]}).encode(), 400),
        "remote image": (json.dumps({**good, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}]}]}).encode(), 400),
        "path outside the media roots": (json.dumps({**good, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(outside)}}]}]}).encode(), 400),
        "max_tokens over data.max_length": (json.dumps({**good, "max_tokens": MAX_LENGTH + 1}).encode(), 400),
        "prompt + max_tokens over data.max_length": (json.dumps({**good, "max_tokens": MAX_LENGTH - 2}).encode(), 400),
        "negative temperature": (json.dumps({**good, "temperature": -1}).encode(), 400),
        "unknown role": (json.dumps({**good, "messages": [{"role": "robot", "content": "hi"}]}).encode(), 400),
        "ends with the assistant": (json.dumps({**good, "messages": [ask("hi"), {"role": "assistant", "content": "x"}]}).encode(), 400),
    }
    for name, (body, status) in cases.items():
        code, answer = post(url, body)
        assert code == status, (name, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"], name
        ok, reply = post(url, json.dumps(good).encode())
        assert ok == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length"), name
    for stream in (False, True):  # a stream refused by the engine is a 400 too, not an error inside a 200 stream
        code, answer = post(url, json.dumps({**good, "max_tokens": MAX_LENGTH - 2, "stream": stream}).encode())
        assert code == 400 and answer["error"]["code"] == "context_length_exceeded"
    # a body over --max-body-mb (1 MiB) is refused from its Content-Length, before it is read
    status, answer = declared_body(url, 2 << 20)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    assert post(url, json.dumps(good).encode())[0] == 200
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[ask("hi")])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[ask("hi")], n=99)
    assert client.chat.completions.create(model="tiny", messages=[ask("hi")], max_tokens=3, n=2, seed=1, temperature=1.0,
                                          stop=["zz"]).choices[1].index == 1


def test_another_address_needs_an_api_key_and_clients_must_send_it(tiny_model, reference, capsys):
    from cli_runner import run_cli
    from vlmctl.serve import ServeSettings, running_server

    code, _, err = run_cli(["serve", str(tiny_model), "--host", "0.0.0.0"], capsys)
    assert code == 2 and "--api-key" in err
    model, processor = reference
    with running_server(model, processor, ServeSettings(port=0, api_key="s3cret"), name="tiny") as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert keyed.chat.completions.create(model="tiny", messages=[ask("hi")], max_tokens=2).choices[0].finish_reason
        with urllib.request.urlopen(f"{url}/health") as resp:  # probes need no key
            assert resp.status == 200


def test_sigterm_lets_a_stream_in_flight_finish(tiny_model, tmp_path):
    proc, url = start_server(tiny_model, tmp_path)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="tiny", messages=[ask("Name a primary color.")], max_tokens=200,
                                            temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].delta.role == "assistant"
    proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest and rest[-1].choices[0].finish_reason in ("stop", "length")
    assert proc.wait(timeout=60) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)
