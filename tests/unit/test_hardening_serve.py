"""`vlmctl serve` against hostile clients, in this process on a free local port with a tiny model: web pages of
other origins and DNS rebinding, API keys of any characters, requests built to exhaust it (media, pixels, prompt
length, `n`, stalled and slow uploads and heads), client mistakes that must never be a 5xx, clients leaving
mid-stream, fields it cannot honour, the request log, and a port already in use."""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from cli_runner import run_cli  # noqa: E402
from serve_helpers import reference, tiny_model  # noqa: E402,F401 - fixtures
from vlmctl.errors import UsageError  # noqa: E402
from vlmctl.serve import ServeSettings, check_settings, running_server  # noqa: E402
from vlmctl.serve.app import Limits  # noqa: E402

TEXTS = ["What color is the square?", "Name a primary color.", "red blue green"]
MAX_LENGTH = 256


def png(rgb=(200, 30, 30), size=16) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def ask(text: str = "Name a primary color.", *parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


class Log(list):
    def __call__(self, line: str) -> None:
        self.append(line)


@pytest.fixture(scope="module")
def served(reference):
    """(base URL, the request log) of a server without a key: 2 rows per batch, small media limits, short timeouts."""
    log = Log()
    limits = Limits(max_tokens=MAX_LENGTH, max_media=4, max_total_pixels=3 * 16 * 16, body_seconds=1.0)
    settings = ServeSettings(port=0, limits=limits, max_batch_size=2, max_length=MAX_LENGTH, log=log, head_seconds=1.0,
                             allowed_origins=("http://localhost:3000",))
    with running_server(*reference, settings, name="tiny") as url:
        yield url, log


def request(url: str, method: str = "POST", path: str = "/v1/chat/completions", body: bytes | dict | None = None,
            headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body or {}, response headers) of one raw HTTP request."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"raw": raw.decode(errors="replace")}
        return resp.status, payload, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def good(**extra) -> dict:
    return {"model": "tiny", "messages": ask(), "max_tokens": 3, **extra}


def health(url: str) -> dict:
    return request(url, "GET", "/health")[1]


def still_answers(url: str) -> None:
    status, body, _ = request(url, body=good())
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body


# ---------------------------------------------------------------------------------------------- a local service


@pytest.mark.parametrize("host, allowed", [
    ("localhost:{port}", True), ("127.0.0.1:{port}", True), ("127.4.5.6:{port}", True), ("[::1]:{port}", True),
    ("app.localhost:{port}", True), ("LOCALHOST.:{port}", True),
    ("evil.example:{port}", False), ("127.0.0.1.evil.example:{port}", False), ("localhost.evil.example", False),
    ("192.168.1.10:{port}", False), ("[::ffff:8.8.8.8]:{port}", False), ("", False), ("a:b:c", False),
])
def test_a_server_without_a_key_answers_only_loopback_host_names(served, host, allowed):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example."""
    url, _ = served
    before = health(url)["batches"]
    status, body, _ = request(url, body=good(), headers={"Host": host.format(port=url.rsplit(":", 1)[1])})
    if allowed:
        assert status == 200, body
    else:
        assert status == 403 and body["error"]["code"] == "forbidden_host", body
        assert health(url)["batches"] == before  # refused before the model saw anything
        assert request(url, "GET", "/health", headers={"Host": host.format(port=1)})[0] == 403


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://localhost:3000"])
def test_a_page_of_another_origin_is_refused_before_anything_runs(served, origin):
    url, _ = served
    before = health(url)["batches"]
    # a "simple" cross-origin request: no preflight, the browser sends it as is
    status, body, headers = request(url, body=json.dumps(good()).encode(), headers={"Origin": origin, "Content-Type": "text/plain"})
    assert status == 403 and body["error"]["code"] == "forbidden_origin" and "access-control-allow-origin" not in headers
    status, _, headers = request(url, "OPTIONS", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "content-type"})
    assert status == 403 and "access-control-allow-origin" not in headers
    assert request(url, "GET", "/v1/models", headers={"Origin": origin})[0] == 403
    assert health(url)["batches"] == before
    still_answers(url)


def test_the_chat_page_and_a_listed_origin_are_answered(served):
    url, _ = served
    status, _, headers = request(url, "GET", "/")
    assert status == 200 and "frame-ancestors 'none'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    assert request(url, body=good(), headers={"Origin": url})[0] == 200  # the page's own requests
    status, _, headers = request(url, "OPTIONS", headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in headers["access-control-allow-methods"]
    status, body, headers = request(url, body=good(), headers={"Origin": "http://localhost:3000"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000" and body["choices"]


@pytest.mark.parametrize("key", ["s3cret", "ключ-🔑-é", "with space inside", "quote\"and\\back", "x" * 4096])
def test_api_keys_of_any_characters_are_compared_as_utf8_bytes(reference, key):
    with running_server(*reference, ServeSettings(port=0, api_key=key), name="tiny") as url:
        raw = key.encode("utf-8")
        for scheme in (b"Bearer ", b"bearer ", b"BEARER "):
            assert raw_status(url, {b"Authorization": scheme + raw}) == 200
        for wrong in (b"Bearer " + raw[:-1], b"Bearer " + raw + b"x", b"Basic " + raw, raw, b"Bearer " + raw.upper() + b"!", b""):
            assert raw_status(url, {b"Authorization": wrong} if wrong else {}) == 401
        # a server with a key serves other Host names (the key protects it); other origins are refused all the same
        assert raw_status(url, {b"Authorization": b"Bearer " + raw, b"Host": b"models.internal:80"}) == 200
        assert raw_status(url, {b"Authorization": b"Bearer " + raw, b"Origin": b"http://evil.example"}) == 403


def raw_status(url: str, headers: dict[bytes, bytes]) -> int:
    """GET /v1/models with header values sent as raw bytes (a key's UTF-8 bytes, as curl sends them)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    lines = [b"GET /v1/models HTTP/1.1", b"Connection: close"]
    if b"Host" not in headers:
        lines.append(f"Host: {host}:{port}".encode())
    lines += [name + b": " + value for name, value in headers.items()]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize("settings, words", [
    (ServeSettings(api_key=""), "non-empty"), (ServeSettings(api_key=" padded"), "spaces at its ends"),
    (ServeSettings(api_key="line\nbreak"), "control characters"), (ServeSettings(api_key="tab\t"), "spaces at its ends"),
    (ServeSettings(allowed_origins=("*",)), "every web page"), (ServeSettings(allowed_origins=("http://x.org/path",)), "not an origin"),
    (ServeSettings(allowed_origins=("localhost:3000",)), "not an origin"),
])
def test_settings_that_cannot_be_served_safely_are_refused(settings, words):
    with pytest.raises(UsageError, match=words):
        check_settings(settings)
    check_settings(ServeSettings(api_key="k", allowed_origins=("*",)))  # any origin, with a key


# ---------------------------------------------------------------------------------------------- resources


def test_n_over_the_batch_rows_media_and_pixels_are_bounded_before_decoding(served):
    url, _ = served
    before = health(url)["batches"]
    status, body, _ = request(url, body=good(n=3, temperature=1.0))  # 2 rows per batch
    assert status == 400 and body["error"]["param"] == "n"
    # five media parts, the last one not an image at all: counted before any is decoded
    parts = [image_part(png())] * 4 + [image_part(b"not an image")]
    status, body, _ = request(url, body=good(messages=ask("<image>" * 5, *parts)))
    assert status == 400 and body["error"]["code"] == "too_many_media", body
    # four 16x16 images are 1,024 pixels, over 768 together; the fourth's header is read, its bytes are not decoded
    truncated = png(size=16)[:60]
    status, body, _ = request(url, body=good(messages=ask("What?", *[image_part(png())] * 3, image_part(truncated))))
    assert status == 400 and body["error"]["code"] == "image_too_large" and "together" in body["error"]["message"], body
    assert health(url)["batches"] == before
    status, body, _ = request(url, body=good(messages=ask("What?", *[image_part(png())] * 3)))
    assert status == 200, body


def test_a_prompt_over_the_context_is_refused_before_it_is_tokenized_or_queued(served, reference):
    url, _ = served
    before = health(url)["batches"]
    longest = max(len(t) for t in reference[1].tokenizer.get_vocab())
    huge = "red " * (MAX_LENGTH * longest)  # far over: refused from its length alone
    start = time.monotonic()
    status, body, _ = request(url, body=good(messages=ask(huge)))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and "characters" in body["error"]["message"]
    assert time.monotonic() - start < 10
    status, body, _ = request(url, body=good(messages=ask("red blue green " * 100)))  # over by its tokens
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    many = [{"role": "user", "content": "red"}, {"role": "assistant", "content": "blue"}] * 400 + ask()
    status, body, _ = request(url, body=good(messages=many))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert health(url)["batches"] == before


def test_a_stalled_or_slow_upload_is_timed_out(served):
    url, _ = served
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(good()).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for drip in (None, 0.2):  # stalled after 10 bytes; one byte every 0.2 s
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            start = time.monotonic()
            sock.sendall(head + body[:10])
            sock.settimeout(0.2 if drip else 30)
            answer = b""
            for byte in body[10:] if drip else []:
                try:
                    answer += sock.recv(65536)
                except TimeoutError:
                    pass
                if answer:
                    break
                sock.sendall(bytes([byte]))
            sock.settimeout(30)
            while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer + sock.recv(65536), answer
            assert 0.9 < time.monotonic() - start < 10
    still_answers(url)


def test_a_stalled_request_head_is_closed(served):
    url, _ = served
    host, port = url.removeprefix("http://").rsplit(":", 1)
    for sent in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            start = time.monotonic()
            sock.sendall(sent)
            assert sock.recv(65536) == b""  # closed by the server
            assert 0.9 < time.monotonic() - start < 10
    still_answers(url)


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b"[1, 2, 3]", b'"just a string"', b"null", b"",
    json.dumps(good(seed=2**70)).encode(), json.dumps(good(seed=-(2**70))).encode(),
    json.dumps(good(n=0)).encode(), json.dumps(good(top_logprobs=99, logprobs=True)).encode(),
    json.dumps(good(max_tokens=10**30)).encode(), b'{"model": "tiny", "messages": [], "max_tokens": 1e999}',
    json.dumps(good(messages=[{"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}}]}])).encode(),
    json.dumps(good(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])).encode(),
    json.dumps(good(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/dev/zero"}}]}])).encode(),
    json.dumps(good(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}])).encode(),
    json.dumps(good(stop=["x"] * 5)).encode(), json.dumps(good(stream_options={"include_usage": "maybe"})).encode(),
])
def test_a_clients_mistake_is_never_a_5xx(served, body):
    url, _ = served
    status, answer, _ = request(url, body=body)
    assert 400 <= status < 500 and set(answer["error"]) == {"message", "type", "param", "code"}, (status, answer)
    still_answers(url)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 2.0])
def test_extreme_sampling_settings_are_answered(served, temperature):
    url, _ = served
    status, body, _ = request(url, body=good(temperature=temperature, top_p=1e-300, seed=2**63 - 1))
    assert status == 200, body


def test_clients_leaving_mid_stream_cancel_cleanly_and_the_server_keeps_answering(served):
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)

    def one(i: int) -> str:
        kind = i % 4
        if kind == 0:  # a sampled stream read to its end
            stream = client.chat.completions.create(model="tiny", messages=ask(TEXTS[i % 3]), max_tokens=24, temperature=1.0,
                                                    n=2, stream=True)
            return "done" if [c for c in stream if c.choices and c.choices[0].finish_reason] else "no finish"
        if kind == 1:  # a stream left after its first chunk
            stream = client.chat.completions.create(model="tiny", messages=ask(TEXTS[i % 3]), max_tokens=200, temperature=0.8,
                                                    stream=True)
            next(iter(stream))
            stream.close()
            return "left"
        if kind == 2:  # a plain request whose client gives up at once
            impatient = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=0.05)
            try:
                impatient.chat.completions.create(model="tiny", messages=ask(), max_tokens=200, temperature=0.9, seed=i)
            except openai.APITimeoutError:
                return "left"
            return "answered"
        answer = client.chat.completions.create(model="tiny", messages=ask(), max_tokens=8, temperature=0)
        return "done" if answer.choices[0].finish_reason else "no finish"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, range(16)))
    assert outcomes.count("no finish") == 0 and outcomes.count("done") == 8, outcomes
    deadline = time.monotonic() + 60
    while (h := health(url))["queued"] or h["running"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.2)
    still_answers(url)
    stream = client.chat.completions.create(model="tiny", messages=ask(), max_tokens=4, stream=True)
    assert [c for c in stream if c.choices and c.choices[0].finish_reason]


