"""`vlmctl serve`: an OpenAI-compatible server and a chat page for a model folder; `--check` compares it with the
trainer and `vlmctl generate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from vlmctl.cli._common import ConfigOpt, JsonOpt, console, err_console, info, load_project, print_json, split_args, state
from vlmctl.cli.chat import DeviceOpt, DtypeOpt, ModelArgs, TemperatureOpt, _video_settings, resolve_model_dir

# The vlmctl modules that load numpy when imported are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for it.
# The vlmctl modules a command runs are imported inside it: `vlmctl --help` imports every command module and must
# not import them.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

EXAMPLE = "Example: vlmctl serve outputs/runs/run1/final --port 8000   (then: OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-'))"


def serve_cmd(
    args: ModelArgs = None,
    config: ConfigOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind; another than 127.0.0.1/localhost needs --api-key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="VLMCTL_API_KEY", help="Clients must send "
                                                   "Authorization: Bearer KEY (also VLMCTL_API_KEY).", show_default=False)] = None,
    model_name: Annotated[Optional[str], typer.Option("--model-name", help="The model's name in the API (default: the folder's, "
                                                      "or the run's for RUN/final).", show_default=False)] = None,
    media_root: Annotated[Optional[list[Path]], typer.Option("--media-root", help="Folder that image_url paths may point into "
                                                             "(repeatable; default: the project's data.media_roots, else none: "
                                                             "data: URLs only).", show_default=False)] = None,
    max_batch_size: Annotated[int, typer.Option("--max-batch-size", help="Rows decoded together (a request of n choices is n rows); the KV cache holds this many.")] = 32,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per answer when a request gives no max_tokens.")] = 256,
    warmup_length: Annotated[int, typer.Option("--warmup-length", min=0, help="On a GPU, capture the decode step's and short "
                                               "prefills' CUDA graphs before serving, for every batch size and rows of up to this many tokens "
                                               "(prompt + answer), so no client waits for a capture later; 0: captured "
                                               "as first needed.")] = 512,
    processor_workers: Annotated[Optional[int], typer.Option("--processor-workers", min=0, help="Processes that run the "
                                                             "processor (pictures resized and patched, text tokenized) on "
                                                             "each request's prompt while it is read, so the decoding thread "
                                                             "only batches the tensors (families whose processor batches that "
                                                             "way: Qwen-VL, LLaVA, LLaVA-NeXT, Mistral3, Idefics2/3, "
                                                             "Qwen2-Audio); 0: the decoding thread runs it. Default: 4 on a "
                                                             "GPU (at most one per 4 CPU cores), 0 on the CPU.",
                                                             show_default=False)] = None,
    profile_dir: Annotated[Optional[Path], typer.Option("--profile-dir", help="Let POST /start_profile and /stop_profile "
                                                        "record the decoding thread with torch.profiler into this folder "
                                                        "(profile-NNN/: trace.json.gz for Perfetto or TensorBoard, ops.txt "
                                                        "with where the GPU sat idle); off by default.",
                                                        show_default=False)] = None,
    freeze_heap: Annotated[bool, typer.Option("--freeze-heap/--no-freeze-heap", help="Once the model is loaded and the "
                                              "engine warmed up, move the objects alive out of the garbage collector's "
                                              "reach (gc.freeze), so its full collections, which stop every stream, walk "
                                              "only what serving allocates (/health's gc counts them).")] = True,
    engine_process: Annotated[bool, typer.Option("--engine-process/--engine-thread", help="Run the decoding engine in a "
                                                  "process of its own, which loads the model, so its thread does not share "
                                                  "the interpreter lock with the HTTP side's request threads; "
                                                  "--engine-thread runs it in a thread of the server's process.")] = True,
    stream_interval: Annotated[int, typer.Option("--stream-interval", min=1, help="Send a streamed answer's text at its "
                                                 "first token, then every this many tokens, and at its end (as SGLang's "
                                                 "--stream-interval): fewer, longer chunks for many clients that parse "
                                                 "every chunk; 1: every token.")] = 1,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", help="Largest request body, in MiB.")] = 32.0,
    allow_origin: Annotated[Optional[list[str]], typer.Option("--allow-origin", help="A web page origin (scheme://host[:port]) "
                                                              "allowed to call the server from a browser (CORS; repeatable; "
                                                              "'*' needs --api-key). Default: only the chat page.",
                                                              show_default=False)] = None,
    temperature: TemperatureOpt = 0.0,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    check: Annotated[bool, typer.Option("--check", help="Do not serve: ask fixed probes over HTTP and compare the answers with "
                                        "`vlmctl generate` and the first token's log-probabilities with the trainer's forward.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Serve a model over an OpenAI-compatible API (POST /v1/chat/completions, GET /v1/models, GET /health) with a chat
    page at /. Ctrl-C or SIGTERM lets the requests in flight finish, then stops. Each request is logged on stderr
    (method, path, status, prompt+completion tokens, seconds).

    Limits come from the project (data.max_image_pixels per image, data.max_length for prompt + answer). Without
    --api-key only requests to localhost/127.0.0.1 are answered, and web pages of other origins only with
    --allow-origin (docs/security.md).
    """
    from vlmctl.config import find_config
    from vlmctl.inference import check_model_dir, folder_family
    from vlmctl.serve import ServeSettings, check_settings, serve, served_name
    from vlmctl.serve.app import Limits
    from vlmctl.serve.server import bind_socket

    model_dir = resolve_model_dir(args, config, "serve")
    check_model_dir(model_dir)
    if check:
        return _check(model_dir, device, dtype, as_json)
    in_project = config is not None or state.config is not None or find_config() is not None
    project = load_project(config, split_args(args)[1]) if in_project else None
    data = project.data if project is not None else None
    limits = Limits(max_body_bytes=int(max_body_mb * 2**20), default_max_tokens=max_tokens, temperature=temperature,
                    media_roots=tuple(media_root or (data.media_roots if data else ())))
    if data is not None:
        limits.max_image_pixels, limits.max_tokens = data.max_image_pixels, data.max_length
    settings = ServeSettings(host=host, port=port, api_key=api_key, model_name=model_name, limits=limits,
                             max_batch_size=max_batch_size, max_length=limits.max_tokens, device=device, dtype=dtype,
                             train=project.train if project is not None else None, allowed_origins=tuple(allow_origin or ()),
                             log=None if state.quiet else _log_request, warmup_length=warmup_length,
                             processor_workers=processor_workers, profile_dir=profile_dir, freeze_heap=freeze_heap,
                             engine_process=engine_process, stream_interval=stream_interval)
    check_settings(settings)
    settings.video = _video_settings(model_dir, folder_family(model_dir), config, args)
    sock = bind_socket(host, port)  # a port in use is one error, before the model loads

    def ready(url: str, server) -> None:
        choice = server.choice
        info(f"Serving [bold]{escape(str(model_dir))}[/bold] as [bold]{escape(server.model_name)}[/bold] "
             f"({choice.get('dtype')}, {escape(str(choice.get('attn_implementation')))} attention) at {escape(url)}/v1 "
             f"(chat page: {escape(url)}/){' [dim](API key required)[/dim]' if api_key else ''}. Ctrl-C stops.")
        info(f"[dim]decoding: {escape(server.engine.summary())}; processor: {escape(server.processor)}[/dim]")

    info(f"[dim]loading {escape(str(model_dir))} ({escape(served_name(model_dir))})[/dim]")
    serve(model_dir, settings, on_ready=ready, sock=sock)
    info("[dim]stopped: the requests in flight were answered[/dim]")


