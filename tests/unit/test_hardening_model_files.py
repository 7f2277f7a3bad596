"""A damaged file of a model folder is named, with the fix, by every command that loads the model: never another
file, never transformers' words without the file's name, never a silent load that fails later."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from cli_runner import run_cli as run
from vlmctl.errors import ModelError
from vlmctl.models.load import build_empty_model, load_model, load_processor


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny random LLaVA preset, and a copy of it saved in shards."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    root = tmp_path_factory.mktemp("files")
    build_model(ModelSection(preset="tiny", init="random", output_dir=root / "model"), tokenizer_texts=["red blue", "what color", "hi"])
    model, _, _ = load_model(root / "model")
    sharded = root / "sharded"
    shutil.copytree(root / "model", sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    model.save_pretrained(sharded, max_shard_size="600KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    return root


def halve(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def first_shard(d: Path) -> Path:
    return sorted(d.glob("model-0*.safetensors"))[0]


def wider_mlp(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] += 8  # another model's config: the weights no longer fit
    (d / "config.json").write_text(json.dumps(cfg))


# (folder, damage, the file the message must name, words it must hold)
CASES = {
    "truncated weights": ("model", lambda d: halve(d / "model.safetensors"), "model.safetensors", "truncated"),
    "empty weights": ("model", lambda d: (d / "model.safetensors").write_bytes(b""), "model.safetensors", "not a safetensors file"),
    "garbage weights": ("model", lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "model.safetensors", "not a safetensors file"),
    "truncated shard": ("sharded", lambda d: halve(first_shard(d)), "model-00001-of-", "truncated"),
    "missing shard": ("sharded", lambda d: first_shard(d).unlink(), "model.safetensors.index.json", "lists the shard model-00001-of-"),
    "garbage index": ("sharded", lambda d: (d / "model.safetensors.index.json").write_text("{oops"), "model.safetensors.index.json", "not valid JSON"),
    "garbage config": ("model", lambda d: (d / "config.json").write_text('{"model_type": "llava",'), "config.json", "not valid JSON"),
    "config of another shape": ("model", wider_mlp, "config.json", "do not fit"),
    "garbage tokenizer": ("model", lambda d: (d / "tokenizer.json").write_text("{oops"), "tokenizer.json", "not valid JSON"),
    "tokenizer of no known model": ("model", lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}'),
                                    "tokenizer.json", "not a tokenizer"),
    "garbage tokenizer config": ("model", lambda d: (d / "tokenizer_config.json").write_text("{oops"), "tokenizer_config.json", "not valid JSON"),
    "garbage processor config": ("model", lambda d: (d / "processor_config.json").write_text("[1,"), "processor_config.json", "not valid JSON"),
    "garbage preprocessor config": ("model", lambda d: (d / "preprocessor_config.json").write_text("{oops"), "preprocessor_config.json", "not valid JSON"),
    "broken chat template": ("model", lambda d: (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }"),
                             "chat_template.jinja", "not a valid chat template"),
    "garbage generation config": ("model", lambda d: (d / "generation_config.json").write_text("{oops"), "generation_config.json", "not valid JSON"),
    "not UTF-8 config": ("model", lambda d: (d / "config.json").write_bytes(b'{"a": "\xff"}'), "config.json", "not UTF-8"),
}
OTHER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja",
               "generation_config.json", "model.safetensors")


def damaged(tiny: Path, tmp_path: Path, case: str) -> tuple[Path, str, str]:
    base, damage, named, words = CASES[case]
    folder = tmp_path / case.replace(" ", "_")
    shutil.copytree(tiny / base, folder)
    damage(folder)
    return folder, named, words


def assert_names(message: str, folder: Path, named: str, words: str) -> None:
    assert f"{folder}/{named}" in message, message
    assert words in message, message
    others = [f for f in OTHER_FILES if not named.startswith(f) and re.search(re.escape(f"{folder}/{f}") + r"(?![\w.-])", message)]
    assert others == [] or (named == "config.json" and others == ["model.safetensors"]), message  # shapes: both sides


@pytest.mark.parametrize("case", list(CASES))
def test_loading_names_the_damaged_file(tiny, tmp_path, case):
    folder, named, words = damaged(tiny, tmp_path, case)
    with pytest.raises(ModelError) as exc:
        load_model(folder)
    assert_names(exc.value.message, folder, named, words)
    hint = exc.value.hint or ""
    assert ("copy or download it again" in hint and "vlmctl model build --force" in hint) or "config.json" in hint


@pytest.mark.parametrize("case", ["truncated shard", "garbage tokenizer", "broken chat template", "garbage generation config"])
def test_loading_without_weights_names_the_damaged_file_too(tiny, tmp_path, case):
    # training's start-up on several GPUs builds the model empty; the processor alone is loaded by data prepare
    folder, named, words = damaged(tiny, tmp_path, case)
    with pytest.raises(ModelError) as exc:
        build_empty_model(folder)
    assert_names(exc.value.message, folder, named, words)
    if case != "truncated shard":
        with pytest.raises(ModelError, match=named):
            load_processor(folder)


def test_a_file_damaged_after_a_good_load_is_still_named(tiny, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny / "model", folder)
    load_processor(folder)  # passes, and is remembered as passed
    (folder / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ModelError, match="tokenizer_config.json is not valid JSON"):
        load_processor(folder)


@pytest.mark.parametrize("command", ["convert", "push", "generate"])
@pytest.mark.parametrize("case", ["truncated shard", "garbage tokenizer"])
def test_commands_name_the_damaged_file(tiny, tmp_path, capsys, command, case):
    folder, named, _ = damaged(tiny, tmp_path, case)
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "red"}]}) + "\n")
    args = {"convert": ["convert", str(folder), "-o", str(tmp_path / "out"), "--no-verify"],
            "push": ["push", str(folder), "--repo-id", "me/model", "--dry-run"],
            "generate": ["generate", str(folder), "-i", str(data), "-o", str(tmp_path / "p.jsonl")]}[command]
    code, out, err = run(args, capsys)
    text = " ".join((out + err).replace("│", " ").split())
    assert code == 1 and named in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["garbage tokenizer", "tokenizer of no known model", "broken chat template", "garbage processor config"])
def test_token_counting_names_the_damaged_file(tiny, tmp_path, case):
    # data validate / prepare count tokens with the built model's processor files, without loading the model
    from vlmctl.data.tokens import TokenCounter

    folder, named, words = damaged(tiny, tmp_path, case)
    with pytest.raises(ModelError) as exc:
        TokenCounter.load(folder)
    assert_names(exc.value.message, folder, named, words)


def test_token_counting_reads_no_weights(tiny, tmp_path):
    from vlmctl.data.tokens import TokenCounter

    folder, _, _ = damaged(tiny, tmp_path, "truncated weights")
    assert TokenCounter.load(folder) is not None
