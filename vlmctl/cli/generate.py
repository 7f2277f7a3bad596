"""`vlmctl generate`: answer a file of prompts with a model and write predictions.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from vlmctl.cli._common import ConfigOpt, JsonOpt, console, info, load_project, print_json, split_args, state
from vlmctl.cli.chat import DeviceOpt, DtypeOpt, ModelArgs, TemperatureOpt, TopPOpt, resolve_model_dir

# The vlmctl modules that load numpy when imported are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for it.
# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

EXAMPLE = "Example: vlmctl generate outputs/runs/run1/final --input questions.jsonl -o predictions.jsonl"

OutputOpt = Annotated[Path, typer.Option("--output", "-o", help="Output JSONL file, or a folder to write predictions.jsonl into.")]


def generate_cmd(
    args: ModelArgs = None,
    input_: Annotated[str, typer.Option("--input", "-i", help="Prompts: a data file, folder or glob in any format the data "
                                        "commands read, or `val` (the project's prepared val split).", show_default=False)] = ...,
    out: OutputOpt = Path("predictions.jsonl"),
    config: ConfigOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="Input format: auto|llava|sharegpt|messages|parquet|webdataset|hf.")] = "auto",
    image_root: Annotated[Optional[Path], typer.Option("--image-root", help="Folder that relative image, video and audio paths are "
                                                       "resolved against (default: the input file's folder).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts per generation batch.")] = 8,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="At most this many tokens per answer.")] = 128,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed for sampling (with --temperature > 0).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Answer at most N samples.")] = None,
    backend: Annotated[str, typer.Option("--backend", help="hf (transformers), or vllm when installed.")] = "hf",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Answer every sample of a data file (its conversation up to the last assistant turn) -> predictions.jsonl.

    One row per readable sample: id, prompt, prediction, references (when it has one).
    Samples may carry videos (ShareGPT `videos`, `video` parts; frames sampled by the project's data.video) for video
    models such as qwen2_5_vl, and audio clips (ShareGPT `audios`, OpenAI `input_audio` parts) for audio models such as
    qwen2_audio.
    Score them with: vlmctl eval --predictions FILE.
    """
    from vlmctl.config import DataSource, find_config
    from vlmctl.errors import UsageError
    from vlmctl.evaluation import references_of
    from vlmctl.inference import (check_backend, check_model_dir, folder_family, read_prompts, request_from_sample, video_settings,
                                  write_predictions)
    from vlmctl.inference.prompt import check_requests

    check_backend(backend)  # before loading anything: a missing vllm is a usage error
    if limit is not None and limit <= 0:
        raise UsageError("--limit must be positive", hint="e.g. --limit 100")
    model_dir = resolve_model_dir(args, config, "generate")
    check_model_dir(model_dir)  # fail before reading data
    in_project = config is not None or state.config is not None or find_config() is not None
    data_cfg = load_project(config, split_args(args)[1]).data if in_project or input_ == "val" else None
    # inside a project, images may also live in the folders listed in data.media_roots (as for eval)
    path, media_roots = input_, (data_cfg.media_roots if data_cfg else ())
    if input_ == "val":
        path = str(data_cfg.prepared_dir / "val")
        if not any(Path(path).glob("*.parquet")):
            from vlmctl.errors import DataError

            raise DataError(f"no prepared val split in {path}", hint="run `vlmctl data prepare` first, or pass --input FILE")
    try:
        source = DataSource(path=path, format=fmt, image_root=image_root)
    except ValueError as exc:  # pydantic's ValidationError: an unknown --format
        raise UsageError(f"unknown --format {fmt!r}", hint="use auto, llava, sharegpt, messages, parquet, webdataset or hf") from exc
    # videos are sampled as training samples them: the project's data.video, else the model's run's, else defaults
    video = video_settings(model_dir, data_cfg)
    samples, rejected = read_prompts(source, limit, media_roots=media_roots, video=video)
    # audio samples for a vision-language model (or images for an audio one): a usage error before the model loads
    check_requests([request_from_sample(s) for s in samples], folder_family(model_dir))
    out = out / "predictions.jsonl" if out.is_dir() or not out.suffix else out
    quiet = as_json or state.quiet
    if not quiet:
        skipped = f", {len(rejected)} unreadable skipped (see `vlmctl data validate {input_}`)" if rejected else ""
        info(f"Answering {len(samples)} samples from {escape(input_)}{escape(skipped)} with "
             f"[bold]{escape(str(model_dir))}[/bold] ({backend})")
    with _bar(len(samples), enabled=not quiet) as progress:
        result = write_predictions(model_dir, samples, out, references=references_of, batch_size=batch_size,
                                   max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, backend=backend,
                                   device=device, dtype=dtype, seed=seed, progress=progress, video=video)
    if as_json:
        print_json({"output": str(result.path), "n": result.n, "skipped": len(rejected), "backend": result.backend,
                    "seconds": round(result.seconds, 3), **({"decoding": result.decoding} if result.decoding else {})})
        return
    console.print(f"Wrote {result.n} predictions to [bold]{escape(str(result.path))}[/bold] in {result.seconds:.1f} s", highlight=False)
    if result.decoding:
        info(f"[dim]decoding: {escape(result.decoding)}[/dim]")
    info(f"[dim]score them: vlmctl eval --predictions {escape(str(result.path))}[/dim]")


class _bar:
    """A rich progress bar over samples (hidden with --quiet and --json)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None

    def __enter__(self):
        if not self.enabled or not console.is_terminal:  # piped or logged: a bar would leave its last frame
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("generate"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console, transient=True)
        self.bar.start()
        task = self.bar.add_task("generate", total=self.total)
        return lambda done, total: self.bar.update(task, completed=done, total=total)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
