"""Megatron checkpoints made by megatron-core itself, on CPU (gloo, 2 ranks: tests/megatron_worker.py):

- saved at tensor parallel 1 and 2, as torch_dist and as legacy per-rank files, they import to identical
  transformers tensors (Megatron-LM's LLaVA with a CLIP tower, Megatron-Bridge's Qwen2.5-VL);
- megatron-core loads vlmctl's `--to megatron --tensor-parallel 2` export and its logits match transformers' within
  1e-4 (fp32): the whole CLIP + Qwen2 LLaVA (image included), and the language models of Qwen2.5-VL and Qwen3-VL
  (q/k layer norms, explicit head size; megatron-core has no model of Megatron-Bridge's vision towers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from convert_helpers import make_clip_llava, make_preset, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """HF models, vlmctl's exports of them, and one 2-rank megatron-core run over both (see the module docstring)."""
    from vlmctl.convert import convert, probe_inputs
    from vlmctl.models.load import load_processor

    root = tmp_path_factory.mktemp("megatron")
    tiny = make_tiny_model(root / "tiny")
    models = {"llava": make_clip_llava(root / "clip-llava", tiny), "qwen2_5_vl": make_preset(root / "qwen", "tiny-qwen2.5-vl"),
              "qwen3_vl": make_preset(root / "qwen3", "tiny-qwen3-vl")}
    jobs = []
    for kind, hf in models.items():
        export = root / f"{kind}-megatron"
        convert(hf, export, to="megatron", tensor_parallel=2)
        record = json.loads((export / "hf" / "megatron.json").read_text())
        processor = load_processor(hf)
        inputs = probe_inputs(processor) if kind == "llava" else {"input_ids": torch.arange(3, 40)[None]}
        torch.save(inputs, root / f"{kind}-inputs.pt")
        jobs.append({"name": kind, "kind": kind, "hf": str(hf), "export": str(export / "iter_0000000"),
                     "vocab": record["padded_vocab_size"], "tied": not record["megatron_args"]["untie_embeddings_and_output_weights"],
                     "inputs": str(root / f"{kind}-inputs.pt"), "out": str(root / f"{kind}-mcore"),
                     "image_token_id": processor.tokenizer.convert_tokens_to_ids("<image>")})
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(TESTS / "megatron_worker.py"), "--jobs", str(root / "jobs.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {job["name"]: job for job in jobs}


def _hf_tensors(folder: Path, hf: str) -> dict[str, torch.Tensor]:
    from vlmctl.convert_megatron import find_source, load_megatron

    model, _ = load_megatron(find_source(folder, hf))
    return model.state_dict()


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl"])
def test_megatron_core_saves_import_identically_at_any_split(megatron_run, kind):
    job = megatron_run[kind]
    out = Path(job["out"])
    ref = _hf_tensors(out / "dist1", job["hf"])
    for other in ("dist2", "legacy1", "legacy2"):
        got = _hf_tensors(out / other, job["hf"])
        assert got.keys() == ref.keys()
        different = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert not different, f"{other}: {different[:5]}"
    # megatron-core's random weights, not the HF model's: the import read the checkpoint
    hf_model = _hf_model_state(job["hf"])
    assert any(not torch.equal(ref[k], hf_model[k]) for k in ref if "embed_tokens" in k)


def _hf_model_state(hf: str) -> dict[str, torch.Tensor]:
    from vlmctl.convert import auto_model_class

    return auto_model_class(hf).from_pretrained(hf).state_dict()


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl", "qwen3_vl"])
def test_megatron_core_loads_the_export_with_matching_logits(megatron_run, kind):
    from vlmctl.convert import auto_model_class

    job = megatron_run[kind]
    mcore = torch.load(Path(job["out"]) / "logits.pt", weights_only=True)
    model = auto_model_class(job["hf"]).from_pretrained(job["hf"]).eval()
    inputs = torch.load(job["inputs"], weights_only=True)
    with torch.no_grad():
        ref = model(**inputs).logits.float()
    assert mcore.shape[:2] == ref.shape[:2] and mcore.shape[-1] >= ref.shape[-1]  # Megatron pads the vocabulary
    diff = (mcore[..., : ref.shape[-1]] - ref).abs().max().item()
    assert diff <= 1e-4 * max(1.0, ref.abs().max().item()), diff
    assert mcore[..., : ref.shape[-1]].std() > 0.01  # real logits, not zeros


def test_cli_imports_a_tensor_parallel_megatron_core_save(megatron_run, tmp_path, capsys):
    from cli_runner import run_cli

    job = megatron_run["qwen2_5_vl"]
    code, stdout, err = run_cli(["convert", "--from", "megatron", str(Path(job["out"]) / "dist2"), "--base", job["hf"],
                                 "-o", str(tmp_path / "hf"), "--json"], capsys)
    assert code == 0, err
    data = json.loads(stdout)
    assert data["kind"] == "megatron" and data["verify"]["passed"]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
