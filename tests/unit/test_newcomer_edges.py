"""What a new user meets first, each pinned by a test: help, refusals, defaults and messages of the commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli


def _flat(text: str) -> str:
    """Console text with table borders and line wrapping removed (words joined by single spaces)."""
    for ch in "│┃║╭╮╰╯─":
        text = text.replace(ch, " ")
    return " ".join(text.split())


# --------------------------------------------------------------------------------------------- --help: start-up


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["data", "validate", "-h"], ["train", "--resume", "-h"]])
def test_help_and_known_options_do_not_load_the_config_models(args):
    """The config models (every section) load only to name the config key of an unknown --option."""
    code = (
        "import sys\n"
        "from vlmctl.cli.app import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        "print('LOADED', [m for m in ('vlmctl.config',) if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "LOADED []" in out, out


def test_help_shows_no_value_type_beside_a_flag(capsys):
    code, out, _ = run_cli(["train", "--help"], capsys)
    assert code == 0
    assert "<bool>" not in out and "<int>" in out  # --nnodes takes a number; --resume, --dry-run, --help take none
    code, out, _ = run_cli(["convert", "--help"], capsys)
    assert "<bool>" not in out and "--no-merge-lora" in out
