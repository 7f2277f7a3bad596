"""NCCL on two GPUs of one host: FSDP2, ZeRO-3, sequence parallelism (Ulysses over varlen, with liger on and off),
tensor parallelism (DTensor, fp32 and bf16 with varlen and compiled layers) and hybrid sharding over 2 x 1, each
against the CPU path of the same packed rows (fp32, sdpa, no liger).

Tolerances as in test_training_paths: fp32 loss rel 1e-4, gradients rtol 2e-3 / atol 2e-5; bf16 loss rel 2e-2 and
a gradient cosine similarity >= 0.99."""

from __future__ import annotations

import pytest

from conftest import run_ranks
from test_training_paths import assert_grads_close, case, cosine

pytestmark = pytest.mark.two_gpus

CASES = {
    "fsdp": {"train": {}},
    "fsdp_liger": {"train": {"liger": "on"}},
    "hsdp_2x1": {"train": {"fsdp_sharding": "hybrid"}, "ranks_per_node": 1},
    "zero3": {"train": {"strategy": "zero3"}},
    "sp2": {"train": {"sequence_parallel": 2}},
    "sp2_liger": {"train": {"sequence_parallel": 2, "liger": "on"}},
    "sp2_zero3": {"train": {"strategy": "zero3", "sequence_parallel": 2}},
    "tp2": {"train": {"tensor_parallel": 2}},
    "tp2_bf16_varlen_compile": {"train": {"tensor_parallel": 2, "precision": "bf16", "master_weights": "fp32",
                                          "attn_implementation": "auto", "compile": "on", "liger": "auto"}},
    "sp2_bf16_varlen_liger": {"train": {"sequence_parallel": 2, "precision": "bf16", "master_weights": "fp32",
                                        "attn_implementation": "auto", "liger": "on", "compile_vision": "auto"}},
}


@pytest.fixture(scope="module")
def results(built, tmp_path_factory):
    out = run_ranks(built, "tiny-qwen2.5-vl", CASES, 2, tmp_path_factory.mktemp("two_gpus"))
    out["_failed"] = {k: v["error"] for k, v in out.items() if isinstance(v, dict) and "error" in v}
    return out


@pytest.mark.parametrize("name", ["fsdp", "fsdp_liger", "hsdp_2x1", "zero3", "sp2", "sp2_liger", "sp2_zero3", "tp2"])
def test_fp32_runs_over_two_gpus_equal_the_cpu_path(results, name):
    got = case(results, name)
    ref = results["reference"][str(got["rows"])]
    assert got["rows"] == (1 if name.startswith(("sp2", "tp2")) else 2)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert_grads_close(got["grads"], ref["grads"], what=name)


def test_sequence_parallel_with_liger_and_varlen_in_bf16(results):
    got = case(results, "sp2_bf16_varlen_liger")
    ref = results["reference"]["1"]
    assert got["liger"] and got["attn"] == "vlmctl_varlen"
    assert got["loss"] == pytest.approx(ref["loss"], rel=2e-2)
    assert cosine(got["grads"], ref["grads"]) >= 0.99


def test_tensor_parallel_with_varlen_and_compiled_layers_in_bf16(results):
    got = case(results, "tp2_bf16_varlen_compile")
    ref = results["reference"]["1"]
    # liger's fused loss reads the whole LM head: tensor parallelism computes its vocabulary-parallel loss instead
    assert not got["liger"] and got["attn"] == "vlmctl_varlen"
    assert got["loss"] == pytest.approx(ref["loss"], rel=2e-2)
    assert cosine(got["grads"], ref["grads"]) >= 0.99
