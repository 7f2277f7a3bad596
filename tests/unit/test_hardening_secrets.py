"""A token typed into the wrong key or option is never echoed in clear by an error."""

from __future__ import annotations

import json

import pytest

from cli_runner import run_cli as run

TOKENS = ["hf_" + "aB3dE5gH7jK9mN1pQ3sT5vW7yZ", "ghp_" + "0123456789abcdefABCDEF0123456789abcd"]


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llava"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


@pytest.mark.parametrize("token", TOKENS)
def test_token_as_repo_id_option_is_hidden(model, capsys, token):
    code, out, err = run(["push", str(model), "--repo-id", token, "--dry-run"], capsys)
    assert code != 0 and token not in out + err and "hidden" in out + err


@pytest.mark.parametrize("token", TOKENS)
def test_token_as_hub_repo_id_override_is_hidden(model, tmp_path, capsys, monkeypatch, token):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\n")
    code, out, err = run(["push", str(model), "--dry-run", f"hub.repo_id={token}"], capsys)
    assert code != 0 and token not in out + err


@pytest.mark.parametrize("token", TOKENS)
def test_token_as_a_model_path_is_hidden(tmp_path, capsys, monkeypatch, token):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\n")
    code, out, err = run(["eval", token, "--data", "val"], capsys)
    assert code != 0 and token not in out + err and "hidden" in out + err
