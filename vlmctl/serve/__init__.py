"""`vlmctl serve`: an OpenAI-compatible HTTP server and a chat page for a model folder, and `--check`, which
compares what the server answers with `vlmctl generate` and the trainer's forward.

    from vlmctl.serve import ServeSettings, serve
    serve(Path("outputs/runs/run1/final"), ServeSettings(port=8000))      # blocks until SIGTERM / Ctrl-C

- `protocol`: the request schema (pydantic), its conversion into a `GenerationRequest`, OpenAI's error shape.
- `engine`: `Engine`, a queue and a worker thread that runs the decoding engine (`vlmctl.inference.engine`) with
  continuous batching.
- `engine_process`: `EngineProcess`, the same engine in a process of its own (`serve`'s default), over a pipe.
- `loading`: the model loaded for serving (training's plan for dtype and attention), and what /health says of it.
- `prepare`: the processor in worker processes, on each request's prompt while it is read.
- `heap`: the collector's pauses counted, the start-up heap frozen.
- `app`: the Starlette app (routes, API key, Host/Origin checks and CORS, body limits, request log, server-sent
  events), `Limits`.
- `server`: `serve` (uvicorn; SIGTERM drains), `running_server` (a background server), `make_state`, the safety
  checks.
- `check`: `check_serving`, the fixed probes of `vlmctl serve --check`.

Importing this package is cheap: torch, transformers, starlette and uvicorn are imported when a function needs them.
"""

from __future__ import annotations

from vlmctl.serve.server import ServeSettings, check_settings, free_port, is_loopback, running_server, serve, served_name

__all__ = ["ServeSettings", "check_settings", "free_port", "is_loopback", "running_server", "serve", "served_name"]
