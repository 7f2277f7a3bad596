"""The decoding engine on a GPU: decode steps replayed from CUDA graphs give the greedy answers of eager decode
steps (bf16), with and without liger-kernel's fused kernels; the engine says it decodes from graphs; fused
projections and overlapped steps give the answers of separate projections and steps taken one at a time; graphed
prefills and the varlen vision tower give the answers of eager prefills and per-window sdpa."""

from __future__ import annotations

import io

import pytest
import torch


def _png(rgb) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), rgb).save(buf, format="PNG")
    return buf.getvalue()


def _probes(n: int):
    from vlmctl.inference import GenerationRequest

    texts = ["What color is the square?", "Name a primary color.", "How many sides?", "Describe it.", "red or blue?"]
    return [GenerationRequest(messages=[{"role": "user", "content": [{"type": "image", "index": 0},
                                                                    {"type": "text", "text": texts[i % len(texts)]}]}],
                              images=[_png(((37 * i) % 256, (91 * i) % 256, (53 * i) % 256))], id=str(i)) for i in range(n)]


def _sharpened(built):
    from vlmctl.inference import load_for_generation

    model, processor = load_for_generation(built / "tiny-qwen2.5-vl", device="cuda", dtype="bf16")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger random weights: answers that depend on the prompt
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_((torch.randn(p.shape, generator=g) * 0.3).to(p.device, p.dtype))
    return model, processor


@pytest.fixture(scope="module")
def model_on_gpu(built):
    return _sharpened(built)


def test_fused_projections_and_overlapped_steps_give_the_answers_of_neither(built):
    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.sampling import SamplingParams

    model, processor = _sharpened(built)  # its own copy: fusing changes the model in place
    probes, params = _probes(20), SamplingParams(max_tokens=24)
    plain = DecodeEngine(model, processor, max_slots=8, max_length=512, graphs=False, kernels="none", fuse=False, overlap=False)
    a = [r.completions[0].token_ids for r in plain.generate(probes, params)]
    fast = DecodeEngine(model, processor, max_slots=8, max_length=512, graphs=False, kernels="none")
    b = [r.completions[0].token_ids for r in fast.generate(probes, params)]
    assert plain.runner.fused == 0 and fast.runner.fused > 0 and fast.overlapped > 0
    same = sum(x == y for x, y in zip(a, b))
    assert same >= 19, f"{same} of 20 answers identical"
    assert len({tuple(x) for x in a}) > 5


@pytest.mark.parametrize("kernels", ["none", None])
def test_cuda_graph_decode_steps_give_the_eager_answers(model_on_gpu, kernels):
    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.sampling import SamplingParams

    model, processor = model_on_gpu
    probes = _probes(20)
    eager = DecodeEngine(model, processor, max_slots=8, max_length=512, graphs=False, kernels="none")
    graphs = DecodeEngine(model, processor, max_slots=8, max_length=512, kernels=kernels)
    assert graphs.mode == "cuda-graphs" and eager.mode == "eager"
    params = SamplingParams(max_tokens=24)
    a = [r.completions[0].token_ids for r in eager.generate(probes, params)]
    b = [r.completions[0].token_ids for r in graphs.generate(probes, params)]
    same = sum(x == y for x, y in zip(a, b))
    assert same >= 19, f"{same} of 20 answers identical"
    assert graphs.runner.graph_count > 0 and graphs.mode == "cuda-graphs", graphs.describe()
    assert len({tuple(x) for x in a}) > 5  # the answers differ from prompt to prompt: the comparison says something


def test_graphed_prefills_and_the_varlen_vision_tower_give_the_eager_answers(model_on_gpu):
    """The engine's defaults on a GPU (the language model's short prefills and the vision tower replayed from CUDA
    graphs, Qwen2.5-VL's vision windows through the varlen kernel) answer as eager prefills with the tower's own
    per-window sdpa."""
    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.sampling import SamplingParams

    model, processor = model_on_gpu
    vision = model.config.vision_config
    own = vision._attn_implementation_internal
    probes, params = _probes(20), SamplingParams(max_tokens=24)
    try:
        fast = DecodeEngine(model, processor, max_slots=8, max_length=512)
        assert fast.runner.encoders_varlen == ["vision_config"], fast.describe()
        a = [r.completions[0].token_ids for r in fast.generate(probes, params)]
        assert fast.runner.prefill_graphs > 0 and not fast.runner.prefill_reason, fast.describe()
        tower = fast.runner.encoder_graphs["image"]
        assert tower.replays > 0 and not tower.reason, fast.describe()
        vision._attn_implementation_internal = "sdpa"
        plain = DecodeEngine(model, processor, max_slots=8, max_length=512, prefill_graphs=False, encoder_graphs=False)
        assert "forward" not in model.model.visual.__dict__  # the eager tower: the graphs were removed
        vision._attn_implementation_internal = "sdpa"  # the new engine switched it again
        b = [r.completions[0].token_ids for r in plain.generate(probes, params)]
    finally:
        vision._attn_implementation_internal = own
    same = sum(x == y for x, y in zip(a, b))
    assert same >= 19, f"{same} of 20 answers identical"
    assert len({tuple(x) for x in a}) > 5


