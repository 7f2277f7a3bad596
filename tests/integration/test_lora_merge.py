"""LoRA merges equal peft's own: a real LoRA run of the tiny template (`vlmctl init --template tiny`: base model saved
in bf16, training in fp32, `train.lora.keep_adapter`) converted from its `final/` adapter folder and from its DCP
checkpoint, compared with peft's `merge_and_unload` of the same adapter on an fp32 base; `--verify` passes in fp32
and bf16; pushing the adapter folder sends vlmctl's card.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from cli_runner import run_cli

STEPS = 6


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """The tiny template project (a smaller generated data set) after 6 in-process LoRA steps with keep_adapter:
    `final/` is the peft adapter, `checkpoints/checkpoint-6/` the DCP checkpoint of the same weights."""
    from vlmctl.project import init_project

    root = tmp_path_factory.mktemp("lora") / "proj"
    init_project(root, "tiny", num_samples=240)
    capture = _Capture()
    cfg = ["-c", str(root / "vlmctl.yaml")]
    for args in (["data", "prepare"], ["model", "build"],
                 ["train", "--launcher", "none", "train.strategy=ddp", "train.stage=finetune", "train.lora.r=8",
                  "train.lora.alpha=16", "train.lora.dropout=0", "train.lora.keep_adapter=true", "train.learning_rate=5e-3",
                  f"train.max_steps={STEPS}", f"train.save_steps={STEPS}", "train.micro_batch_size=8", "train.run_name=lora"]):
        code, out, err = run_cli([*cfg, "-q", *args], capture)
        assert code == 0, out + err
    run = root / "outputs" / "runs" / "lora"
    assert (run / "final" / "adapter_config.json").is_file() and (run / "checkpoints" / f"checkpoint-{STEPS}").is_dir()
    return run


class _Capture:
    """capsys stand-in for a module-scoped fixture: run_cli only needs readouterr()."""

    def readouterr(self):
        from types import SimpleNamespace

        return SimpleNamespace(out="", err="")


def _project(run: Path) -> Path:
    return run.parents[2]


def _inputs(run: Path, n: int = 24) -> list[dict]:
    """The convert probe plus `n` prepared val samples (whole conversations), as processor tensors."""
    import pyarrow.parquet as pq
    from PIL import Image
    from transformers import AutoProcessor

    from vlmctl.convert import probe_inputs
    from vlmctl.data.sample import Sample

    processor = AutoProcessor.from_pretrained(str(_project(run) / "outputs" / "model"))
    batches = [probe_inputs(processor)]
    rows = pq.read_table(next((_project(run) / "data" / "prepared" / "val").glob("*.parquet"))).to_pylist()[:n]
    for row in rows:
        sample = Sample.from_row(row)
        image = sample.images[0]
        image = Image.open(io.BytesIO(image if isinstance(image, bytes) else image["bytes"])).convert("RGB")
        text = processor.apply_chat_template(sample.messages)
        batches.append(dict(processor(images=image, text=text, return_tensors="pt")))
    return batches


def _logits(model, batches):
    """Logits of every position of every batch, [positions, vocab] float32."""
    import torch

    dtype = next(model.parameters()).dtype
    out = []
    with torch.no_grad():
        for batch in batches:
            out.append(model(**{k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}).logits.float()[0])
    return torch.cat(out)


@pytest.fixture(scope="module")
def peft_merged(lora_run):
    """peft's own merge of the run's adapter: fp32 base + `PeftModel.from_pretrained` + `merge_and_unload()`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base_dir = _project(lora_run) / "outputs" / "model"
    assert json.loads((base_dir / "config.json").read_text()).get("dtype") == "bfloat16"  # as the template builds it
    base = AutoModelForImageTextToText.from_pretrained(str(base_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(lora_run / "final")).merge_and_unload().eval()


@pytest.mark.parametrize("source", ["final", "checkpoint"])
def test_fp32_merge_equals_peft_merge_and_verifies(lora_run, peft_merged, source, tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmctl.convert import TOLERANCE, convert

    src = lora_run / "final" if source == "final" else lora_run / "checkpoints" / f"checkpoint-{STEPS}"
    result = convert(src, tmp_path / "out", dtype="fp32")  # verifies against the unmerged fp32 peft model
    assert result.merged_lora and result.verify.passed
    assert result.verify.tolerance == pytest.approx(TOLERANCE["fp32"] * max(1.0, result.verify.ref_max_abs))

    batches = _inputs(lora_run)
    ref = _logits(peft_merged, batches)
    got = _logits(AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out"), dtype="auto").eval(), batches)
    assert (got - ref).abs().max() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    base = AutoModelForImageTextToText.from_pretrained(str(_project(lora_run) / "outputs" / "model"), dtype=torch.float32).eval()
    assert (_logits(base, batches) - ref).abs().max() > 1e-2  # the adapter changes the model: the check can fail


@pytest.mark.parametrize("source", ["final", "checkpoint"])
def test_bf16_merge_is_peft_fp32_merge_rounded_once(lora_run, peft_merged, source, tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from vlmctl.convert import TOLERANCE, convert

    src = lora_run / "final" if source == "final" else lora_run / "checkpoints" / f"checkpoint-{STEPS}"
    result = convert(src, tmp_path / "out", dtype="bf16")
    assert result.verify.passed and result.verify.max_abs_diff > 0  # bf16 rounds: compared with the fp32 model
    assert result.verify.tolerance == pytest.approx(TOLERANCE["bf16"] * max(1.0, result.verify.ref_max_abs))
    assert {f.get_slice(k).get_dtype() for f in [safe_open(str(tmp_path / "out" / "model.safetensors"), "pt")] for k in f.keys()} == {"BF16"}
    saved = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out"), dtype="auto").state_dict()
    ref = peft_merged.state_dict()
    assert saved.keys() == ref.keys()
    assert all(torch.equal(t, ref[k].to(torch.bfloat16)) for k, t in saved.items())


def test_verify_tolerance_follows_the_coarser_dtype(lora_run, tmp_path):
    from vlmctl.convert import TOLERANCE, convert

    # the bf16 base model exported in fp32: the reference ran in bf16, so bf16 rounding bounds the difference
    result = convert(_project(lora_run) / "outputs" / "model", tmp_path / "fp32", dtype="fp32")
    assert result.verify.passed and result.verify.max_abs_diff > TOLERANCE["fp32"] * max(1.0, result.verify.ref_max_abs)
    assert result.verify.tolerance == pytest.approx(TOLERANCE["bf16"] * max(1.0, result.verify.ref_max_abs))


def test_push_of_the_keep_adapter_folder_sends_vlmctl_card(lora_run, capsys):
    from huggingface_hub import ModelCard, ModelCardData

    final = lora_run / "final"
    assert not (final / "README.md").exists()  # the run's export leaves out peft's placeholder card
    code, out, err = run_cli(["-c", str(_project(lora_run) / "vlmctl.yaml"), "push", str(final), "--repo-id", "me/tiny-lora",
                              "--dry-run", "--json", "hub.license=mit"], capsys)
    assert code == 0, err
    result = json.loads(out)
    card = ModelCard(result["card"])
    data = card.data.to_dict()
    assert ModelCardData(**data).to_dict() == data
    assert data["library_name"] == "peft" and data["license"] == "mit" and "base_model" not in data
    assert str(_project(lora_run)) not in result["card"]  # no local paths
    assert "| LoRA | r=8, alpha=16 |" in card.text and f"| optimizer steps | {STEPS} |" in card.text
