"""`vlmctl serve --processor-workers`: each request's prompt is processed alone in a worker process, into the
tensors the processor makes in the server's own process, and the server then answers as it does without workers;
a family that batches prompts only through its processor keeps the processor on the engine's thread."""

from __future__ import annotations

import base64
import io
import json
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")

from vlmctl.inference import GenerationRequest, load_for_generation  # noqa: E402
from vlmctl.inference.inputs import processor_inputs  # noqa: E402
from vlmctl.inference.prompt import model_family, render_request  # noqa: E402
from vlmctl.serve import ServeSettings, running_server  # noqa: E402


def png(rgb, side: int = 48) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), rgb).save(buf, format="PNG")
    return buf.getvalue()


def ask(url: str, image: bytes, text: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}
    answer = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [part, {"type": "text", "text": text}]}])
    return answer.choices[0].message.content


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as reply:
        return json.loads(reply.read())


def test_a_worker_makes_the_processors_tensors_and_the_server_answers_as_without_workers(tiny_models):
    from vlmctl.serve.prepare import PromptPreparer

    folder = tiny_models("tiny-qwen2.5-vl")
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    request = GenerationRequest(messages=[{"role": "user", "content": [{"type": "image", "index": 0},
                                                                         {"type": "text", "text": "What color is it?"}]}],
                                images=[png((200, 30, 30))])
    rendered = render_request(request, processor)
    preparer = PromptPreparer(folder, workers=1)
    try:
        prepared = preparer(rendered)
    finally:
        preparer.close()
    own = processor_inputs(processor, [rendered.text], rendered.images)
    assert set(prepared) == set(own) | {"position_ids"} and all(torch.equal(prepared[k], own[k]) for k in own)
    # the positions the engine would compute for it with the loaded model's own function
    assert torch.equal(prepared["position_ids"], model_family(model).prompt_positions(model)(own))

    questions = [(png((200, 30, 30)), "What color is it?"), (png((20, 200, 30), side=64), "Which shape is shown here?"),
                 (png((20, 30, 200)), "Describe it.")]
    with running_server(model, processor, ServeSettings(port=0), name="tiny") as url:
        want = [ask(url, image, text) for image, text in questions]
    with running_server(model, processor, ServeSettings(port=0, processor_workers=1), name="tiny", model_dir=folder) as url:
        got = [ask(url, image, text) for image, text in questions]
        state = health(url)
        assert state["collated_prefills"] >= len(questions) and state["collated_positions"] == state["collated_prefills"]
    assert got == want


def test_positions_computed_alone_batch_as_the_engine_computes_them_and_answer_the_same(tiny_models):
    """A worker's position ids for each prompt alone (the family's function on a copy of the model without weights),
    batched by `collate_positions`, are the ones the engine computes for the batch at every token (and everywhere
    when every prompt has a picture); an engine given them answers as one that computes them."""
    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.inputs import collate_inputs, collate_positions
    from vlmctl.inference.sampling import SamplingParams
    from vlmctl.serve.prepare import prompt_positions

    folder = tiny_models("tiny-qwen2.5-vl")
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    engine_positions = model_family(model).prompt_positions(model)
    worker_positions = prompt_positions(folder)
    assert worker_positions is not None and prompt_positions(tiny_models("tiny")) is None  # a family without them

    def ask_(content, images):
        return GenerationRequest(messages=[{"role": "user", "content": content}], images=images)

    picture = {"type": "image", "index": 0}
    requests = [ask_([picture, {"type": "text", "text": "What color is it?"}], [png((200, 30, 30))]),
                ask_([picture, {"type": "image", "index": 1}, {"type": "text", "text": "Which one is larger, and why?"}],
                     [png((20, 200, 30), side=64), png((20, 30, 200), side=40)]),
                ask_([{"type": "text", "text": "Name a color."}], []),
                ask_([picture, {"type": "text", "text": "Describe the square in one long sentence please."}], [png((9, 9, 9))])]
    rendered = [render_request(r, processor) for r in requests]
    alone = [processor_inputs(processor, [r.text], r.images) for r in rendered]
    positions = [worker_positions(a) for a in alone]
    compared = 0
    for group in ([0, 1, 3], [3, 0], [0, 2], [2, 1, 3], [2, 2]):
        host = collate_inputs([alone[i] for i in group], processor.tokenizer.pad_token_id)
        if host is None:  # the processor would batch these differently: the engine calls it then
            continue
        compared += 1
        want = engine_positions(host)
        got = collate_positions([positions[i] for i in group], int(host["input_ids"].shape[1]))
        tokens = host["attention_mask"].bool()
        assert torch.equal(got[:, tokens], want[:, tokens]), group
        if all(requests[i].images for i in group):
            assert torch.equal(got, want), group
    assert compared >= 3

    params, pictured = SamplingParams(max_tokens=6), [0, 1, 3]  # prompts that batch without the processor
    want = DecodeEngine(model, processor, max_slots=4, max_length=1024).generate([requests[i] for i in pictured], params)
    engine = DecodeEngine(model, processor, max_slots=4, max_length=1024)
    handles = [engine.submit(requests[i], params, prepared={**alone[i], "position_ids": positions[i]}) for i in pictured]
    while engine.busy:
        engine.step()
    assert [h.completions[0].token_ids for h in handles] == [r.completions[0].token_ids for r in want]
    assert engine.collated_positions == engine.collated >= 1


