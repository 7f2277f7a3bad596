"""`model build` with the tiny preset: no downloads, reload through the Auto classes, generate, overwrite rules."""

from __future__ import annotations

import json

import pytest

from vlmctl.config.model import ModelSection
from vlmctl.errors import ConfigError, DataError, ModelError

TEXTS = [
    "What color is the triangle? Answer with one word.", "red", "How many circles are there? Answer with one word.",
    "3", "Is the square left of the circle? Answer with one word.", "yes", "What shape is the blue object?", "square",
] * 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vlmctl.models import build_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    result = build_model(ModelSection(preset="tiny", init="random", output_dir=out, dtype="fp32"), tokenizer_texts=TEXTS)
    return result


def test_tiny_build_writes_a_standard_checkpoint(tiny):
    out = tiny.output_dir
    for name in ("config.json", "model.safetensors", "generation_config.json", "processor_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    info = json.loads((out / "vlmctl_model.json").read_text())
    assert info["family"] == "llava" and info["mode"] == "preset" and info["built_from"]["preset"] == "tiny"
    p = info["parameters"]
    assert p["total"] == p["vision"] + p["projector"] + p["llm"] and min(p["vision"], p["projector"], p["llm"]) > 0
    assert info["visual_tokens_per_image"] == 64 and info["image_size"] == 64
    assert not list(out.parent.glob(".model.tmp-*"))  # the temporary folder was renamed away


def test_tiny_reloads_with_auto_classes_and_generates(tiny):
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny.output_dir).eval()
    processor = AutoProcessor.from_pretrained(tiny.output_dir)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert model.config.vision_feature_select_strategy == processor.vision_feature_select_strategy == "full"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the triangle?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n<image>") and text.endswith("<|im_start|>assistant\n")
    batch = processor(images=[Image.new("RGB", (64, 64), (200, 30, 30))], text=[text], return_tensors="pt")
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == 64
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(logits).all()
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 3 or int(out[0, -1]) in processor.tokenizer.convert_tokens_to_ids(["<|im_end|>"])


def test_tokenizer_has_chatml_and_image_tokens(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.output_dir)
    for t in ("<|im_start|>", "<|im_end|>", "<image>", "<pad>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, t
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<pad>"
    text = "What color is the triangle?"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # The assistant turn is marked for training through {% generation %}.
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]
    enc = tok.apply_chat_template(msgs, return_assistant_tokens_mask=True, return_dict=True)
    marked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(marked) == "red<|im_end|>"


def test_build_is_deterministic_and_refuses_to_overwrite(tiny, tmp_path):
    import safetensors.torch as st

    from vlmctl.models import build_model

    section = ModelSection(preset="tiny", init="random", output_dir=tiny.output_dir, dtype="fp32")
    with pytest.raises(ModelError, match="already exists"):
        build_model(section, tokenizer_texts=TEXTS)
    other = build_model(section.model_copy(update={"output_dir": tmp_path / "again"}), tokenizer_texts=TEXTS)
    a = st.load_file(tiny.output_dir / "model.safetensors")
    b = st.load_file(other.output_dir / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # --force replaces it in place.
    forced = build_model(section.model_copy(update={"output_dir": other.output_dir, "projector": "linear"}), tokenizer_texts=TEXTS, force=True)
    assert json.loads((forced.output_dir / "vlmctl_model.json").read_text())["built_from"]["projector"] == "linear"


def test_tokenizer_trained_on_prepared_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmctl.data.sample import Sample, arrow_schema
    from vlmctl.models import build_model

    rows = [
        Sample(id=f"s{i}", messages=[
            {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "Which zebra is striped?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "The zebra on the left."}]},
        ], images=[b"x"]).to_row()
        for i in range(20)
    ]
    (tmp_path / "prepared" / "train").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema()), tmp_path / "prepared" / "train" / "shard-00000.parquet")
    section = ModelSection(preset="tiny", init="random", output_dir=tmp_path / "m")
    result = build_model(section, prepared_dir=tmp_path / "prepared")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(result.output_dir)
    assert len(tok.tokenize(" zebra")) < len(" zebra")  # merges were learned on the shard text
    with pytest.raises(DataError, match="no Parquet shards"):
        build_model(section.model_copy(update={"output_dir": tmp_path / "m2"}), prepared_dir=tmp_path / "nothing")


