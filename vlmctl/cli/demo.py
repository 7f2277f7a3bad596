"""`vlmctl demo`: scaffold a demo project (pictures, video clips or audio clips) and run prepare -> build -> train ->
eval on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from vlmctl.cli._common import JsonOpt, OverridesArg, console, esc, is_override, print_json, state

# shlex (standard library, not loaded at the CLI's start-up) is imported inside the functions that use it, and so
# are the vlmctl modules a command runs: `vlmctl --help` imports every command module and must not import them.
# Modules the CLI's start-up loads anyway sit next to their use as well.

if TYPE_CHECKING:
    from vlmctl.demo import DemoResult

EXAMPLE = "Example: vlmctl demo my-demo, vlmctl demo video-demo --modality video, vlmctl demo dpo-demo --objective dpo"

LABELS = {"init": "init: generate the shapes VQA set", "prepare": "data prepare", "build": "model build (tiny, random init)",
          "train": "train", "eval": "eval on the val split"}
INIT_LABELS = {"image": LABELS["init"], "video": "init: generate the video clips", "audio": "init: generate the audio clips"}
POST_LABELS = {"pairs": "preference pairs (answer vs wrong one)", "prepare": "data prepare (pairs)", "train": "train {name}",
               "eval": "eval {name} on the val split"}
OBJECTIVE_NAMES = {"dpo": "DPO", "grpo": "GRPO"}
VERDICTS = {"image": "looks at the image", "video": "watches the video", "audio": "listens to the audio"}


def demo(
    folder: Annotated[Path, typer.Argument(help="Where the demo project is created.")] = Path("vlmctl-demo"),
    force: Annotated[bool, typer.Option("--force", help="Reuse an existing demo folder.")] = False,
    overrides: OverridesArg = None,
    modality: Annotated[str, typer.Option("--modality", help="image (shapes VQA, tiny LLaVA), video (moving-shapes clips, "
                                          "tiny Qwen2.5-VL) or audio (beeps and tones, tiny Qwen2-Audio).")] = "image",
    num_samples: Annotated[Optional[int], typer.Option("--num-samples", help="Generated samples (default: 3000 pictures, "
                                                       "1500 video or audio clips).")] = None,
    objective: Annotated[str, typer.Option("--objective", help="sft (train from scratch), or dpo / grpo: a briefly "
                                           "fine-tuned shapes model post-trained with preference pairs / the "
                                           "exact-match reward, measured before and after (image only); train.* "
                                           "overrides then set the post-training stage.")] = "sft",
    sft_steps: Annotated[Optional[int], typer.Option("--sft-steps", help="With --objective dpo or grpo: steps of the "
                                                     "fine-tuning that the post-training starts from (default 150).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the whole pipeline on a generated question-answering set (CPU, no downloads) and show that the model learns."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from vlmctl.demo import STAGES, default_launch, get_demo, run_demo
    from vlmctl.demo_post import OBJECTIVES, POST_STAGES, SFT_STEPS, run_post_demo
    from vlmctl.errors import UsageError

    if is_override(str(folder)):  # `vlmctl demo train.max_steps=50`: no folder given, only overrides
        overrides, folder = [str(folder), *(overrides or [])], Path("vlmctl-demo")
    demo_spec = get_demo(modality)  # an unknown modality or a missing extra fails before anything is written
    if objective != "sft" and objective not in OBJECTIVES:
        raise UsageError(f"no demo for objective {objective!r}", hint=f"choose one of: sft, {', '.join(OBJECTIVES)}")
    if objective != "sft" and modality != "image":
        raise UsageError(f"the {objective} demo post-trains the image demo, not the {modality} one", hint="leave out --modality")
    if sft_steps is not None and objective == "sft":
        raise UsageError("--sft-steps sets the start of --objective dpo or grpo", hint="set train.max_steps=N instead")
    labels = {**LABELS, "init": INIT_LABELS[modality]}
    stages: tuple[str, ...] = STAGES
    if objective != "sft":
        name, steps = OBJECTIVE_NAMES[objective], sft_steps or SFT_STEPS[objective]
        labels.update({"train": f"train (SFT start, {steps} steps)", "eval": "eval the SFT start"},
                      **{f"{objective}:{s}": POST_LABELS[s].format(name=name) for s in POST_STAGES[objective]})
        stages = (*STAGES, *(f"{objective}:{s}" for s in POST_STAGES[objective]))
    launcher, nproc = default_launch()
    quiet = state.quiet or as_json
    if not quiet:
        how = f"torchrun, {nproc} processes, FSDP2" if launcher == "torchrun" else "one process"
        model = "tiny VLM" if modality == "image" else demo_spec.model
        then = f", then {OBJECTIVE_NAMES[objective]}" if objective != "sft" else ""
        console.print(f"[bold]vlmctl demo[/bold] in {esc(folder)}: generated {esc(demo_spec.data)} -> {esc(model)} from scratch{then} ({how}, CPU, no downloads)")
    with Progress(SpinnerColumn(), TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=quiet or not console.is_terminal) as bar:
        tasks = {s: bar.add_task(labels[s], total=None, start=False, visible=False) for s in stages}
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
            if not console.is_terminal and not quiet:  # piped or logged: one line per stage, no bar
                console.print(f"✓ {labels[stage]} ({seconds:.0f} s)")
            following = stages[stages.index(stage) + 1:] if stage in stages else ()
            if following:
                start(following[0])

        start("init")
        if objective != "sft":
            post = run_post_demo(folder, objective, force=force, overrides=overrides, sft_steps=sft_steps, num_samples=num_samples,
                                 progress=progress, on_stage=on_stage)
        else:
            result = run_demo(folder, modality=modality, force=force, overrides=overrides, num_samples=num_samples,
                              progress=progress, on_stage=on_stage)
    if objective != "sft":
        if as_json:
            print_json(post.to_dict())
        else:
            _render_post(post, labels)
        return
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


def _here(folder: Path) -> str:
    """`folder` as the user would type it from here: relative to the current folder when inside it."""
    try:
        return str(Path(folder).resolve().relative_to(Path.cwd().resolve())) if Path(folder).is_absolute() else str(folder)
    except ValueError:
        return str(folder)


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
    body = Group(times, "", train_line, "", acc, verdict, "", "[bold]outputs[/bold] in " + esc(_here(result.folder)), where,
                 "", "[bold]next[/bold]", nxt)
    console.print(Panel(body, title="[bold]vlmctl demo[/bold]", title_align="left", border_style="green" if result.learned else "yellow"))


def _render_post(post, labels: dict[str, str]) -> None:
    """The panel of `--objective dpo|grpo`: time per stage (the SFT start's, then the post-training's), accuracy per
    question type before and after next to the blind baseline, and the verdict on the 10-point bar."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    before, name = post.before, OBJECTIVE_NAMES[post.objective]
    times = Table(title="time per stage", title_justify="left", box=None, pad_edge=False)
    times.add_column("stage")
    times.add_column("seconds", justify="right")
    for stage, seconds in before.stage_seconds.items():
        times.add_row(labels.get(stage, stage), f"{seconds:.1f}")
    for stage, seconds in post.stage_seconds.items():
        times.add_row(labels.get(f"{post.objective}:{stage}", stage), f"{seconds:.1f}")
    times.add_row("[bold]total[/bold]", f"[bold]{post.total_seconds:.1f}[/bold]")

    acc = Table(title=f"exact match on {before.val_samples} val samples", title_justify="left")
    for column, justify in (("question", "left"), ("n", "right"), ("SFT start", "right"), (f"after {name}", "right"),
                            ("blind baseline", "right")):
        acc.add_column(column, justify=justify)
    start = {s.qtype: s for s in before.scores}
    for s in post.scores:
        was = start.get(s.qtype)
        color = "green" if was is None or s.accuracy > was.accuracy else ("red" if s.accuracy < was.accuracy else "white")
        acc.add_row(s.qtype, str(s.n), f"{was.accuracy:.1%}" if was else "-", f"[{color}]{s.accuracy:.1%}[/{color}]",
                    f"{s.baseline:.1%} ({s.baseline_answer!r})")
    acc.add_row("[bold]overall[/bold]", str(sum(s.n for s in post.scores)), f"[bold]{before.overall:.1%}[/bold]",
                f"[bold]{post.overall:.1%}[/bold]", f"{before.baseline_overall:.1%}")
    points = 100 * post.gain
    if post.improved:
        verdict = f"[green]{name} raised overall val accuracy by {points:+.1f} points over its SFT start.[/green]"
    else:
        verdict = (f"[yellow]{name} changed overall val accuracy by {points:+.1f} points (the demo's bar: +10); try more "
                   f"steps, e.g. train.max_steps={2 * max(post.steps, 30)}.[/yellow]")
    rel = lambda p: p.relative_to(before.folder) if p is not None and before.folder in p.parents else p  # noqa: E731
    where = Table(box=None, show_header=False, pad_edge=False)
    where.add_row("SFT start", f"{esc(rel(before.run_dir))} ({before.steps} steps)")
    if post.pairs:  # the demo wrote preference pairs
        where.add_row("preference pairs", f"{post.pairs} ({esc(rel(post.prepared_dir))})")
    where.add_row(f"{name} run", f"{esc(rel(post.run_dir))} (final/, metrics.jsonl, loss.png, train.log)")
    where.add_row("evaluations", f"{esc(rel(before.eval_dir))}, {esc(rel(post.eval_dir))}")
    metrics = ", ".join(f"{k} {v:.3g}" for k, v in post.metrics.items())
    loss = f", final loss {post.final_loss:.3f}" if post.final_loss is not None else ""
    if loss and post.loss_terms:
        loss += f" ({esc(post.loss_terms)})"
    train_line = f"{name}: {post.steps} steps from the SFT start's final model{loss}" + (f"; {metrics}" if metrics else "")
    body = Group(times, "", train_line, "", acc, verdict, "", "[bold]outputs[/bold] in " + esc(_here(before.folder)), where)
    console.print(Panel(body, title=f"[bold]vlmctl demo --objective {post.objective}[/bold]", title_align="left",
                        border_style="green" if post.improved else "yellow"))
