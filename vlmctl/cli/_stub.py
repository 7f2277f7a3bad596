"""Placeholder for commands whose capability has not landed yet."""

from __future__ import annotations

from vlmctl.errors import NotImplementedYet


def not_implemented(command: str) -> None:
    raise NotImplementedYet(f"`vlmctl {command}` is not implemented yet", hint="see `vlmctl --help` for the commands available now")
