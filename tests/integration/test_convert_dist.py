"""`vlmctl convert` on real distributed checkpoints of the tiny model: a 2-rank FSDP2 run (full and LoRA, torch DCP)
and 2-rank DeepSpeed ZeRO-2 (frozen vision tower) and ZeRO-3 runs, all on CPU with gloo. Each run trains two steps, saves with
`vlmctl.train.checkpoint.save` and records the training model's probe logits; the converted HF folders must load
with the Auto classes and reproduce them. Truncated checkpoints must give a clear error.

Run as a script (`torchrun --nproc_per_node 2 tests/integration/test_convert_dist.py fsdp|zero MODEL_DIR OUT_ROOT`) this file is
the training worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
STEPS = 2


# --------------------------------------------------------------------------------------------------------------------
# Worker (runs under torchrun)


def _write_run(run_dir: Path, model_dir: Path, strategy: str, lora: dict | None, losses: list[float]) -> None:
    import yaml

    cfg = {
        "project": {"name": "convert-test"},
        "model": {"preset": "tiny", "init": "random", "output_dir": str(model_dir)},
        "train": {"stage": "full", "strategy": strategy, "learning_rate": 1e-2, **({"lora": {"r": lora["r"], "alpha": lora["lora_alpha"]}} if lora else {})},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": loss, "tokens": 60 * (i + 1)}) + "\n" for i, loss in enumerate(losses)))


def _train_steps(forward_backward_step, inputs) -> list[float]:
    losses = []
    for _ in range(STEPS):
        losses.append(forward_backward_step(inputs))
    return losses


def _worker(kind: str, model_dir: Path, out_root: Path) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmctl.convert import probe_inputs, probe_logits
    from vlmctl.distributed.engine import DeepSpeedEngine, TorchEngine
    from vlmctl.train import checkpoint

    processor = AutoProcessor.from_pretrained(str(model_dir))
    inputs = probe_inputs(processor)
    labels = inputs["input_ids"].clone()

    if kind == "fsdp":
        from peft import LoraConfig, get_peft_model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        for variant in ("full", "lora"):
            torch.manual_seed(0)
            model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
            lora = None
            if variant == "lora":
                config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)
                model = get_peft_model(model, config)
                lora = {**config.to_dict(), "target_modules": sorted(config.target_modules)}
            for module in model.modules():
                if type(module).__name__.endswith(("DecoderLayer", "EncoderLayer")):
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

            def step(batch):
                loss = model(**batch, labels=labels).loss
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                return float(loss)

            model.train()
            losses = _train_steps(step, inputs)
            run_dir = out_root / f"fsdp-{variant}"
            state = {"step": STEPS, "epoch": 0, "lora": lora, "model_source": str(model_dir), "family": "llava", "world_size": world, "strategy": "fsdp", "format": "dcp"}
            checkpoint.save(run_dir, STEPS, state, rank=rank, engine=TorchEngine(model, optimizer, scheduler, max_grad_norm=0.0))
            model.eval()
            logits = probe_logits(model, inputs)
            if rank == 0:
                _write_run(run_dir, model_dir, "fsdp", lora, losses)
                save_file({"logits": logits.contiguous()}, str(run_dir / "ref_logits.safetensors"))
            dist.barrier()
        dist.destroy_process_group()
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        for stage in (2, 3):
            torch.manual_seed(0)
            model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
            if stage == 2:  # stage finetune: a frozen vision tower is saved outside the optimizer partitions
                for name, p in model.named_parameters():
                    p.requires_grad_("vision_tower" not in name)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            ds_config = {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9,
            }
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

            def step(batch):
                loss = engine(**batch, labels=labels).loss
                engine.backward(loss)
                engine.step()
                return float(loss)

            engine.train()
            losses = _train_steps(step, inputs)
            run_dir = out_root / f"zero{stage}"
            state = {"step": STEPS, "epoch": 0, "lora": None, "model_source": str(model_dir), "family": "llava", "world_size": world, "strategy": f"zero{stage}", "format": "deepspeed"}
            checkpoint.save(run_dir, STEPS, state, rank=rank, engine=DeepSpeedEngine(engine))
            engine.eval()
            with torch.no_grad():
                logits = engine(**inputs).logits.float()
            if rank == 0:
                _write_run(run_dir, model_dir, f"zero{stage}", None, losses)
                save_file({"logits": logits.contiguous()}, str(run_dir / "ref_logits.safetensors"))
            dist.barrier()
            engine.destroy()


# --------------------------------------------------------------------------------------------------------------------
# Tests


def _torchrun(kind: str, model_dir: Path, out_root: Path) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(HERE.parent), str(HERE)])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(Path(__file__)), kind, str(model_dir), str(out_root)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        raise AssertionError(f"{kind} worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from convert_helpers import make_tiny_model

    root = tmp_path_factory.mktemp("dist")
    model_dir = make_tiny_model(root / "model")
    _torchrun("fsdp", model_dir, root)
    _torchrun("zero", model_dir, root)
    return root


def _ref(run_dir: Path):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "ref_logits.safetensors"))["logits"]


def _check_matches(out: Path, run_dir: Path, atol: float = 1e-4) -> None:
    """OUT, loaded with the Auto classes, reproduces the training model's probe logits (and the base does not)."""
    from convert_helpers import source_logits

    logits, ref = source_logits(out), _ref(run_dir)
    base = source_logits(run_dir.parent / "model")
    assert (base - ref).abs().max() > 1e-2  # training moved the weights: matching the base would not pass
    diff = (logits - ref).abs().max()
    assert diff <= atol, f"max |logit diff| {diff}"


