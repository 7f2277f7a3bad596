"""The checkpoint writer bounds the bytes a rank stages per file (`vlmctl.checkpoints.dcp_writer`)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from vlmctl.checkpoints import dcp_load, dcp_writer


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(256, 256) for i in range(6)},  # 256 KiB each
            "optim": {"step": torch.tensor(3.0), "note": "kept as bytes"}}


def test_a_rank_writes_files_of_at_most_the_bound_and_reads_back_equal(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=dcp_writer(tmp_path, file_bytes=600 * 1024), no_dist=True)
    files = sorted(tmp_path.glob("*.distcp"))
    assert len(files) == 3  # six 256 KiB tensors, two per 600 KiB file; the small items join the last file
    assert all(f.stat().st_size < 700 * 1024 for f in files)
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
              "optim": {"step": torch.tensor(0.0), "note": ""}}
    dcp_load(loaded, tmp_path, no_dist=True)
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)
    assert loaded["optim"]["step"].item() == 3.0 and loaded["optim"]["note"] == "kept as bytes"


def test_an_item_larger_than_the_bound_gets_a_file_of_its_own(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=dcp_writer(tmp_path, file_bytes=1024), no_dist=True)
    # each 256 KiB tensor alone, the scalar step and the bytes item together in a seventh
    assert len(list(tmp_path.glob("*.distcp"))) == 7
