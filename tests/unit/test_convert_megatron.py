"""Megatron interop without megatron-core: the tensor layouts, legacy files, round trips and refusals
(`vlmctl.convert_megatron`; checkpoints megatron-core itself writes and loads: tests/integration/test_megatron_convert.py)."""

from __future__ import annotations

import argparse
import datetime
import io
import shutil
from pathlib import Path

import pytest
import torch

from convert_helpers import make_preset, make_tiny_model
from vlmctl.convert_megatron import checkpoint as ckpt
from vlmctl.convert_megatron.layouts import Rule, padded_vocab, to_hf, to_megatron
from vlmctl.errors import ModelError, UsageError


def test_qkv_is_grouped_per_query_group():
    # 4 query heads in 2 groups, head size 1: Megatron keeps [q0 q1 k0 v0 | q2 q3 k1 v1]
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    rule = Rule("m", ("q", "k", "v"), "qkv", heads=4, groups=2, head_dim=1)
    fused = to_megatron(rule, [q, k, v])
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = to_hf(rule, fused, {"q": (4, 1), "k": (2, 1), "v": (2, 1)})
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    # a vision tower's fused [q; k; v] with one group per head
    cat = Rule("m", ("qkv",), "qkv_cat", heads=2, groups=2, head_dim=1)
    assert to_megatron(cat, [torch.tensor([0., 1., 10., 11., 20., 21.])]).tolist() == [0, 10, 20, 1, 11, 21]


def test_gate_up_vocab_and_class_token_layouts():
    gate, up = torch.ones(2, 3), torch.zeros(2, 3)
    rule = Rule("m", ("g", "u"), "gate_up")
    assert torch.equal(to_megatron(rule, [gate, up]), torch.cat([gate, up]))
    emb = torch.randn(300, 4)
    vocab = Rule("m", ("e",), "vocab")
    padded = to_megatron(vocab, [emb], padded_vocab(300, 2))
    assert padded.shape == (512, 4) and torch.equal(padded[:300], emb) and not padded[300:].any()
    assert torch.equal(to_hf(vocab, padded, {"e": (300, 4)})[0], emb)
    assert padded_vocab(384, 1) == 384 and padded_vocab(385, 1) == 512 and padded_vocab(384, 4) == 512
    with pytest.raises(ModelError, match="vocabulary rows"):
        to_hf(vocab, padded[:200], {"e": (300, 4)})
    token = Rule("m", ("c",), "class_token")
    assert to_megatron(token, [torch.arange(3.)]).shape == (1, 1, 3)


def test_legacy_gated_mlp_is_merged_per_rank():
    # each tensor-parallel rank holds its own [gate_r; up_r]; the whole layer is [gate_0 gate_1; up_0 up_1]
    ranks = [torch.tensor([[0.], [1.], [10.], [11.]]), torch.tensor([[2.], [3.], [12.], [13.]])]
    name = "language_model.decoder.layers.0.mlp.linear_fc1.weight"
    assert ckpt._merge(name, ranks, lambda n: True).flatten().tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert ckpt._merge(name, ranks, lambda n: False).flatten().tolist() == [0, 1, 10, 11, 2, 3, 12, 13]
    proj = [torch.ones(2, 2), torch.zeros(2, 2)]
    assert ckpt._merge("x.self_attention.linear_proj.weight", proj, lambda n: False).shape == (2, 4)
    assert ckpt._merge("x.input_layernorm.weight", [torch.ones(2), torch.ones(2)], lambda n: False).shape == (2,)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"llava": make_tiny_model(root / "llava"), "qwen2_5_vl": make_preset(root / "qwen25", "tiny-qwen2.5-vl"),
            "qwen3_vl": make_preset(root / "qwen3", "tiny-qwen3-vl")}


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from vlmctl.convert import auto_model_class

    return auto_model_class(folder).from_pretrained(str(folder)).state_dict()


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl", "qwen3_vl"])
def test_hf_megatron_hf_is_bit_exact(models, name, tmp_path):
    from vlmctl.convert import convert

    exported = convert(models[name], tmp_path / "mg", to="megatron", tensor_parallel=2)
    assert exported.verify.passed and exported.verify.max_abs_diff == 0
    assert any("ln_post" in n for n in exported.notes) == (name == "llava")  # the tiny LLaVA's tower is SigLIP
    iteration = tmp_path / "mg" / "iter_0000000"
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert (iteration / "metadata.json").is_file() and (iteration / ".metadata").is_file()
    back = convert(tmp_path / "mg", tmp_path / "hf", from_="megatron")
    assert back.kind == "megatron" and back.verify.passed
    ref, got = _state(models[name]), _state(tmp_path / "hf")
    assert ref.keys() == got.keys()
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
    # the Megatron names are megatron-core's: fused QKV and gate+up, layers stacked on a leading axis
    tensors = ckpt.read(iteration, lambda n: n.endswith("mlp.linear_fc1.weight") and n.startswith("language_model"))
    assert "language_model.decoder.layers.0.self_attention.linear_qkv.weight" in tensors
    assert "language_model.embedding.word_embeddings.weight" in tensors


