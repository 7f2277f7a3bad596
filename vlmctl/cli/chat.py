"""`vlmctl chat`: talk to a model in the terminal, with images."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape

from vlmctl.cli._common import ConfigOpt, console, info, load_project, render_error, split_args, state

if TYPE_CHECKING:
    from vlmctl.inference import ChatSession

EXAMPLE = "Example: vlmctl chat outputs/runs/run1/final --system 'Answer in one word.'"

ModelArgs = Annotated[
    Optional[list[str]],
    typer.Argument(help="MODEL folder (a `model build` folder, RUN/final, a `convert` export or a local HF VLM folder; "
                        "default: the project's newest final export, else its built model), then overrides.", show_default=False),
]
TemperatureOpt = Annotated[float, typer.Option("--temperature", help="Sampling temperature; 0 decodes greedily.")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling: keep the smallest set of tokens with this probability.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (a GPU when there is one), cpu, cuda, cuda:N.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bf16 on GPUs that support it, else fp32), bf16, fp16, fp32.")]


def chat(
    args: ModelArgs = None,
    config: ConfigOpt = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt sent before the conversation.")] = None,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="At most this many tokens per reply.")] = 512,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Chat with a model: streamed replies, images (/image PATH, or paths in the message), history until /reset.

    Lines are read from stdin, so a script can be piped in: `printf '/image cat.jpg\\nWhat is this?\\n' | vlmctl chat`.
    """
    from vlmctl.inference import ChatSession, check_model_dir, load_for_generation, resolve_device

    model_dir = resolve_model_dir(args, config, "chat")
    check_model_dir(model_dir)
    device = resolve_device(device)
    with console.status(f"Loading {escape(str(model_dir))} on {device}") if not state.quiet else nullcontext():
        model, processor = load_for_generation(model_dir, device=device, dtype=dtype)
    session = ChatSession(model, processor, system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    info(f"[bold]vlmctl chat[/bold] with {escape(str(model_dir))} ({device}, {str(model.dtype).removeprefix('torch.')}). "
         "[dim]/image PATH attaches an image, /reset clears the history, /help, /exit[/dim]")
    _loop(session, interactive=sys.stdin.isatty())


def resolve_model_dir(args: list[str] | None, config: Path | None, command: str) -> Path:
    """MODEL from the arguments, else the project's model as `vlmctl eval` finds it (newest train.output_dir/*/final,
    else model.output_dir). Raises UsageError for extra positionals, or when there is neither MODEL nor a project."""
    from vlmctl.config import find_config
    from vlmctl.errors import UsageError

    positionals, overrides = split_args(args)
    if len(positionals) > 1:
        raise UsageError(f"unexpected argument {positionals[1]!r}", hint="give at most one MODEL folder, then section.key=value overrides")
    if positionals:
        return Path(positionals[0]).expanduser().resolve()
    if config is None and state.config is None and find_config() is None:
        raise UsageError("no MODEL given, and no vlmctl.yaml here to find the project's model",
                         hint=f"vlmctl {command} PATH (a `model build` folder, RUN/final or a `vlmctl convert` export)")
    from vlmctl.evaluation import default_model_dir

    cfg = load_project(config, overrides)
    return default_model_dir(cfg.train.output_dir, cfg.model.output_dir).expanduser().resolve()


def _loop(session: "ChatSession", interactive: bool) -> None:
    """Read lines until /exit or end of input; a failed turn prints its error and the chat goes on."""
    from vlmctl.errors import VlmctlError
    from vlmctl.inference import parse_input

    while True:
        try:
            line = console.input("[bold cyan]you[/bold cyan] › ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if not interactive:
            if not line:
                return
            if not state.quiet and line.strip():
                console.print(f"[bold cyan]you[/bold cyan] › {escape(line.strip())}", highlight=False)
        try:
            if not _handle(session, parse_input(line)):
                return
        except VlmctlError as exc:
            render_error(exc.title, exc.message, exc.hint)


def _handle(session: "ChatSession", cmd) -> bool:
    """Carry out one parsed line; False ends the chat."""
    from vlmctl.inference import COMMANDS

    if cmd.kind == "exit":
        return False
    if cmd.kind == "reset":
        session.reset()
        info("[dim]history cleared[/dim]")
    elif cmd.kind == "help":
        width = max(map(len, COMMANDS))
        for usage, what in COMMANDS.items():
            console.print(f"  [bold]{escape(f'{usage:<{width}}')}[/bold]  {escape(what)}", highlight=False)
        console.print("  Image paths written in a message are attached too: [bold]photo.jpg what is this?[/bold]", highlight=False)
    elif cmd.kind == "unknown":
        console.print(f"[yellow]unknown command {escape(cmd.command)}[/yellow]; /help lists the commands", highlight=False)
    elif cmd.kind in ("image", "message") and not cmd.text:
        for path in cmd.images:
            session.attach(path)
        if cmd.images:
            names = escape(", ".join(p.name for p in cmd.images))
            info(f"[dim]attached {names} ({len(session.pending)} image(s) for the next message)[/dim]")
    elif cmd.kind in ("image", "message"):
        _reply(session, cmd.text, cmd.images)
    return True


_CONTROL = {c: None for c in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]}


def _printable(text: str) -> str:
    """`text` without control characters other than newline and tab: a model's output must not drive the terminal
    (an escape sequence could move the cursor or retitle the window)."""
    return text.translate(_CONTROL)


def _reply(session: "ChatSession", text: str, images) -> None:
    """Stream one reply to the console; Ctrl-C stops it (the turn is then not kept)."""
    stream = session.stream(text, images)
    try:
        first = next(stream, "")  # errors (an unreadable image) come before any output
        console.print("[bold green]model[/bold green] › ", end="", highlight=False)
        console.out(_printable(first), end="", highlight=False)
        for piece in stream:
            console.out(_printable(piece), end="", highlight=False)
        if not first:
            console.print("[dim](empty reply)[/dim]", end="")
    except KeyboardInterrupt:
        stream.close()
        console.print("\n[yellow]interrupted: this turn is not kept[/yellow]")
        return
    console.print()
