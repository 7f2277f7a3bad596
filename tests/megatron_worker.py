"""Run by torchrun (2 ranks, gloo) from tests/integration/test_megatron_convert.py: megatron-core builds, saves and
loads the Megatron checkpoints the tests import and export.

For each model of `--jobs` (a JSON list of {name, kind: llava | qwen2_5_vl | qwen3_vl, hf, export, vocab, tied,
inputs}; qwen3_vl: its language model, step 3 only):
1. tensor parallel 1: a randomly initialized model, saved as torch_dist as Megatron-LM does ({"model": ...}) (`dist1/`) and as legacy files (`legacy1/`);
2. tensor parallel 2: another model loads `dist1/` through megatron-core (which re-splits it) and saves both again
   (`dist2/`, `legacy2/mp_rank_00`, `mp_rank_01`);
3. tensor parallel 2: a third model loads vlmctl's export `export` (its `_extra_state` objects included) and rank 0
   writes its logits on `inputs` to `logits.pt`.
Legacy files are what Megatron-LM's `save_checkpoint` writes in that format: {model, args, iteration,
checkpoint_version} per tensor-parallel rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megatron_cpu import causal_mask, gpt_config, gpt_model, init, llava_model, patch_cpu, rank

patch_cpu()


def bridge_qwen2_5_vl(config, vocab: int, tied: bool):
    """Megatron-Bridge's `Qwen25VLModel` as megatron-core sees it: transformers' vision tower under `visual`
    (replicated) and a `GPTModel` language model."""
    from megatron.core.transformer.module import MegatronModule
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    class Qwen25VLModel(MegatronModule):
        def __init__(self):
            super().__init__(config=gpt_config(config.text_config, qkv_bias=True))
            self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)
            self.language_model = gpt_model(config.text_config, vocab, tied=tied)

    return Qwen25VLModel()


def bridge_qwen3_vl_language(config, vocab: int, tied: bool):
    """The language model of Megatron-Bridge's `Qwen3VLModel` (a `GPTModel` with q/k layer norms under
    `language_model`); its vision model is Megatron-Bridge's own, not megatron-core's."""
    from megatron.core.transformer.module import MegatronModule

    text = config.text_config

    class Qwen3VLLanguage(MegatronModule):
        def __init__(self):
            super().__init__(config=gpt_config(text, qkv_bias=False, qk_norm=True))
            self.language_model = gpt_model(text, vocab, tied=tied, qkv_bias=False, qk_norm=True)

    return Qwen3VLLanguage()


def build(job: dict, seed: int):
    from transformers import AutoConfig

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(job["hf"])
    if job["kind"] == "llava":
        return llava_model(config, job["vocab"], tied=job["tied"])
    if job["kind"] == "qwen3_vl":
        return bridge_qwen3_vl_language(config, job["vocab"], job["tied"])
    return bridge_qwen2_5_vl(config, job["vocab"], job["tied"])


def save_legacy(model, folder: Path, tp_rank: int, tp_size: int) -> None:
    path = folder / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(tensor_model_parallel_size=tp_size, ckpt_format="torch")
    torch.save({"model": model.state_dict(), "args": args, "iteration": 1, "checkpoint_version": 3.0}, path)


def logits(model, job: dict) -> torch.Tensor:
    inputs = torch.load(job["inputs"], weights_only=True)
    ids = inputs["input_ids"]
    with torch.no_grad():
        if job["kind"] == "llava":  # one image token stands for the image's features in Megatron's LLaVA
            image = job["image_token_id"]
            where = (ids[0] == image).nonzero()[:, 0]
            short = torch.cat([ids[0, : where[0] + 1], ids[0, where[-1] + 1 :]])[None]
            length = ids.shape[1]
            out = model(inputs["pixel_values"], short, torch.arange(length)[None], attention_mask=causal_mask(length), labels=None)
            return (out[0] if isinstance(out, tuple) else out).float()
        length = ids.shape[1]
        return model.language_model(ids, torch.arange(length)[None], attention_mask=causal_mask(length)).float()


def load(model, folder) -> dict:
    """The model state of a torch_dist checkpoint, loaded as Megatron-LM's `load_checkpoint` does (the model's
    sharded state under "model"; common.pt holds the rest)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder))["model"]


def main() -> None:
    from megatron.core import dist_checkpointing, parallel_state

    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True)
    args = parser.parse_args()
    for job in json.loads(Path(args.jobs).read_text()):
        out = Path(job["out"])
        if job["kind"] == "qwen3_vl":  # the language model only: megatron-core has no Qwen3-VL vision model
            init(tp=2)
            export_logits(job, out)
            continue
        init(tp=1)
        model = build(job, seed=0)
        (out / "dist1").mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(out / "dist1"))
        if rank() == 0:
            save_legacy(model, out / "legacy1", 0, 1)
        init(tp=2)
        model = build(job, seed=1)
        model.load_state_dict(load(model, out / "dist1"))
        (out / "dist2").mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(out / "dist2"))
        save_legacy(model, out / "legacy2", parallel_state.get_tensor_model_parallel_rank(), 2)
        export_logits(job, out)


def export_logits(job: dict, out: Path) -> None:
    """Step 3 of the module docstring: megatron-core loads vlmctl's export; rank 0 writes the logits."""
    model = build(job, seed=2)
    model.load_state_dict(load(model, job["export"]))
    result = logits(model.eval(), job)
    if rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "logits.pt")
    torch.distributed.barrier()


if __name__ == "__main__":
    sys.exit(main())
