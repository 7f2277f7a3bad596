"""Shared CLI pieces: global state, option aliases, config loading, rendering of results and errors.

Only light modules are imported here (typer, rich): `vlmctl --help` must not import torch.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer
from rich.console import Console

if TYPE_CHECKING:
    from vlmctl.config import VlmctlConfig

# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.


def _debug_env() -> bool:
    return os.environ.get("VLMCTL_DEBUG", "") not in ("", "0", "false")


@dataclass
class State:
    debug: bool = False
    quiet: bool = False
    verbose: bool = False
    config: Path | None = None  # -c given before the command: `vlmctl -c x.yaml train`

    def reset(self) -> None:
        """Back to the defaults (VLMCTL_DEBUG read again): each invocation starts from them."""
        self.debug, self.quiet, self.verbose, self.config = _debug_env(), False, False, None

    def set_flags(self, *, debug: bool = False, quiet: bool = False, verbose: bool = False) -> None:
        """Turn on the global flags given (before or after the command name); a flag is never turned off here."""
        self.debug = self.debug or debug
        self.quiet = self.quiet or quiet
        self.verbose = self.verbose or verbose


state = State(debug=_debug_env())
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
GLOBAL_PANEL = "Global options"  # where --help lists the global flags

ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="Project file (default: vlmctl.yaml here or in the nearest parent).", show_default=False),
]
OverridesArg = Annotated[
    Optional[list[str]],
    typer.Argument(help="Dotted overrides section.key=value, e.g. train.max_steps=50.", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON (for scripts).")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks (also VLMCTL_DEBUG=1).", rich_help_panel=GLOBAL_PANEL)]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print only results and errors.", rich_help_panel=GLOBAL_PANEL)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Print more detail.", rich_help_panel=GLOBAL_PANEL)]
GLOBAL_FLAGS = {"debug": DebugOpt, "quiet": QuietOpt, "verbose": VerboseOpt}
"""The flags every command accepts before or after its name (`vlmctl -q data validate` = `vlmctl data validate -q`)."""


class Interrupted(Exception):
    """Ctrl-C inside a command (exit code 130): raised in place of KeyboardInterrupt so `app.main` reports it."""


def add_global_flags(app: typer.Typer) -> None:
    """Give every command of `app` (and of its sub-apps) the global flags, so they also work after the command name.

    Each command's callback is wrapped: the wrapper's signature is the command's plus `GLOBAL_FLAGS` (those it does not
    define itself); it records them in `state` and calls the command without them.
    """
    for info in app.registered_commands:
        if info.callback is not None:
            info.help = _paragraphs(info.help or info.callback.__doc__)
            info.callback = _with_global_flags(info.callback)
    for group in app.registered_groups:
        sub = group.typer_instance
        if sub is None:
            continue
        if sub.registered_callback is None:  # `vlmctl data -q validate`: the flags between group and command too
            sub.callback()(_group_flags)
        add_global_flags(sub)


def _paragraphs(doc: str | None) -> str | None:
    """A command's docstring as --help shows it: paragraphs apart, each one line (the terminal wraps it). Typer
    joins the lines of the first paragraph only."""
    import inspect

    if not doc:
        return doc
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


def _group_flags(debug: DebugOpt = False, quiet: QuietOpt = False, verbose: VerboseOpt = False) -> None:
    state.set_flags(debug=debug, quiet=quiet, verbose=verbose)


def _with_global_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    import functools
    import inspect

    if getattr(fn, "__vlmctl_global_flags__", False):
        return fn
    sig = inspect.signature(fn, eval_str=True)
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=annotation)
             for name, annotation in GLOBAL_FLAGS.items() if name not in sig.parameters]
    names = [p.name for p in extra]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state.set_flags(**{name: bool(kwargs.pop(name, False)) for name in names})
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted() from None  # typer would exit 130 without a word; `app.main` says why

    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])  # type: ignore[attr-defined]
    wrapper.__vlmctl_global_flags__ = True  # type: ignore[attr-defined]
    return wrapper


def command_of(app: typer.Typer, help_options: tuple[str, ...] = ()) -> Any:
    """The click command typer builds for `app`, its flags (and the help option named `help_options`) listed in
    --help without a value type: a flag takes no value, and `<bool>` beside it reads as if it did."""
    command = typer.main.get_command(app)
    _untyped_flags(command, help_options)
    return command


def _untyped_flags(command: Any, help_options: tuple[str, ...]) -> None:
    if help_options and hasattr(command, "get_help_option"):  # made on first use; typer keeps it from then on
        option = command.get_help_option(command.context_class(command, help_option_names=list(help_options)))
        params = [*command.params, *([option] if option is not None else [])]
    else:
        params = list(command.params)
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _untyped_flags(sub, help_options)


def is_override(arg: str) -> bool:
    """True for `section.key=value` arguments (a dot before the first '=')."""
    key, sep, _ = arg.partition("=")
    return bool(sep) and "." in key and "/" not in key


def split_args(args: list[str] | None) -> tuple[list[str], list[str]]:
    """Split a command's trailing arguments into (positionals, overrides)."""
    positionals, overrides = [], []
    for arg in args or []:
        (overrides if is_override(arg) else positionals).append(arg)
    return positionals, overrides


def load_project(config: Path | None, overrides: list[str] | None) -> "VlmctlConfig":
    """Load the project file (discovered when `config` is None) with overrides applied."""
    from vlmctl.config import load_config

    bad = [o for o in overrides or [] if not is_override(o)]
    if bad:
        from vlmctl.errors import UsageError

        raise UsageError(f"unexpected argument {bad[0]!r}", hint="overrides look like section.key=value, e.g. train.max_steps=50")
    return load_config(config or state.config, overrides or [])


def esc(value: Any) -> str:
    """`value` as text that rich prints as it is: a user's path, file name, id or sample text may hold `[...]`,
    which rich would read as markup (`[red]2.jpg` styled, `[/x]` a MarkupError)."""
    from rich.markup import escape

    return escape(str(value))


def info(message: str) -> None:
    """Print unless --quiet."""
    if not state.quiet:
        console.print(message)


def result_line(message: str) -> None:
    """Print a command's result line: also with --quiet, which keeps only results and errors."""
    console.print(message)


def debug(message: str) -> None:
    """Print only with --verbose."""
    if state.verbose:
        console.print(f"[dim]{message}[/dim]")


def print_json(data: Any) -> None:
    """Machine-readable output on stdout (no rich markup)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def render_error(title: str, message: str, hint: str | None) -> None:
    """Print an error panel; a value shaped like an access token is shown as `<hidden: N characters>` (a token typed
    into `--repo-id` or `model.base` must not reach a terminal log)."""
    from vlmctl.config import mask_secrets
    from vlmctl.errors import panel

    err_console.print(panel(title, mask_secrets(message), mask_secrets(hint) if hint else hint))