def test_a_served_profile_records_the_gpus_kernels_and_where_it_idled(model_on_gpu, tmp_path):
    """`serve --profile-dir` on the GPU: the worker thread's profile holds the decode steps' kernels (replayed from
    CUDA graphs) and the engine's phases, and its idle report counts the pause between two groups of requests, when
    the worker had no request, as waiting for work."""
    import gzip
    import json
    import time

    from vlmctl.inference.prompt import render_request
    from vlmctl.serve.engine import Engine, Job

    model, processor = model_on_gpu
    engine = Engine(model, processor, max_batch_size=4, max_length=512, profile_dir=tmp_path, warmup_length=128)
    events: list = []

    def answer(group) -> None:
        for p in group:
            engine.submit(Job(render_request(p, processor), max_tokens=16, sink=events.append))
        want, deadline = len(events and [e for e in events if e[0] == "end"]) + len(group), time.monotonic() + 120
        while sum(e[0] == "end" for e in events) < want and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        assert engine.profile("start").result(timeout=120)["recording"]
        probes = _probes(8)
        answer(probes[:4])
        time.sleep(0.3)  # no request: the worker waits and the GPU has no work, until the next group's kernels
        answer(probes[4:])
        stopped = engine.profile("stop").result(timeout=300)
    finally:
        engine.close()
    assert sum(e[0] == "end" for e in events) == 8 and not any(e[0] == "error" for e in events)
    assert stopped["gpu_busy_seconds"] > 0 and stopped["waiting_seconds"] >= 0.2
    assert stopped["phase_seconds"]["engine.decode_step"] > 0 and "engine.wait_for_tokens" in stopped["phase_seconds"]
    with gzip.open(f"{stopped['folder']}/trace.json.gz", "rt") as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    assert kernels, "no GPU kernel in the trace"


def test_decode_steps_while_rows_end_never_wait_for_the_stream(model_on_gpu):
    """Once admitted, rows that end at different steps while others decode free their slots without a synchronizing
    CUDA call (torch's sync debug mode counts them): the host then stays a step ahead of the GPU. Taking a step's
    tokens waits on its event, which that mode does not count, by design."""
    import warnings

    from vlmctl.inference.engine import DecodeEngine
    from vlmctl.inference.sampling import SamplingParams

    model, processor = model_on_gpu
    engine = DecodeEngine(model, processor, max_slots=8, max_length=512)
    engine.runner.capture_decode(engine.max_length)  # every row bucket's graph first: a capture synchronizes
    requests = [engine.submit(p, SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True)) for i, p in enumerate(_probes(6))]
    engine.step()  # admission: its prefill and first tokens read the device, as they must
    assert engine.running == 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while engine.running:
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.settle()
    synced = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert not synced, f"{len(synced)} synchronizing calls while rows ended: {synced[:3]}"
    assert [len(r.completions[0].token_ids) for r in requests] == [4 + 3 * i for i in range(6)]
    assert engine.overlapped > 0


def test_random_draws_work_after_a_capture_that_failed(model_on_gpu):
    """A capture that fails midway (a host read inside it invalidates the stream's capture) raises from the runner's
    `_capture_run`, which the engine turns into eager decoding; the GPU's default generator is left not capturing,
    so eager sampling and any later random draw on that GPU still work (torch leaves it marked as capturing and every
    draw raises "Offset increment outside graph capture encountered unexpectedly" otherwise)."""
    from vlmctl.inference.engine import DecodeEngine

    model, processor = model_on_gpu
    engine = DecodeEngine(model, processor, max_slots=2, max_length=64)
    x = torch.ones(4, device="cuda")
    with pytest.raises(Exception):  # noqa: B017 - torch's own error, its type differs across versions
        engine.runner._capture_run(lambda: (x * 2).sum().item())
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.manual_seed(5)
    first = torch.rand(16, device="cuda")
    torch.cuda.manual_seed(5)
    assert torch.equal(torch.rand(16, device="cuda"), first)
    assert torch.multinomial(torch.ones(4, device="cuda"), 2).shape == (2,)
