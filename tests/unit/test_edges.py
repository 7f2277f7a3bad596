"""Rough edges a new user hit, each pinned by a test: output, refusals and messages of the commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import run_cli


def _flat(text: str) -> str:
    """Console text with table borders and line wrapping removed (words joined by single spaces)."""
    for ch in "│┃║":
        text = text.replace(ch, " ")
    return " ".join(text.split())


def _llava_project(root: Path, rows: list[dict]) -> Path:
    (root / "d.json").write_text(json.dumps(rows))
    (root / "vlmctl.yaml").write_text("project: {name: v}\ndata:\n  sources:\n    - {path: d.json, format: llava}\n"
                                      "  num_proc: 1\n")
    return root


def _turns(question: str = "<image>\nWhat color?") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": "red"}]


# ------------------------------------------------------------------------------- 1: rich markup in user values


def test_validate_prints_paths_and_text_with_brackets_as_they_are(tmp_path, capsys, monkeypatch):
    _llava_project(tmp_path, [{"id": "a", "image": "[red]2.jpg", "conversations": _turns()},
                              {"id": "b", "image": "/abs/[/x]3.jpg", "conversations": _turns()}])
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["data", "validate"], capsys)
    text = out + err
    assert code == 1, text  # samples rejected, not a crash
    assert "MarkupError" not in text and "[red]2.jpg" in text and "[/x]3.jpg" in text
