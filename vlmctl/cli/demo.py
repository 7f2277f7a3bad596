"""`vlmctl demo`: scaffold a demo project (pictures, video clips or audio clips) and run prepare -> build -> train ->
eval on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from vlmctl.cli._common import JsonOpt, OverridesArg, console, esc, is_override, print_json, state

if TYPE_CHECKING:
    from vlmctl.demo import DemoResult

EXAMPLE = "Example: vlmctl demo my-demo, vlmctl demo video-demo --modality video"

LABELS = {"init": "init: generate the shapes VQA set", "prepare": "data prepare", "build": "model build (tiny, random init)",
          "train": "train", "eval": "eval on the val split"}
INIT_LABELS = {"image": LABELS["init"], "video": "init: generate the video clips", "audio": "init: generate the audio clips"}
VERDICTS = {"image": "looks at the image", "video": "watches the video", "audio": "listens to the audio"}


def demo(
    folder: Annotated[Path, typer.Argument(help="Where the demo project is created.")] = Path("vlmctl-demo"),
    force: Annotated[bool, typer.Option("--force", help="Reuse an existing demo folder.")] = False,
    overrides: OverridesArg = None,
    modality: Annotated[str, typer.Option("--modality", help="image (shapes VQA, tiny LLaVA), video (moving-shapes clips, "
                                          "tiny Qwen2.5-VL) or audio (beeps and tones, tiny Qwen2-Audio).")] = "image",
    num_samples: Annotated[Optional[int], typer.Option("--num-samples", help="Generated samples (default: 3000 pictures, "
                                                       "1500 video or audio clips).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the whole pipeline on a generated question-answering set (CPU, no downloads) and show that the model learns."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from vlmctl.demo import STAGES, default_launch, get_demo, run_demo

    if is_override(str(folder)):  # `vlmctl demo train.max_steps=50`: no folder given, only overrides
        overrides, folder = [str(folder), *(overrides or [])], Path("vlmctl-demo")
    demo_spec = get_demo(modality)  # an unknown modality or a missing extra fails before anything is written
    labels = {**LABELS, "init": INIT_LABELS[modality]}
    launcher, nproc = default_launch()
    quiet = state.quiet or as_json
    if not quiet:
        how = f"torchrun, {nproc} processes, FSDP2" if launcher == "torchrun" else "one process"
        model = "tiny VLM" if modality == "image" else demo_spec.model
        console.print(f"[bold]vlmctl demo[/bold] in {esc(folder)}: generated {esc(demo_spec.data)} -> {esc(model)} from scratch ({how}, CPU, no downloads)")
    with Progress(SpinnerColumn(), TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=quiet) as bar:
        tasks = {s: bar.add_task(labels[s], total=None, start=False, visible=False) for s in STAGES}
        current = {"stage": None}

        def start(stage: str) -> None:
            if current["stage"] != stage:
                current["stage"] = stage
                bar.update(tasks[stage], visible=True)
                bar.start_task(tasks[stage])

        def progress(stage: str, done: int, total: int | None) -> None:
            start(stage)
            bar.update(tasks[stage], completed=done, total=total)

        def on_stage(stage: str, seconds: float) -> None:
            start(stage)
            t = bar.tasks[tasks[stage]]
            bar.update(tasks[stage], total=t.total or 1, completed=t.total or 1,
                       description=f"[green]✓[/green] {labels[stage]} ({seconds:.0f} s)")
            bar.stop_task(tasks[stage])
            if not console.is_terminal and not quiet:  # piped or logged: the bar draws only at the end
                console.print(f"✓ {labels[stage]} ({seconds:.0f} s)")
            following = STAGES[STAGES.index(stage) + 1:] if stage in STAGES else ()
            if following:
                start(following[0])

        start("init")
        result = run_demo(folder, modality=modality, force=force, overrides=overrides, num_samples=num_samples, progress=progress,
                          on_stage=on_stage)
    if as_json:
        print_json(result.to_dict())
        return
    _render(result, again=(folder, overrides or [], num_samples))


def _verdict(result: "DemoResult", ratio: float, again: tuple = (None, (), None)) -> str:
    """The line under the accuracy table: learned, or what to change. A perceiver whose seeded connector trained with
    the rest gave up where things are on this set, and more steps did not bring it back (docs/benchmarks.md).
    `again`: (folder, overrides, --num-samples) as given, repeated in the command that trains longer."""
    if result.learned:
        return (f"[green]The model {VERDICTS.get(result.modality, VERDICTS['image'])}: above the blind baseline on every "
                f"question type, {ratio:.1f}x overall.[/green]")
    if result.projector == "perceiver" and not {"vision", "projector"} <= set(result.frozen):
        return ("[yellow]Not above the blind baseline everywhere. A perceiver trained with the encoder gives up where "
                "things are on this set (docs/benchmarks.md): with model.perceiver_init=region (the default) and "
                "train.freeze unset, the demo keeps the vision tower and the seeded connector fixed.[/yellow]")
    longer = 2000 if result.modality == "image" else 2 * max(result.steps, 100)
    return (f"[yellow]Not above the blind baseline everywhere: train longer, e.g. "
            f"`{esc(retry_command(result.modality, longer, *again))}`.[/yellow]")


def retry_command(modality: str, steps: int, folder=None, overrides=(), num_samples: int | None = None) -> str:
    """The `vlmctl demo` command that runs the same demo again (its folder, modality, sample count and overrides)
    with train.max_steps=`steps`."""
    import shlex

    words = ["vlmctl", "demo"] + ([str(folder)] if folder is not None else [])
    words += ([] if modality == "image" else ["--modality", modality]) + (["--num-samples", str(num_samples)] if num_samples else [])
    words += ["--force", *(o for o in overrides if not o.startswith("train.max_steps=")), f"train.max_steps={steps}"]
    return " ".join(shlex.quote(w) for w in words)


def _render(result: "DemoResult", again: tuple = (None, (), None)) -> None:
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    from vlmctl.demo import next_commands

    times = Table(title="time per stage", title_justify="left", box=None, pad_edge=False)
    times.add_column("stage")
    times.add_column("seconds", justify="right")
    for stage, seconds in result.stage_seconds.items():
        times.add_row(stage, f"{seconds:.1f}")
    times.add_row("[bold]total[/bold]", f"[bold]{result.total_seconds:.1f}[/bold]")

    acc = Table(title=f"exact match on {result.val_samples} val samples", title_justify="left")
    acc.add_column("question")
    acc.add_column("n", justify="right")
    acc.add_column("model", justify="right")
    acc.add_column("blind baseline", justify="right")
    for s in result.scores:
        color = "green" if s.accuracy > s.baseline else "red"
        acc.add_row(s.qtype, str(s.n), f"[{color}]{s.accuracy:.1%}[/{color}]", f"{s.baseline:.1%} ({s.baseline_answer!r})")
    ratio = result.overall / result.baseline_overall if result.baseline_overall else float("inf")
    acc.add_row("[bold]overall[/bold]", str(sum(s.n for s in result.scores)), f"[bold]{result.overall:.1%}[/bold]",
                f"{result.baseline_overall:.1%}  ({ratio:.1f}x)")

    verdict = _verdict(result, ratio, again)
    rel = lambda p: p.relative_to(result.folder) if p is not None and result.folder in p.parents else p  # noqa: E731
    where = Table(box=None, show_header=False, pad_edge=False)
    where.add_row("prepared data", esc(rel(result.prepared_dir)))
    where.add_row("built model", esc(rel(result.model_dir)))
    if result.run_dir is not None:
        where.add_row("training run", f"{esc(rel(result.run_dir))} (final/, metrics.jsonl, loss.png, train.log)")
    where.add_row("evaluation", f"{esc(rel(result.eval_dir))} (report.html, predictions.jsonl)")
    steps = f"{result.steps} steps" + (f", final loss {result.final_loss:.3f}" if result.final_loss is not None else "")
    train_line = f"train: {result.launcher} x{result.nproc} ({result.strategy}), {result.train_samples} samples, {steps}"
    if result.frozen:
        train_line += f"; frozen: {', '.join(result.frozen)}"
    nxt = "\n".join(f"  cd {result.folder.name} && {c}" if i == 0 else f"  {c}" for i, c in enumerate(next_commands(result)))
    body = Group(times, "", train_line, "", acc, verdict, "", "[bold]outputs[/bold] in " + str(result.folder), where, "",
                 "[bold]next[/bold]", nxt)
    console.print(Panel(body, title="[bold]vlmctl demo[/bold]", title_align="left", border_style="green" if result.learned else "yellow"))
