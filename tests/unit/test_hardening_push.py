"""`vlmctl push` publishes only regular files inside the model folder: a link out of it is refused before anything
is read through it, a link inside is uploaded as the file it names and listed as a link."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli_runner import run_cli as run
from vlmctl.config import HubSection
from vlmctl.errors import UsageError
from vlmctl.hub import list_upload_files, plan_upload, push_folder, stage_upload


def safetensors_bytes(total: int = 512, data: int = 400) -> bytes:
    """A valid safetensors file of `total` bytes: one uint8 tensor of `data` zeros (push refuses a damaged one)."""
    head = json.dumps({"w": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}}).encode()
    head += b" " * (total - 8 - data - len(head))
    return len(head).to_bytes(8, "little") + head + b"\0" * data


WEIGHTS = safetensors_bytes()


@pytest.fixture
def model(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llava"}))
    (folder / "model.safetensors").write_bytes(WEIGHTS)
    return folder


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "home" / ".ssh" / "id_rsa"
    path.parent.mkdir(parents=True)
    path.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret-key-material\n")
    return path


@pytest.mark.parametrize("where", ["notes.txt", "sub/notes.txt", "README.md"])
def test_a_link_out_of_the_folder_is_refused(model, secret, where):
    link = model / where
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(secret)
    with pytest.raises(UsageError) as err:
        push_folder(model, hub=HubSection(), repo_id="alice/m", dry_run=True)
    assert where in err.value.message and "out of the folder" in err.value.message and str(secret) in err.value.message
    assert "secret-key-material" not in err.value.message + (err.value.hint or "")


def test_a_linked_folder_out_of_the_model_is_refused(model, secret):
    (model / "extra").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(UsageError, match="extra ->"):
        list_upload_files(model)


def test_dangling_links_and_fifos_are_refused(model, tmp_path):
    (model / "gone.bin").symlink_to(tmp_path / "nowhere")
    os.mkfifo(model / "pipe")
    with pytest.raises(UsageError) as err:
        list_upload_files(model)
    assert "gone.bin" in err.value.message and "pipe (not a regular file)" in err.value.message


def test_cli_dry_run_refuses_and_shows_no_secret(model, secret, capsys):
    (model / "notes.txt").symlink_to(secret)
    code, out, err = run(["push", str(model), "--repo-id", "alice/m", "--dry-run"], capsys)
    assert code == 2 and "notes.txt" in out + err and "secret-key-material" not in out + err


def test_a_link_inside_the_folder_is_uploaded_as_its_file_and_listed_as_a_link(model, tmp_path, capsys):
    (model / "weights-alias.safetensors").symlink_to("model.safetensors")
    files = {f.path: f for f in list_upload_files(model)}
    assert files["weights-alias.safetensors"].link_to == "model.safetensors" and files["weights-alias.safetensors"].size == 512
    assert files["model.safetensors"].link_to is None
    stage = tmp_path / "stage"
    stage.mkdir()
    stage_upload(plan_upload(model, None), stage)
    assert (stage / "weights-alias.safetensors").read_bytes() == WEIGHTS
    code, out, err = run(["push", str(model), "--repo-id", "alice/m", "--dry-run"], capsys)
    assert code == 0, err
    assert "weights-alias.safetensors (link to model.safetensors)" in out


def test_a_file_replaced_by_a_link_after_listing_is_not_staged(model, secret, tmp_path):
    contents = plan_upload(model, None)
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to(secret)
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(UsageError, match="changed while the upload was prepared"):
        stage_upload(contents, stage)
    assert not (stage / "model.safetensors").exists()