def test_a_family_that_batches_only_through_its_processor_keeps_it_on_the_engine(tiny_models):
    folder = tiny_models("tiny-gemma3")
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    with running_server(model, processor, ServeSettings(port=0, processor_workers=1), name="tiny", model_dir=folder) as url:
        assert ask(url, png((200, 30, 30)), "What color is it?") is not None
        assert health(url)["collated_prefills"] == 0


def test_auto_starts_workers_only_beside_a_cuda_device_with_cores_to_spare():
    from vlmctl.serve import server

    assert server.auto_processor_workers(torch.device("cuda", 0), cpus=16)[0] == server.AUTO_PROCESSOR_WORKERS
    assert server.auto_processor_workers(torch.device("cuda"), cpus=8)[0] == 2  # one per 4 cores
    workers, why = server.auto_processor_workers(torch.device("cuda"), cpus=2)
    assert workers == 0 and "2 CPU cores" in why
    workers, why = server.auto_processor_workers(torch.device("cpu"), cpus=64)
    assert workers == 0 and "cpu" in why
    assert server.auto_processor_workers(torch.device("cuda"))[0] <= server.AUTO_PROCESSOR_WORKERS  # this host's cores


def test_the_default_on_the_cpu_keeps_the_processor_on_the_engine_and_health_says_why(tiny_models):
    folder = tiny_models("tiny-qwen2.5-vl")
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    with running_server(model, processor, ServeSettings(port=0), name="tiny", model_dir=folder) as url:
        assert ask(url, png((200, 30, 30)), "What color is it?") is not None
        state = health(url)
    assert state["processor_workers"] == 0 and state["collated_prefills"] == 0
    assert state["requests_read"] == 1 and state["read_seconds"] > 0  # its body, picture, template and tokens
    assert "engine's thread" in state["processor"] and "runs on cpu" in state["processor"]
    with running_server(model, processor, ServeSettings(port=0, processor_workers=1), name="tiny", model_dir=folder) as url:
        assert health(url)["processor_workers"] == 1


def test_workers_that_cannot_load_the_processor_stop_the_engine_started_beside_them(tiny_models, tmp_path, monkeypatch):
    """The workers start while the engine captures its graphs; when their processor does not load (here a damaged
    tokenizer.json in the folder they load from), serving fails with one ModelError and the engine's thread ends."""
    import shutil

    from vlmctl.errors import ModelError
    from vlmctl.serve import server

    folder = tiny_models("tiny-qwen2.5-vl")
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "tokenizer.json").write_text("{")
    engines, real = [], server.Engine
    monkeypatch.setattr(server, "Engine", lambda *a, **k: engines.append(real(*a, **k)) or engines[-1])
    with pytest.raises(ModelError, match="processor workers could not start") as err:
        server.make_state(model, processor, ServeSettings(port=0, processor_workers=1), "tiny", model_dir=broken)
    assert "--processor-workers 0" in err.value.hint
    assert len(engines) == 1  # the engine did start beside the workers
    engines[0]._worker.join(timeout=10)  # told to stop without waiting; it ends on its own, having nothing to answer
    assert not engines[0]._worker.is_alive()


