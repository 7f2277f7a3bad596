"""`vlmctl serve --profile-dir`: POST /start_profile and /stop_profile record the decoding thread under torch.profiler
into a new folder (the Chrome trace with the engine's phases as named ranges, ops.txt with the idle report); the
routes refuse without the folder, out of order, and without the API key; a profile nobody stops is stopped and
written by the worker after its longest time."""

from __future__ import annotations

import base64
import gzip
import io
import json
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from vlmctl.inference import load_for_generation  # noqa: E402
from vlmctl.serve import ServeSettings, running_server  # noqa: E402


def picture() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 48), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def post(url: str, path: str, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"{url}{path}", data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ask(url: str, key: str = "-") -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture()}},
                                     {"type": "text", "text": "What color is it?"}]}])


def test_a_profile_records_the_engines_phases_and_writes_the_trace_and_idle_report(tiny_models, tmp_path):
    model, processor = load_for_generation(tiny_models("tiny-qwen2.5-vl"), device="cpu", dtype="fp32")
    root = tmp_path / "prof"
    with running_server(model, processor, ServeSettings(port=0, profile_dir=root, api_key="k"), name="tiny") as url:
        assert post(url, "/start_profile")[0] == 401  # the API key guards it as it guards completions
        status, started = post(url, "/start_profile", "k")
        assert status == 200 and started["recording"] and started["profile_dir"] == str(root)
        status, again = post(url, "/start_profile", "k")
        assert status == 409 and "already recording" in again["error"]["message"]
        ask(url, "k")
        ask(url, "k")
        time.sleep(0.2)  # the worker waits for work: recorded as such
        status, stopped = post(url, "/stop_profile", "k")
        assert status == 200, stopped
        folder = root / "profile-001"
        assert stopped["folder"] == str(folder) and stopped["seconds"] > 0.2
        with gzip.open(folder / "trace.json.gz", "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        # the engine's phases, on the thread that ran them (torch records the thread that started the profile)
        assert {"engine.admit", "engine.inputs", "engine.prefill", "engine.first_tokens", "engine.decode_step",
                "engine.take_tokens", "serve.wait_for_requests"} <= names
        assert (folder / "ops.txt").read_text().startswith("profiled ")
        phases = stopped["phase_seconds"]  # host seconds per phase; a phase nests in its parent
        assert phases["serve.wait_for_requests"] >= 0.15 and 0 < phases["engine.prefill"] <= phases["engine.admit"]
        assert "engine.decode_step" in stopped["summary"]
        assert "GPU idle time" in stopped["summary"]
        status, late = post(url, "/stop_profile", "k")
        assert status == 409 and "no profile is recording" in late["error"]["message"]
        # a second profile goes to a folder of its own
        assert post(url, "/start_profile", "k")[0] == 200
        ask(url, "k")
        status, second = post(url, "/stop_profile", "k")
        assert status == 200 and second["folder"] == str(root / "profile-002")


def test_profiling_is_off_without_a_folder(tiny_models):
    model, processor = load_for_generation(tiny_models("tiny-qwen2.5-vl"), device="cpu", dtype="fp32")
    with running_server(model, processor, ServeSettings(port=0), name="tiny") as url:
        status, body = post(url, "/start_profile")
        assert status == 400 and body["error"]["code"] == "profiling_off" and "--profile-dir" in body["error"]["message"]


def test_a_profile_nobody_stops_is_stopped_and_written_by_the_worker(tiny_models, tmp_path):
    from vlmctl.profiling import ProfileStateError
    from vlmctl.serve.engine import Engine

    model, processor = load_for_generation(tiny_models("tiny-qwen2.5-vl"), device="cpu", dtype="fp32")
    engine = Engine(model, processor, max_batch_size=2, profile_dir=tmp_path, profile_seconds=0.3)
    try:
        assert engine.profile("start").result(timeout=60)["recording"]
        deadline = time.monotonic() + 60
        while engine.last_profile is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the idle worker wakes at the limit, with no request to run
        assert engine.last_profile is not None and "0.3 s" in engine.last_profile["stopped"]
        assert (tmp_path / "profile-001" / "trace.json.gz").is_file()
        with pytest.raises(ProfileStateError, match="stopped because it recorded for 0.3 s.*profile-001"):
            engine.profile("stop").result(timeout=60)
    finally:
        engine.close()
