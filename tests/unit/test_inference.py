"""`vlmctl.inference`: loading a model folder for generation, rendering prompts, batched generation."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from vlmctl.errors import ModelError, UsageError
from vlmctl.inference import (
    Generation,
    GenerationRequest,
    check_backend,
    check_model_dir,
    generate,
    load_for_generation,
    render_prompt,
    request_from_sample,
)


def png_bytes(color=(200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def user(text: str, image: bool = True) -> dict:
    parts = [{"type": "image", "index": 0}] if image else []
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


REQUESTS = [
    GenerationRequest(messages=[user("What color is the square?")], images=[png_bytes()], id="a"),
    GenerationRequest(messages=[user("How many?")], images=[png_bytes((30, 30, 200))], id="b"),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random LLaVA preset (ChatML template, `<image>` token), tokenizer trained on the requests' text."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    folder = tmp_path_factory.mktemp("tiny") / "model"
    texts = [p["text"] for r in REQUESTS for m in r.messages for p in m["content"] if p["type"] == "text"]
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder), tokenizer_texts=[*texts, "red", "blue", "2"])
    return folder


def test_batch_size_does_not_change_greedy_answers(tiny_model):
    model, processor = load_for_generation(tiny_model, device="cpu", dtype="fp32")
    assert not model.training
    batched = generate(model, processor, REQUESTS, batch_size=2, max_new_tokens=5)
    single = generate(model, processor, REQUESTS, batch_size=1, max_new_tokens=5)
    assert all(isinstance(g, Generation) for g in batched) and len(batched) == 2
    assert [g.text for g in batched] == [g.text for g in single]
    assert [g.prompt for g in batched] == [g.prompt for g in single]
    assert "What color is the square?" in batched[0].prompt and batched[0].prompt.rstrip().endswith("assistant")
    assert processor.tokenizer.padding_side == "right"  # left padding only while generating


def test_prompt_rendering_and_sample_requests(tiny_model):
    from PIL import Image

    from vlmctl.data.sample import Sample
    from vlmctl.models import load_processor

    processor = load_processor(tiny_model)
    sample = Sample(id="s", messages=[user("What color?"), {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
                    images=[png_bytes()])
    request = request_from_sample(sample)
    assert [m["role"] for m in request.messages] == ["user"] and request.id == "s"
    text, images = render_prompt(request, processor)
    assert "red" not in text and len(images) == 1 and images[0].mode == "RGB"
    # a PIL image (any mode) works as well as encoded bytes
    pil = GenerationRequest(messages=request.messages, images=[Image.new("L", (8, 8), 128)])
    text2, images2 = render_prompt(pil, processor)
    assert text2 == text and images2[0].mode == "RGB"


def test_folder_without_processor_is_a_model_error_naming_it(tiny_model, tmp_path):
    folder = tmp_path / "no-processor"
    shutil.copytree(tiny_model, folder)
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
    check_model_dir(tiny_model)
    with pytest.raises(ModelError, match="has no processor") as exc:
        load_for_generation(folder, device="cpu")
    assert str(folder) in exc.value.message and "save_pretrained" in exc.value.hint
    with pytest.raises(ModelError, match="no model folder"):
        load_for_generation(tmp_path / "missing")


def test_bad_arguments_are_usage_errors(tiny_model):
    with pytest.raises(UsageError, match="unknown backend"):
        check_backend("tgi")
    check_backend("hf")
    with pytest.raises(UsageError, match="unknown dtype"):
        load_for_generation(tiny_model, dtype="int8")
    with pytest.raises(UsageError, match="batch_size"):
        generate(None, None, REQUESTS, batch_size=0)
    with pytest.raises(UsageError, match="top_p"):
        generate(None, None, REQUESTS, top_p=0.0)


def test_vllm_backend_passes_prompts_and_images(tiny_model, monkeypatch):
    """vLLM is not installed in CI: a stand-in module records what the backend hands to `LLM` and `LLM.generate`."""
    import sys
    import types

    from vlmctl.inference import generate_vllm, load_vllm

    calls = {}

    class LLM:
        def __init__(self, model, dtype):
            calls["init"] = (model, dtype)

        def generate(self, prompts, params):
            calls["generate"] = (prompts, params)
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(text=f" answer {i} ")]) for i in range(len(prompts))]

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = LLM, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", fake)
    llm, processor = load_vllm(tiny_model, dtype="bf16")
    assert calls["init"] == (str(tiny_model), "bfloat16")
    text_only = GenerationRequest(messages=[user("Hi?", image=False)])
    got = generate_vllm(llm, processor, [REQUESTS[0], text_only], max_new_tokens=4)
    assert [g.text for g in got] == ["answer 0", "answer 1"]
    prompts, params = calls["generate"]
    assert params == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 4}
    assert prompts[0]["prompt"] == got[0].prompt and prompts[0]["multi_modal_data"]["image"].mode == "RGB"
    assert "multi_modal_data" not in prompts[1]
