"""The root `vlmctl` command: registers every command module and renders errors as one panel."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated, Any, Optional

import typer

from vlmctl import __version__
from vlmctl.cli import _common
from vlmctl.cli._common import render_error, state

# vlmctl.config (its pydantic models) is imported only where an unknown option is reported and vlmctl.errors where
# an error is rendered: `--help`, or a command that succeeds, does not load them through this module.

HELP_OPTIONS = ("-h", "--help")

app = typer.Typer(
    name="vlmctl",
    help="Build, train and ship vision-language models from one project file (vlmctl.yaml).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": list(HELP_OPTIONS)},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vlmctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")] = None,
    debug: _common.DebugOpt = False,
    quiet: _common.QuietOpt = False,
    verbose: _common.VerboseOpt = False,
    config: _common.ConfigOpt = None,
) -> None:
    """Build, train and ship vision-language models from one project file (vlmctl.yaml)."""
    state.reset()
    state.config = config
    state.set_flags(debug=debug, quiet=quiet, verbose=verbose)


def _register() -> None:
    # Command modules import only typer/rich at module level; heavy work is imported inside the commands.
    from vlmctl.cli import bench, chat, config, convert, data, demo, evaluate, generate, init, model, push, serve, train

    app.command("init", epilog=init.EXAMPLE)(init.init)
    app.add_typer(data.app, name="data")
    app.add_typer(model.app, name="model")
    app.command("train", epilog=train.EXAMPLE, context_settings={"allow_extra_args": False})(train.train)
    app.command("convert", epilog=convert.EXAMPLE)(convert.convert)
    app.command("push", epilog=push.EXAMPLE)(push.push)
    app.command("eval", epilog=evaluate.EXAMPLE)(evaluate.eval_cmd)
    app.command("chat", epilog=chat.EXAMPLE)(chat.chat)
    app.command("generate", epilog=generate.EXAMPLE)(generate.generate_cmd)
    app.command("serve", epilog=serve.EXAMPLE)(serve.serve_cmd)
    app.command("bench", epilog=bench.EXAMPLE)(bench.bench)
    app.command("demo", epilog=demo.EXAMPLE)(demo.demo)
    app.add_typer(config.app, name="config")
    _common.add_global_flags(app)


_register()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app; VlmctlError -> red panel + its exit code; other errors -> exit 1."""
    from vlmctl.errors import VlmctlError

    # before anything starts CUDA (it reads the variable then): see vlmctl.distributed.env.configure_cuda_allocator
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = sys.argv[1:] if argv is None else list(argv)
    command = _common.command_of(app, HELP_OPTIONS)  # built once: the option check below and the run share it
    config_key = _option_as_config_key(args, command)
    if config_key is not None:  # `--epochs 2`: not an option, but a config key would do it
        render_error("Usage error", *config_key)
        sys.exit(2)
    try:
        command(args=args, prog_name="vlmctl", standalone_mode=True)
    except SystemExit:
        raise
    except VlmctlError as exc:
        if state.debug:
            traceback.print_exc()
        render_error(exc.title, exc.message, exc.hint)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, _common.Interrupted):
        render_error("Interrupted", "stopped by the user", None)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the one place that turns crashes into a readable panel
        if state.debug:
            traceback.print_exc()
        render_error(
            "Runtime error",
            f"{type(exc).__name__}: {exc}",
            "run again with --debug (or VLMCTL_DEBUG=1) for the full traceback",
        )
        sys.exit(1)


def _option_as_config_key(argv: list[str], command: Any = None) -> tuple[str, str] | None:
    """(message, hint) for the first `--name` in `argv` that the command does not take but that names a config key
    (`suggest_key`: `--epochs 2` -> `train.num_epochs=2`), else None (click reports other unknown options).

    The config models (pydantic, every section) are imported only when such an unknown `--name` is there: `--help`
    and every well-formed command line do not pay for them."""
    command = command if command is not None else _common.command_of(app, HELP_OPTIONS)
    known: set[str] = set()
    for i, arg in enumerate(argv):
        if arg in getattr(command, "commands", {}):  # a group (typer's own, not always click's class)
            command = command.commands[arg]
        known |= {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | set(HELP_OPTIONS)
        name, eq, value = arg.partition("=")
        if not name.startswith("--") or name in known or name == "--":
            continue
        from vlmctl.config import suggest_key

        key = suggest_key(name[2:])
        if key is None or "." not in key:
            return None
        value = value if eq else (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else "VALUE")
        return f"no such option: {name}", f"set the config key as an override instead: {key}={value}"
    return None


__all__ = ["app", "main", "_common"]
