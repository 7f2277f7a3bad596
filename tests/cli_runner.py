"""Run the vlmctl CLI in-process for tests."""

from __future__ import annotations

from vlmctl.cli.app import main


def run_cli(args: list[str], capture) -> tuple[int, str, str]:
    """Run `vlmctl ARGS` in this process; `capture` is pytest's capsys or capfd. Returns (exit code, stdout, stderr)."""
    code = 0
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out = capture.readouterr()
    return code, out.out, out.err
