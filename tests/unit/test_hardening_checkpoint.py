"""A full disk while a training checkpoint is written is one message with the free space and the size a
checkpoint takes; the previous checkpoint stays intact and no temporary folder is left."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch

from vlmctl.checkpoints import CheckpointError
from vlmctl.distributed.engine import TorchEngine
from vlmctl.train import checkpoint as ckpt


def parts():
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer, scheduler = parts()
    first = ckpt.save(tmp_path, 1, {"step": 1, "consumed_micro_batches": 1}, rank=0, engine=TorchEngine(model, optimizer, scheduler, max_grad_norm=0.0))
    before = files_of(first)
    size = sum(len(b) for b in before.values())

    real_open = builtins.open

    def full_disk_open(file, mode="r", *args, **kwargs):  # the RNG file lands on a full disk
        if "w" in mode and Path(str(file)).name.startswith("rng-"):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk_open)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(tmp_path, 2, {"step": 2, "consumed_micro_batches": 2}, rank=0, engine=TorchEngine(model, optimizer, scheduler, max_grad_norm=0.0))
    monkeypatch.undo()
    message = err.value.message
    assert message.startswith("disk full while writing") and "free on that filesystem" in message
    assert f"a checkpoint of this run takes {ckpt.human_bytes(size)}" in message and "previous checkpoint is intact" in message
    assert "--resume" in err.value.hint and "\n" not in message
    assert files_of(first) == before
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-1"]  # no .tmp-checkpoint-2


def test_a_zip_writer_runtime_error_on_a_full_disk_reads_as_disk_full(tmp_path, monkeypatch):
    where = tmp_path / "checkpoints" / ".tmp-checkpoint-3"
    where.mkdir(parents=True)

    def deepspeed_style_save():  # torch.save to a path: the zip writer's RuntimeError, no errno
        torch.save({"w": torch.zeros(4096)}, "/dev/full")

    monkeypatch.setattr(ckpt, "free_space", lambda path: 1024)
    message, hint = ckpt._attempt(deepspeed_style_save, where)
    assert message.startswith("disk full while writing") and "1.0 KiB free" in message
    # space left by the time it is looked at (another process freed some): still this write's error, said as such
    monkeypatch.setattr(ckpt, "free_space", lambda path: 10 << 30)
    message, hint = ckpt._attempt(deepspeed_style_save, where)
    assert "only in part" in message and "10.0 GiB are free" in message and "--resume" in hint
    with pytest.raises(RuntimeError, match="not a write"):  # any other RuntimeError is not taken for one
        ckpt._attempt(lambda: (_ for _ in ()).throw(RuntimeError("not a write")), where)


def test_dcp_shards_written_in_part_read_as_a_checkpoint_error_not_a_traceback(tmp_path, monkeypatch):
    """DCP gathers each rank's failure into a CheckpointException; a shard its zip writer could not finish (a full
    disk: "unexpected pos") is the same checkpoint error as a full disk elsewhere, whatever the free space says."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    where = tmp_path / "checkpoints" / ".tmp-checkpoint-3"
    where.mkdir(parents=True)

    def dcp_save():
        try:
            torch.save({"w": torch.zeros(4096)}, "/dev/full")
        except RuntimeError as exc:
            raise CheckpointException("write_data", {0: _wrap_exception(exc)}) from None

    monkeypatch.setattr(ckpt, "free_space", lambda path: 1024)
    assert ckpt._attempt(dcp_save, where)[0].startswith("disk full while writing")
    monkeypatch.setattr(ckpt, "free_space", lambda path: 6 << 30)
    assert "only in part" in ckpt._attempt(dcp_save, where)[0]

    def other_failure():
        raise CheckpointException("write_data", {0: _wrap_exception(ValueError("a bad tensor"))})

    with pytest.raises(CheckpointException):
        ckpt._attempt(other_failure, where)


def test_trainer_state_of_a_saved_checkpoint_reads_back(tmp_path):
    model, optimizer, scheduler = parts()
    saved = ckpt.save(tmp_path, 4, {"step": 4, "consumed_micro_batches": 4}, rank=0, engine=TorchEngine(model, optimizer, scheduler, max_grad_norm=0.0))
    assert json.loads((saved / ckpt.STATE_FILE).read_text())["step"] == 4 and (saved / "rng-0.pt").stat().st_size > 0