def test_fsdp_dcp_checkpoint_converts_and_matches_training_logits(runs, tmp_path):
    from vlmctl.convert import convert

    run = runs / "fsdp-full"
    result = convert(run, tmp_path / "out", dtype="fp32")  # the run folder: latest complete checkpoint
    assert result.kind == "dcp" and result.verify.passed and result.verify.max_abs_diff < 1e-4
    out = tmp_path / "out"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "processor_config.json", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    _check_matches(out, run)
    info = json.loads((out / "vlmctl_export.json").read_text())
    assert info["step"] == STEPS and info["run_dir"] == str(run.resolve())


def test_fsdp_lora_run_converts_merged_and_adapter_only(runs, tmp_path):
    from vlmctl.convert import convert

    run = runs / "fsdp-lora"
    ckpt = run / "checkpoints" / f"checkpoint-{STEPS}"
    merged = convert(ckpt, tmp_path / "merged", dtype="fp32")
    assert merged.merged_lora and not (tmp_path / "merged" / "adapter_config.json").exists()
    _check_matches(tmp_path / "merged", run)
    adapter = convert(ckpt, tmp_path / "adapter", adapter_only=True)
    assert adapter.adapter_only and adapter.verify.passed
    names = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names and "model.safetensors" not in names
    _check_matches(tmp_path / "adapter", run)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoint_converts_and_matches_training_logits(stage, runs, tmp_path):
    from vlmctl.convert import convert

    run = runs / f"zero{stage}"
    assert (run / "checkpoints" / f"checkpoint-{STEPS}" / "latest").is_file()
    result = convert(run / "checkpoints" / f"checkpoint-{STEPS}", tmp_path / "out", dtype="fp32")
    assert result.kind == "deepspeed" and result.verify.passed
    _check_matches(tmp_path / "out", run)


def test_cli_default_dtype_from_trained_model_and_bf16_verify(runs, tmp_path, capsys):
    from vlmctl.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(["convert", str(runs / "zero3"), "-o", str(tmp_path / "bf16"), "--dtype", "bf16", "--max-shard-size", "40KB"])
    out = capsys.readouterr()
    assert exc.value.code in (0, None), out.err
    assert "Verified: max |logit difference|" in out.out
    assert len(list((tmp_path / "bf16").glob("model-*.safetensors"))) > 1 and (tmp_path / "bf16" / "model.safetensors.index.json").is_file()


def test_push_dry_run_of_an_export_describes_the_run(runs, tmp_path, capsys):
    from vlmctl.cli.app import main
    from vlmctl.convert import convert

    convert(runs / "fsdp-full", tmp_path / "export", dtype="fp32", verify=False)
    with pytest.raises(SystemExit) as exc:
        main(["push", str(tmp_path / "export"), "--repo-id", "me/tiny", "--dry-run"])
    out = capsys.readouterr().out
    assert exc.value.code in (0, None)
    losses = [json.loads(line)["loss"] for line in (runs / "fsdp-full" / "metrics.jsonl").read_text().splitlines()]
    assert "| strategy | fsdp |" in out and f"| optimizer steps | {STEPS} |" in out and "| hardware | 2 processes |" in out
    assert f"| final training loss | {losses[-1]:.4f} |" in out and f"| tokens seen | {60 * STEPS} |" in out
    assert "README.md (generated)" in out and "model.safetensors" in out
    assert "vlmctl_export.json" not in out  # local paths stay local
    total = json.loads((runs / "model" / "vlmctl_model.json").read_text())["parameters"]["total"]
    assert f"{total / 1e6:.2f}M parameters" in out and "preset: `tiny`" in out


def test_truncated_dcp_checkpoint_gives_clear_error(runs, tmp_path, capsys):
    from vlmctl.cli.app import main

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(runs / "fsdp-full" / "checkpoints" / f"checkpoint-{STEPS}", ckpt)
    shard = sorted(ckpt.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(ckpt), "-o", str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert exc.value.code == 1
    assert "cannot read the DCP checkpoint" in err and "truncated" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))

    shard.unlink()
    with pytest.raises(SystemExit):
        main(["convert", str(ckpt), "-o", str(tmp_path / "out")])
    assert f"missing {shard.name}" in " ".join(capsys.readouterr().err.split())


def test_truncated_zero_checkpoint_gives_clear_error(runs, tmp_path, capsys):
    from vlmctl.cli.app import main

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(runs / "zero3" / "checkpoints" / f"checkpoint-{STEPS}", ckpt)
    part = sorted(ckpt.glob("global_step*/*optim_states.pt"))[-1]
    part.write_bytes(part.read_bytes()[:100])
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(ckpt), "-o", str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert exc.value.code == 1
    assert "cannot consolidate the DeepSpeed checkpoint" in err and "Traceback" not in err

    part.unlink()  # a rank that never wrote its partition
    with pytest.raises(SystemExit):
        main(["convert", str(ckpt), "-o", str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert "Expected 2 of '*_optim_states.pt'" in err and "partition is missing" in err
    assert not (tmp_path / "out").exists()


def test_run_folder_skips_incomplete_checkpoints(runs, tmp_path):
    from vlmctl.convert import detect_source

    run = tmp_path / "run"
    shutil.copytree(runs / "fsdp-full", run)
    (run / "checkpoints" / ".tmp-checkpoint-9").mkdir()  # an interrupted save
    (run / "checkpoints" / "checkpoint-7").mkdir()  # no trainer_state.json, no weights
    source = detect_source(run)
    assert source.kind == "dcp" and source.step == STEPS and source.path == run / "checkpoints" / f"checkpoint-{STEPS}"


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
