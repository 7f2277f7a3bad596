"""`vlmctl chat`: talk to a model in the terminal, with images (videos for video models, audio clips for audio
models)."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape

from vlmctl.cli._common import ConfigOpt, console, err_console, info, load_project, render_error, split_args, state

if TYPE_CHECKING:
    from vlmctl.inference import ChatSession

# The vlmctl modules that load numpy when imported are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for it.
# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.

EXAMPLE = "Example: vlmctl chat outputs/runs/run1/final --system 'Answer in one word.'"

ModelArgs = Annotated[
    Optional[list[str]],
    typer.Argument(help="MODEL folder (a `model build` folder, RUN/final, a `convert` export or a local HF VLM folder; "
                        "default: the best checkpoint of the project's longest-trained run, else that run's final "
                        "export, else the built model; the choice is printed), then overrides.", show_default=False),
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
    audio: Annotated[Optional[list[Path]], typer.Option("--audio", help="Audio file for the first message (repeatable; "
                                                        "audio models such as qwen2_audio). /audio PATH attaches more.",
                                                        show_default=False)] = None,
    video: Annotated[Optional[list[Path]], typer.Option("--video", help="Video file for the first message (repeatable; "
                                                        "video models such as qwen2_5_vl, llava_onevision; frames sampled "
                                                        "by the project's data.video). /video PATH attaches more.",
                                                        show_default=False)] = None,
) -> None:
    """Chat with a model: streamed replies, images (/image PATH, or paths in the message), videos for video models
    (--video FILE, /video PATH) or clips for audio models (--audio FILE, /audio PATH), history until /reset.

    Lines are read from stdin, so a script can be piped in: `printf '/image cat.jpg\\nWhat is this?\\n' | vlmctl chat`.
    """
    from vlmctl.inference import ChatSession, check_model_dir, folder_family, load_for_generation, resolve_device
    from vlmctl.inference.chat import read_audio, read_video
    from vlmctl.inference.prompt import check_modality

    model_dir = resolve_model_dir(args, config, "chat")
    check_model_dir(model_dir)
    family = folder_family(model_dir)
    if audio:  # before loading the model: a family without audio is a usage error, a bad file a data error
        check_modality("audio", family, "--audio")
        for path in audio:
            read_audio(path)
    if video:
        check_modality("video", family, "--video")
    settings = _video_settings(model_dir, family, config, args)
    clips = [read_video(path, settings) for path in video or ()]  # sampled once, before the model loads
    device = resolve_device(device)
    with console.status(f"Loading {escape(str(model_dir))} on {device}") if not state.quiet else nullcontext():
        model, processor = load_for_generation(model_dir, device=device, dtype=dtype)
    session = ChatSession(model, processor, system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                          family=family, video=settings)
    for path in audio or ():
        session.attach_audio(path)  # read again: the model's window is known now
    for clip in clips:
        session.attach_video(clip)
    info(f"[bold]vlmctl chat[/bold] with {escape(str(model_dir))} ({device}, {str(model.dtype).removeprefix('torch.')}). "
         f"[dim]{_attach_help(session.family)}, /reset clears the history, /help, /exit[/dim]")
    if audio:
        info(f"[dim]attached {escape(', '.join(p.name for p in audio))} ({len(session.pending_audios)} clip(s) for the first message)[/dim]")
    if video:
        info(f"[dim]attached {escape(', '.join(p.name for p in video))} ({len(session.pending_videos)} video(s) for the first message)[/dim]")
    _loop(session, interactive=sys.stdin.isatty())


def _video_settings(model_dir: Path, family, config: Path | None, args: list[str] | None):
    """The `data.video` settings videos are sampled by (`vlmctl.inference.video_settings`): the project's inside
    one, else the model's training run's, else the defaults; None for a family that takes no video (the project
    is then not read)."""
    from vlmctl.config import find_config
    from vlmctl.data.modalities import get_unit
    from vlmctl.inference import video_settings

    if family is None or not get_unit("video").accepted_by(family):
        return None
    in_project = config is not None or state.config is not None or find_config() is not None
    return video_settings(model_dir, load_project(config, split_args(args)[1]).data if in_project else None)


def _attach_help(family) -> str:
    """How to attach the media the family takes (images when unknown)."""
    takes = list(getattr(family, "modalities", None) or ["image"])
    what = {"audio": "an audio clip", "image": "an image", "video": "a video"}
    parts = [f"/{kind} PATH attaches {what[kind]}" for kind in ("image", "video", "audio") if kind in takes]
    return ", ".join(parts) or "text only"


def resolve_model_dir(args: list[str] | None, config: Path | None, command: str) -> Path:
    """MODEL from the arguments, else the project's model (`project_model_dir`). Raises UsageError for extra
    positionals, or when there is neither MODEL nor a project."""
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
    cfg = load_project(config, overrides)
    return project_model_dir(cfg.train.output_dir, cfg.model.output_dir)


def project_model_dir(train_output_dir: Path, model_output_dir: Path) -> Path:
    """The model chat, generate, eval and serve use when none is given (`vlmctl.runs.project_model`: the best
    checkpoint of the longest-trained run, else its final export, else the built model), said on stderr. A best
    checkpoint not exported yet is exported first, where `vlmctl convert CHECKPOINT` puts it (RUN/export-<step>).
    Raises UsageError when that export would run in several processes at once."""
    import os

    from vlmctl.runs import project_model

    choice = project_model(train_output_dir, model_output_dir)
    if not state.quiet:
        err_console.print(f"[dim]using {escape(choice.reason)}; pass MODEL for another[/dim]", soft_wrap=True)
    if choice.export_from is not None:
        from vlmctl.errors import UsageError

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError(f"the best checkpoint {choice.export_from} is not exported yet",
                             hint=f"export it once first: `vlmctl convert {choice.export_from} -o {choice.path}`")
        from vlmctl.convert import convert

        with err_console.status(f"exporting the best checkpoint to {escape(str(choice.path))}") if not state.quiet else nullcontext():
            convert(choice.export_from, choice.path)
        if not state.quiet:
            err_console.print(f"[dim]exported {escape(str(choice.export_from))} -> {escape(str(choice.path))}[/dim]", soft_wrap=True)
    return choice.path.expanduser().resolve()


def _loop(session: "ChatSession", interactive: bool) -> None:
    """Read lines until /exit or end of input; a failed turn prints its error and the chat goes on."""
    from vlmctl.errors import VlmctlError
    from vlmctl.inference import parse_input

    while True:
        try:
            line = console.input("[bold cyan]you[/bold cyan] › ") if interactive else sys.stdin.readline()
        except EOFError:  # end of input: the chat is over
            console.print()
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt: interrupted, exit 130 as every command
            console.print()
            raise typer.Exit(130) from None
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
        console.print("  Image, video and audio paths written in a message are attached too: [bold]photo.jpg what is this?[/bold], "
                      "[bold]clip.mp4 what moves?[/bold], [bold]talk.wav transcribe it[/bold]", highlight=False)
    elif cmd.kind == "unknown":
        console.print(f"[yellow]unknown command {escape(cmd.command)}[/yellow]; /help lists the commands", highlight=False)
    elif cmd.kind in ("image", "video", "audio", "message") and not cmd.text:
        for path in cmd.images:
            session.attach(path)
        for path in cmd.videos:
            session.attach_video(path)
        for path in cmd.audios:
            session.attach_audio(path)
        if cmd.images or cmd.videos or cmd.audios:
            names = escape(", ".join(p.name for p in (*cmd.images, *cmd.videos, *cmd.audios)))
            counts = [f"{n} {what}(s)" for n, what in ((len(session.pending), "image"), (len(session.pending_videos), "video"),
                                                       (len(session.pending_audios), "clip")) if n]
            info(f"[dim]attached {names} ({', '.join(counts)} for the next message)[/dim]")
    elif cmd.kind in ("image", "video", "audio", "message"):
        _reply(session, cmd.text, cmd.images, cmd.audios, cmd.videos)
    return True


_CONTROL = {c: None for c in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]}


def _printable(text: str) -> str:
    """`text` without control characters other than newline and tab: a model's output must not drive the terminal
    (an escape sequence could move the cursor or retitle the window)."""
    return text.translate(_CONTROL)


def _reply(session: "ChatSession", text: str, images, audios=(), videos=()) -> None:
    """Stream one reply to the console; Ctrl-C stops it (the turn is then not kept)."""
    stream = session.stream(text, images, audios, videos)
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
