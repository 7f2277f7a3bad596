"""Typed errors that the CLI renders as one panel with a hint.

Library code raises these for bad input; the CLI maps them to exit codes (2: usage/config, 1: runtime). `render`
prints one as that panel on stderr: the CLI does, and so do rank processes (`python -m vlmctl.train.worker`),
which run without the CLI.
"""

from __future__ import annotations

# rich is imported inside the functions that print: using vlmctl as a library does not load it.


class VlmctlError(Exception):
    """A failure the user can act on. `hint` says how to fix it; `exit_code` is what the CLI returns."""

    exit_code = 1
    title = "Error"

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class ConfigError(VlmctlError):
    """The project file or an override is invalid (exit code 2)."""

    exit_code = 2
    title = "Config error"


class UsageError(VlmctlError):
    """The command line is invalid (exit code 2)."""

    exit_code = 2
    title = "Usage error"


class DataError(VlmctlError):
    """Input data cannot be read (exit code 1)."""

    title = "Data error"


class MissingSourceError(DataError):
    """A data source named in the project file or on the command line does not exist: a wrong path, so exit code 2
    as for configuration and usage errors (still a DataError to code that catches those)."""

    exit_code = 2


class ModelError(VlmctlError):
    """A model cannot be built or loaded (exit code 1)."""

    title = "Model error"


class MissingModelError(ModelError):
    """The model folder a command was given (or defaults to) does not exist: a wrong path, so exit code 2 as for
    usage errors, the same in chat, eval, generate, convert and push (still a ModelError to code that catches those)."""

    exit_code = 2


def panel(title: str, message: str, hint: str | None):
    """The rich panel of an error: `message`, then the hint after "Fix:"."""
    from rich.markup import escape
    from rich.panel import Panel

    # plain text: `vlmctl[tracking]` or a path with brackets must not be read as rich markup
    body = escape(message) if not hint else f"{escape(message)}\n\n[bold]Fix:[/bold] {escape(hint)}"
    return Panel(body, title=f"[bold]{title}[/bold]", title_align="left", border_style="red")


def render(exc: VlmctlError, console=None) -> None:
    """Print `exc` as its panel on `console` (default: a rich console on stderr)."""
    if console is None:
        from rich.console import Console

        console = Console(stderr=True, highlight=False)
    console.print(panel(exc.title, exc.message, exc.hint))
