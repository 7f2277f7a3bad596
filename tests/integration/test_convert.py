"""`vlmctl convert` on HF folders and peft LoRA adapter folders: re-sharding, dtype, merge / adapter-only, verify,
overwrite rules, and clear errors for unknown or truncated sources."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from convert_helpers import make_tiny_model, source_logits
from cli_runner import run_cli as run_cli_raw


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory) -> tuple[Path, "object"]:
    """A peft LoRA adapter folder on the tiny model with non-zero B matrices, and its probe logits."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.convert import probe_inputs, probe_logits

    torch.manual_seed(1)
    base = AutoModelForImageTextToText.from_pretrained(str(tiny), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("lora") / "adapter"
    model.save_pretrained(str(folder))
    logits = probe_logits(model.eval(), probe_inputs(AutoProcessor.from_pretrained(str(tiny))))
    return folder, logits


def run_cli(args, capsys):
    code, out, err = run_cli_raw(args, capsys)
    return code, out, " ".join(err.split())


def test_hf_folder_reshard_and_cast(tiny, tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "bf16"
    code, stdout, err = run_cli(["convert", str(tiny), "-o", str(out), "--dtype", "bf16", "--max-shard-size", "40KB"], capsys)
    assert code == 0, err
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    dtypes = set()
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert {"tokenizer.json", "processor_config.json", "chat_template.jinja", "generation_config.json", "vlmctl_model.json"} <= {p.name for p in out.iterdir()}
    assert "Verified: max |logit difference|" in stdout
    ref, got = source_logits(tiny), source_logits(out)
    assert 0 < (ref - got).abs().max() < 0.06 * max(1.0, ref.abs().max())  # bf16 rounding, nothing worse


def test_hf_folder_fp32_roundtrip_is_exact(tiny, tmp_path):
    from vlmctl.convert import convert

    result = convert(tiny, tmp_path / "fp32", dtype="fp32")
    assert result.kind == "hf" and result.verify.max_abs_diff == 0.0
    assert (source_logits(tiny) - source_logits(tmp_path / "fp32")).abs().max() == 0


def test_lora_adapter_folder_merged(tiny, adapter, tmp_path):
    from vlmctl.convert import convert

    folder, ref = adapter
    result = convert(folder, tmp_path / "merged", dtype="fp32")  # base from adapter_config.json
    assert result.kind == "lora" and result.merged_lora and result.verify.passed
    out = tmp_path / "merged"
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    got = source_logits(out)
    assert (got - ref).abs().max() < 1e-4
    assert (source_logits(tiny) - ref).abs().max() > 1e-2  # the adapter matters


def test_lora_adapter_only_with_explicit_base(tiny, adapter, tmp_path, capsys):
    folder, ref = adapter
    moved = tmp_path / "adapter"
    shutil.copytree(folder, moved)
    cfg = json.loads((moved / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = None
    (moved / "adapter_config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["convert", str(moved), "-o", str(tmp_path / "x")], capsys)
    assert code == 2 and "does not name its base model" in err and "--base" in err

    code, stdout, err = run_cli(["convert", str(moved), "--base", str(tiny), "--adapter-only", "-o", str(tmp_path / "out")], capsys)
    assert code == 0, err
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "processor_config.json"} <= names
    assert "model.safetensors" not in names and "README.md" not in names
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny.resolve())
    assert (source_logits(out) - ref).abs().max() < 1e-4  # AutoModelForImageTextToText loads base + adapter


def test_refuses_to_overwrite_without_force(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(["convert", str(tiny), "-o", str(out), "--no-verify"], capsys)
    assert code == 2 and "already exists" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only a folder an earlier conversion wrote, never one of files of your own
    code, _, err = run_cli(["convert", str(tiny), "-o", str(out), "--force", "--no-verify"], capsys)
    assert code == 2 and "files vlmctl did not write" in err and (out / "keep.txt").read_text() == "mine"
    out = tmp_path / "export"
    assert run_cli(["convert", str(tiny), "-o", str(out), "--no-verify"], capsys)[0] == 0
    (out / "extra.txt").write_text("left by the earlier conversion")
    code, stdout, err = run_cli(["convert", str(tiny), "-o", str(out), "--force", "--no-verify"], capsys)
    assert code == 0, err
    assert not (out / "extra.txt").exists() and (out / "model.safetensors").is_file() and "Not verified" in stdout
    assert not list(tmp_path.glob(".export.*"))  # no temp or backup folders left


def test_unknown_source_is_named(tmp_path, capsys):
    folder = tmp_path / "stuff"
    folder.mkdir()
    (folder / "weights.npz").write_bytes(b"\0" * 10)
    code, _, err = run_cli(["convert", str(folder)], capsys)
    assert code == 2
    assert "is not a checkpoint vlmctl can convert (found: weights.npz)" in err
    assert "DCP" in err and "DeepSpeed" in err and "adapter_config.json" in err
    code, _, err = run_cli(["convert", str(tmp_path / "missing")], capsys)
    assert code == 2 and "no model folder at" in err


def test_truncated_safetensors_gives_clear_error(tiny, tmp_path, capsys):
    src = tmp_path / "broken"
    shutil.copytree(tiny, src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run_cli(["convert", str(src), "-o", str(tmp_path / "out")], capsys)
    assert code == 1
    text = " ".join(err.replace("│", " ").split())
    assert "model.safetensors is truncated" in text and "Traceback" not in err  # the damaged file, named
    assert not (tmp_path / "out").exists()


def test_bad_options(tiny, tmp_path, capsys):
    code, _, err = run_cli(["convert", str(tiny), "--dtype", "int8", "-o", str(tmp_path / "o")], capsys)
    assert code == 2 and "int8" in err
    code, _, err = run_cli(["convert", str(tiny), "--adapter-only", "-o", str(tmp_path / "o")], capsys)
    assert code == 2 and "needs a LoRA source" in err
    code, _, err = run_cli(["convert", str(tiny), "--to", "gguf"], capsys)
    assert code == 2 and "gguf" in err