# ---------------------------------------------------------------------------------------------- fields and the log


@pytest.mark.parametrize("field, value, code", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "unsupported_parameter"),
    ("tool_choice", "required", "unsupported_parameter"),
    ("response_format", {"type": "json_object"}, "unsupported_parameter"),
    ("frequency_penalty", 0.5, "unsupported_parameter"), ("presence_penalty", -1, "unsupported_parameter"),
    ("logit_bias", {"42": 100}, "unsupported_parameter"), ("modalities", ["text", "audio"], "unsupported_parameter"),
    ("top_k", 5, "unknown_parameter"), ("guided_json", {}, "unknown_parameter"),
])
def test_fields_the_server_cannot_honour_are_a_400(served, field, value, code):
    url, _ = served
    status, body, _ = request(url, body=good(**{field: value}))
    assert status == 400 and body["error"]["code"] == code and body["error"]["param"] == field, body
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model="tiny", messages=ask(), max_tokens=2, extra_body={field: value})


def test_fields_at_their_no_op_values_and_metadata_are_accepted(served):
    url, _ = served
    status, body, _ = request(url, body=good(tools=[], tool_choice="none", response_format={"type": "text"}, frequency_penalty=0,
                                             presence_penalty=0.0, logit_bias={}, user="u-1", metadata={"a": "b"}, store=False,
                                             parallel_tool_calls=True))
    assert status == 200, body
    assistant_call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                            "function": {"name": "f", "arguments": "{}"}}]}
    status, body, _ = request(url, body=good(messages=[*ask(), assistant_call, *ask()]))
    assert status == 400 and body["error"]["code"] == "unsupported_parameter"