def test_a_position_function_that_fails_leaves_the_prompts_tensors_without_positions(tiny_models, monkeypatch):
    """In a worker, positions are an addition: when the family's function raises for a prompt, the prompt's tensors
    still come back (the engine computes its positions at admission), and without a function none are added."""
    from vlmctl.serve import prepare

    folder = tiny_models("tiny-qwen2.5-vl")
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    rendered = render_request(GenerationRequest(messages=[{"role": "user", "content": [
        {"type": "image", "index": 0}, {"type": "text", "text": "What color is it?"}]}], images=[png((1, 2, 3))]), processor)
    monkeypatch.setattr(prepare, "_PROCESSOR", processor)

    def fails(inputs):
        raise RuntimeError("no positions for this one")

    for function, has_positions in ((prepare.prompt_positions(folder), True), (fails, False), (None, False)):
        monkeypatch.setattr(prepare, "_POSITIONS", function)
        arrays = prepare._prepare(rendered.text, list(rendered.images), [], [], None)
        assert "input_ids" in arrays and ("position_ids" in arrays) == has_positions


def test_pictures_still_encoded_go_to_the_worker_as_their_bytes_and_give_the_same_tensors(tiny_models, monkeypatch):
    """A served picture opened from the request's bytes and not decoded yet is sent as those bytes (a fraction of
    its pickled pixels); one that was converted (RGBA to RGB), decoded, or made in memory is sent as it is. Either
    way the worker's tensors are the processor's own for the rendered prompt."""
    import pickle

    from PIL import Image

    from vlmctl.serve import prepare

    folder = tiny_models("tiny-qwen2.5-vl")
    _, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    monkeypatch.setattr(prepare, "_PROCESSOR", processor)
    monkeypatch.setattr(prepare, "_POSITIONS", None)
    jpeg, rgba = io.BytesIO(), io.BytesIO()
    noise = Image.effect_noise((320, 240), 60).convert("RGB")
    noise.save(jpeg, format="JPEG")
    Image.new("RGBA", (48, 40), (10, 200, 30, 128)).save(rgba, format="PNG")
    request = GenerationRequest(messages=[{"role": "user", "content": [
        {"type": "image", "index": 0}, {"type": "image", "index": 1}, {"type": "image", "index": 2},
        {"type": "text", "text": "Compare them."}]}], images=[jpeg.getvalue(), rgba.getvalue(), noise])
    rendered = render_request(request, processor)
    sent = [prepare.portable_image(i) for i in rendered.images]
    assert sent[0] == jpeg.getvalue() and len(pickle.dumps(sent[0])) < len(pickle.dumps(rendered.images[0])) / 2
    assert sent[1] is rendered.images[1] and sent[2] is rendered.images[2]  # converted; made in memory
    own = processor_inputs(processor, [rendered.text], rendered.images)
    got = prepare._prepare(rendered.text, sent, [], [], None)
    assert set(got) == set(own) and all(torch.equal(torch.from_numpy(got[k]), own[k]) for k in own)
    rendered.images[0].load()
    assert prepare.portable_image(rendered.images[0]) is rendered.images[0]  # decoded already: sent as it is


def test_the_wait_for_a_body_sent_after_its_head_is_counted_apart(tiny_models):
    """/health's `body_seconds`: from a request's arrival (its head read) to its whole body, the client's pace,
    inside `read_seconds`."""
    import socket
    import time
    from urllib.parse import urlparse

    folder = tiny_models("tiny-qwen2.5-vl")
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    body = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello?"}]}).encode()
    with running_server(model, processor, ServeSettings(port=0), name="tiny") as url:
        address = urlparse(url)
        with socket.create_connection((address.hostname, address.port), timeout=60) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            time.sleep(0.5)  # the head is there; the body comes half a second later
            conn.sendall(body)
            reply = b""
            while b"\r\n\r\n" not in reply:
                reply += conn.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200")
        state = health(url)
    assert state["requests_read"] == 1
    assert 0.45 <= state["body_seconds"] < state["read_seconds"]  # the template, tokens and queueing come after