def test_foreign_llava_checkpoint_keeps_what_llava_reads(models, tmp_path):
    """A Megatron-LM LLaVA holds no SigLIP pooling head: the import drops it from the config, the logits stay."""
    from vlmctl.convert import convert

    convert(models["llava"], tmp_path / "mg", to="megatron")
    (tmp_path / "mg" / "hf" / "extra.safetensors").unlink()
    result = convert(tmp_path / "mg", tmp_path / "hf")
    assert result.verify.passed
    assert any("pooling head" in n for n in result.notes)
    got = _state(tmp_path / "hf")
    assert not any(".head." in k for k in got)
    ref = _state(models["llava"])
    assert all(torch.equal(got[k], ref[k]) for k in got)


def test_refusals(models, tmp_path):
    from vlmctl.convert import convert

    with pytest.raises(UsageError, match="does not divide the model's 4 attention heads"):
        convert(models["qwen2_5_vl"], tmp_path / "x", to="megatron", tensor_parallel=3)
    with pytest.raises(UsageError, match="applies to --to megatron"):
        convert(models["qwen2_5_vl"], tmp_path / "x", tensor_parallel=2)
    with pytest.raises(UsageError, match="not a Megatron checkpoint"):
        convert(models["qwen2_5_vl"], tmp_path / "x", from_="megatron")
    convert(models["qwen2_5_vl"], tmp_path / "mg", to="megatron")
    shutil.rmtree(tmp_path / "mg" / "hf")
    with pytest.raises(UsageError, match="holds weights only"):
        convert(tmp_path / "mg", tmp_path / "x")  # the hint names --base


def _legacy(folder: Path, model_state: dict, extra=None, rank: str = "mp_rank_00") -> None:
    path = folder / rank / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": model_state, "args": argparse.Namespace(tensor_model_parallel_size=1), "iteration": 5,
                "checkpoint_version": 3.0, **(extra or {})}, path)


def test_legacy_files_are_read_weights_only(models, tmp_path):
    from vlmctl.checkpoints import CheckpointError
    from vlmctl.convert import convert

    convert(models["qwen2_5_vl"], tmp_path / "mg", to="megatron")
    tensors = ckpt.read(tmp_path / "mg" / "iter_0000000", lambda n: "language_model" in n and n.endswith("fc1.weight"))
    # a legacy file of the same weights (local layer names, as megatron-core's local spec keeps them) imports alike
    local = {k.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
              .replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"): v for k, v in tensors.items()}
    _legacy(tmp_path / "legacy", local)
    ref = convert(tmp_path / "legacy", tmp_path / "hf", base=str(tmp_path / "mg" / "hf"))
    assert ref.verify.passed and "legacy" in ckpt.describe(tmp_path / "legacy")
    assert all(torch.equal(a, b) for a, b in zip(_state(tmp_path / "hf").values(), _state(models["qwen2_5_vl"]).values()))
    # two pipeline stages: each file numbers its own layers from 0
    first = {k: v for k, v in local.items() if ".layers.1." not in k and "final_layernorm" not in k}
    second = {k.replace(".layers.1.", ".layers.0."): v for k, v in local.items() if ".layers.1." in k or "final_layernorm" in k}
    _legacy(tmp_path / "pp", first, rank="mp_rank_00_000")
    _legacy(tmp_path / "pp", second, rank="mp_rank_00_001")
    assert ckpt.describe(tmp_path / "pp") == "legacy, tensor parallel 1 x pipeline 2"
    convert(tmp_path / "pp", tmp_path / "hf-pp", base=str(tmp_path / "mg" / "hf"))
    assert all(torch.equal(a, b) for a, b in zip(_state(tmp_path / "hf-pp").values(), _state(models["qwen2_5_vl"]).values()))
    # Transformer Engine keeps its FP8 state as in-memory bytes: allowed (not read)
    _legacy(tmp_path / "te", {**local, "language_model.decoder.layers.0.self_attention.linear_qkv._extra_state": io.BytesIO(b"fp8")})
    assert convert(tmp_path / "te", tmp_path / "hf-te", base=str(tmp_path / "mg" / "hf")).verify.passed
    # an object that needs code to unpickle is refused, naming it
    _legacy(tmp_path / "bad", local, {"when": datetime.date(2025, 1, 1)})
    with pytest.raises(CheckpointError, match="refusing to load .*datetime.date"):
        convert(tmp_path / "bad", tmp_path / "x", base=str(tmp_path / "mg" / "hf"))
    # a tensor the layout has no place for (another architecture than --base says)
    _legacy(tmp_path / "stray", {**local, "language_model.decoder.layers.7.mlp.linear_fc2.weight": torch.zeros(2, 2)})
    with pytest.raises(ModelError, match="no place for"):
        convert(tmp_path / "stray", tmp_path / "x", base=str(tmp_path / "mg" / "hf"))