def test_each_request_is_logged_with_its_status_tokens_and_seconds(served):
    url, log = served
    # a line is written once its response has ended, which its client may see first: the last line of the test
    # before may still be on its way, and one of these requests' lines may come after the next one's. The lines
    # before a marker request's line are in once it is; these requests' lines are matched by status, not order.
    request(url, "GET", "/v1/models")
    deadline = time.monotonic() + 10
    while not any(line.startswith("GET /v1/models 200 ") for line in log) and time.monotonic() < deadline:
        time.sleep(0.05)
    del log[:]
    _, body, _ = request(url, body=good())
    request(url, body=good(tools=[{"type": "function"}]))
    request(url, "GET", "/health", headers={"Host": "evil.example"})
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
    list(client.chat.completions.create(model="tiny", messages=ask(), max_tokens=3, stream=True))
    deadline = time.monotonic() + 10
    while len(log) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    usage = body["usage"]
    assert len(log) == 4, log
    plain, streamed = [line for line in log if line.startswith("POST /v1/chat/completions 200 ")]
    if not plain.startswith(f"POST /v1/chat/completions 200 {usage['prompt_tokens']}+{usage['completion_tokens']} tokens "):
        plain, streamed = streamed, plain
    refused, = [line for line in log if " 400 " in line]
    rebinding, = [line for line in log if " 403 " in line]
    assert plain.startswith(f"POST /v1/chat/completions 200 {usage['prompt_tokens']}+{usage['completion_tokens']} tokens ")
    assert refused.startswith("POST /v1/chat/completions 400 - ") and rebinding.startswith("GET /health 403 - ")
    assert streamed.startswith(f"POST /v1/chat/completions 200 {usage['prompt_tokens']}+") and streamed.endswith(" s")
    assert all(float(line.split()[-2]) >= 0 for line in log[:4])


# ---------------------------------------------------------------------------------------------- a port in use


def test_a_port_in_use_is_one_panel_and_exit_2_before_the_model_loads(tiny_model, capsys, monkeypatch, tmp_path):
    import vlmctl.serve.server as server

    monkeypatch.chdir(tmp_path)  # outside any project
    loads = []
    monkeypatch.setattr(server, "load_for_serving", lambda *a, **k: loads.append(a) or (_ for _ in ()).throw(AssertionError))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(["serve", str(tiny_model), "--port", str(port), "--device", "cpu"], capsys)
    assert code == 2 and not loads, out + err
    text = " ".join((out + err).split())
    assert f"port {port} on 127.0.0.1 is already in use" in text and "--port" in text
    assert "Serving" not in text and "loading" not in text and "Errno" not in text and text.count("Usage error") == 1