def test_section_errors_are_clear(tmp_path):
    from vlmctl.models import build_model

    with pytest.raises(ConfigError, match="nothing to build"):
        build_model(ModelSection(output_dir=tmp_path / "a"))
    with pytest.raises(ConfigError, match="init: random"):
        build_model(ModelSection(preset="tiny", output_dir=tmp_path / "a"))
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="unknown preset 'huge'"):  # refused with the config
        ModelSection(preset="huge", init="random", output_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="only a vision encoder"):
        build_model(ModelSection(preset="siglip-so400m", init="random", output_dir=tmp_path / "a"))
    assert not (tmp_path / "a").exists()


def test_quiet_transformers_restores_logging_and_progress_bars():
    from transformers.utils import logging as hf_logging

    from vlmctl.models.load import quiet_transformers

    hf_logging.set_verbosity_warning()
    hf_logging.enable_progress_bar()
    try:
        with quiet_transformers():
            assert hf_logging.get_verbosity() == hf_logging.ERROR
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.get_verbosity() == hf_logging.WARNING and hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        with quiet_transformers():
            pass
        assert not hf_logging.is_progress_bar_enabled()  # what the caller chose stays chosen
    finally:
        hf_logging.enable_progress_bar()


NOISE = ("Loading weights", "Writing model shards", "it/s]", "torchvision", "[WARNING]", "real_accelerator")


def test_build_and_load_print_no_third_party_noise(tmp_path):
    # A fresh process: transformers' warnings are `warning_once` and would not repeat inside this test session.
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from vlmctl.config.model import ModelSection\n"
        "from vlmctl.models import build_model, load_model, load_processor\n"
        f"texts = {TEXTS[:8]!r} * 10\n"
        f"r = build_model(ModelSection(preset='tiny', init='random', output_dir={str(tmp_path / 'm')!r}, dtype='fp32'), tokenizer_texts=texts)\n"
        "load_processor(r.output_dir)\n"
        "load_model(r.output_dir)\n"
        "print('DEEPSPEED', 'deepspeed' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for noise in NOISE:
        assert noise not in done.stdout + done.stderr, noise
    assert "DEEPSPEED False" in done.stdout  # saving the model does not import DeepSpeed


def test_image_processor_class_needs_no_torchvision():
    import importlib.util

    from vlmctl.models.load import image_processor_class

    cls = image_processor_class("SiglipImageProcessor")
    if importlib.util.find_spec("torchvision") is None:
        assert cls.__name__ == "SiglipImageProcessorPil"
    assert cls(size={"height": 32, "width": 32}).size["height"] == 32


def test_processor_only_commands_load_no_weights(tiny, tmp_path, monkeypatch, capsys):
    # Counting tokens against a built model (data validate / prepare) needs its processor, never its weights.
    import transformers
    from PIL import Image

    from cli_runner import run_cli

    def no_weights(*args, **kwargs):
        raise AssertionError("model weights were loaded")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(no_weights))
    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    rows = [{"id": "a", "image": "red.png", "conversations": [{"from": "human", "value": "<image>\nWhat color?"},
                                                              {"from": "gpt", "value": "red"}]}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "vlmctl.yaml").write_text(
        f"project: {{name: t}}\nmodel: {{preset: tiny, init: random, output_dir: {tiny.output_dir}}}\n"
        "data:\n  sources:\n    - {path: d.json, format: llava}\n  num_proc: 1\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "validate"], capsys)
    assert code == 0, err
    code, out, err = run_cli(["data", "prepare"], capsys)
    assert code == 0, err
    assert "too_long was not checked" not in out  # the counts came from the built model's processor
    from vlmctl.models import load_processor

    assert load_processor(tiny.output_dir).tokenizer is not None