def _log_request(line: str) -> None:
    err_console.print(line, markup=False, highlight=False, soft_wrap=True)


def _check(model_dir: Path, device: str, dtype: str, as_json: bool) -> None:
    from rich.table import Table

    from vlmctl.serve.check import check_serving

    report = check_serving(model_dir, device=device, dtype=dtype)
    if as_json:
        print_json({"ok": report.ok, "model": str(report.model_dir), "reference": str(report.reference),
                    "probes": [{"name": p.name, "ok": p.ok, "served": p.served, "generated": p.generated,
                                "max_logprob_error": p.max_logprob_error, "failures": p.failures} for p in report.probes]})
    else:
        table = Table("probe", "result", "served answer", title=f"serve --check {escape(str(model_dir))}")
        for p in report.probes:
            table.add_row(p.name, "[green]ok[/green]" if p.ok else "[red]FAIL[/red]", escape(p.served[:60]))
        console.print(table)
        console.print(f"[dim]trainer's processor: {escape(str(report.reference))}[/dim]")
        for p in report.probes:
            for failure in p.failures:
                console.print(f"[red]{escape(p.name)}[/red]: {escape(failure)}", highlight=False)
        console.print("[green]served answers match the trainer and `vlmctl generate`[/green]" if report.ok
                      else "[red]the served model does not answer as it was trained[/red]")
    if not report.ok:
        raise typer.Exit(1)
