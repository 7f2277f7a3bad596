"""The best checkpoint and the final export under faults, without a training run: rotation by `save_total_limit`
after a run resumed from an earlier checkpoint, a kill while a checkpoint of the same step is replaced, a disk
filling during the export, and the resume hint that keeps the run's command-line settings."""

from __future__ import annotations

import errno
import json
import os
import shlex
from pathlib import Path

import pytest
import torch

from vlmctl.checkpoints import CheckpointError
from vlmctl.distributed.engine import TorchEngine
from vlmctl.train import checkpoint as ckpt


def engine() -> TorchEngine:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return TorchEngine(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), max_grad_norm=0.0)


def save(run: Path, step: int, *, limit: int | None = None, best: int | None = None) -> Path:
    state = {"step": step, "consumed_micro_batches": step, "best": {"step": best, "save_best": True} if best else None}
    return ckpt.save(run, step, state, rank=0, engine=engine(), total_limit=limit, keep=best)


def steps(run: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in ckpt.complete_checkpoints(run)]


def test_rotation_keeps_the_best_and_the_checkpoint_just_saved_after_a_resume_from_an_earlier_one(tmp_path):
    """A run saved 2, 4 (its best), 6 and 8, then was resumed from checkpoint-4: its next save (step 5) is the
    latest, whatever steps the abandoned continuation left; `--resume` then continues from it."""
    for step in (2, 4, 6, 8):
        save(tmp_path, step, best=4)
    saved = save(tmp_path, 5, limit=1, best=4)
    assert saved.is_dir() and steps(tmp_path) == [4, 5]
    assert ckpt.resolve_resume(tmp_path, "auto") == saved
    saved = save(tmp_path, 7, limit=2, best=4)  # the best does not count against the limit; the newest before 7 stays
    assert steps(tmp_path) == [4, 5, 7]
    save(tmp_path, 9, limit=1, best=9)  # a new best: the old one goes, the new one is the latest
    assert steps(tmp_path) == [9]


def test_a_kill_while_a_checkpoint_of_the_same_step_is_replaced_leaves_one_that_resumes(tmp_path, monkeypatch):
    from vlmctl.train.rundir import sweep_temporaries

    old = save(tmp_path, 4, best=4)
    before = json.loads((old / ckpt.STATE_FILE).read_text())
    real = os.replace

    def killed(src, dst):  # the process dies as the new folder is renamed into place
        if Path(src).name == ".tmp-checkpoint-4":
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 4, best=4)
    monkeypatch.undo()
    sweep_temporaries(tmp_path)  # what the next `vlmctl train --resume` does first
    assert steps(tmp_path) == [4] and json.loads((old / ckpt.STATE_FILE).read_text()) == before
    assert ckpt.resolve_resume(tmp_path, "auto") == old
    assert not [p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir() if p.name.startswith(".")]
    saved = save(tmp_path, 4, best=4)  # the same save again, undisturbed: replaced, nothing left aside
    assert steps(tmp_path) == [4] and sorted(p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir()) == ["checkpoint-4"]
    assert saved == old


def test_a_full_disk_during_a_best_save_keeps_the_previous_best_and_names_the_resume_command(tmp_path, monkeypatch):
    run = tmp_path / "run-7"
    run.mkdir()
    ckpt.record_command(run, ["-c", "my project.yaml", "--launcher", "none", "train.learning_rate=1e-4",
                              "train.run_name=run-7", "train.save_best=val_loss", "train.resume=auto"])
    first = save(run, 2, limit=1, best=2)
    real_save = torch.save

    def full(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(getattr(f, "name", f)))

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError) as caught:
        save(run, 4, limit=1, best=4)
    monkeypatch.setattr(torch, "save", real_save)
    assert steps(run) == [2] and first.is_dir() and "previous checkpoint is intact" in caught.value.message
    command = caught.value.hint.split("`")[1]
    assert shlex.split(command) == ["vlmctl", "train", "-c", "my project.yaml", "--launcher", "none", "train.learning_rate=1e-4",
                                    "train.save_best=val_loss", "--resume", "train.run_name=run-7"]


def test_the_resume_command_without_a_record_and_with_a_token_shaped_value(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    assert ckpt.resume_command(run) == "vlmctl train --resume train.run_name=r"
    (run / ckpt.COMMAND_FILE).write_text("[not an object")
    assert ckpt.resume_command(run) == "vlmctl train --resume train.run_name=r"
    ckpt.record_command(run, ["hub.repo_id=hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"])
    assert "hf_AbCd" not in ckpt.resume_command(run) and "<hidden:" in ckpt.resume_command(run)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model, load_model

    folder = tmp_path_factory.mktemp("export") / "tiny"
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder, dtype="fp32"), tokenizer_texts=["red blue"] * 20)
    model, processor, _ = load_model(folder, dtype="fp32")
    return model, processor


@pytest.mark.parametrize("failure", ["safetensors", "oserror"])
def test_a_full_disk_during_the_final_export_is_one_message_and_leaves_no_half_export(tmp_path, monkeypatch, tiny, failure):
    import safetensors
    import transformers.modeling_utils as modeling_utils

    from vlmctl.train import export

    run = tmp_path / "run-3"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")  # an earlier export: kept until the new one is whole
    ckpt.record_command(run, ["--launcher", "none", "train.max_steps=20"])
    real = modeling_utils.safe_save_file

    def disk_fills(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\0" * 100)  # half a file, then the disk is full
        if failure == "safetensors":
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(modeling_utils, "safe_save_file", disk_fills)
    monkeypatch.setattr(export, "_load_trained", lambda *a, **k: tiny)
    with pytest.raises(CheckpointError) as caught:
        export._write_final(run, None, {}, source="unused", lora=None, parts_trainable=set(), out_dtype=torch.float32)
    monkeypatch.setattr(modeling_utils, "safe_save_file", real)
    message = caught.value.message
    assert message.startswith("disk full while writing") and "final export is not written" in message
    assert "checkpoints are intact" in message and "\n" not in message
    assert "vlmctl train --launcher none train.max_steps=20 --resume train.run_name=run-3" in caught.value.hint
    assert not (run / ".tmp-final").exists() and json.loads((run / "final" / "config.json").read_text()) == {}


def test_another_export_failure_is_not_taken_for_a_full_disk(tmp_path, monkeypatch, tiny):
    import transformers.modeling_utils as modeling_utils

    from vlmctl.train import export

    def broken(tensors, filename, *args, **kwargs):
        raise ValueError("a tensor of another dtype")

    monkeypatch.setattr(modeling_utils, "safe_save_file", broken)
    monkeypatch.setattr(export, "_load_trained", lambda *a, **k: tiny)
    with pytest.raises(ValueError, match="another dtype"):
        export._write_final(tmp_path, None, {}, source="unused", lora=None, parts_trainable=set(), out_dtype=torch.float32)
    assert not (tmp_path / ".tmp-final").exists()
