"""Generation with a model folder: load it, render prompts with its chat template, generate in batches.

Used by `vlmctl eval`, `vlmctl chat`, `vlmctl generate`, `vlmctl demo` and any command that answers prompts::

    from vlmctl.inference import GenerationRequest, generate, load_for_generation

    model, processor = load_for_generation("outputs/runs/run1/final", device="cpu")
    answers = generate(model, processor, [GenerationRequest(messages=[...], images=[png_bytes])], batch_size=8)
    answers[0].text
    generate(model, processor, [GenerationRequest(messages=[...], audios=[wav_bytes])])   # audio models (qwen2_audio)
    generate(model, processor, [GenerationRequest(messages=[...], videos=["clip.mp4"])],  # video (Qwen2-VL, OneVision)
             video=video_settings(model_dir, cfg.data))    # sampled by data.video (defaults without a project)

- `load`: folder checks (`check_model_dir`), compute dtype, device, processor; `load_vllm` for the vLLM engine;
  `video_settings` (the `data.video` settings videos are sampled by).
- `prompt`: `GenerationRequest` (messages + images, videos or audio clips), `Generation` (prompt, text),
  `render_request` / `render_inputs` / `render_prompt`, `check_requests` (a modality the model's family does not
  take is a UsageError).
- `generation`: `generate` (transformers, left-padded batches), `generate_vllm`, and `stream_generate` (one
  answer as pieces of text while it is generated); `read_video` (a video as the data pipeline stores a clip).
- `chat`: `ChatSession` (history, images and clips, one streamed reply per turn), `parse_input` (terminal lines and
  commands) and `read_audio` for `vlmctl chat`.
- `batch`: `read_prompts` (any input format) and `write_predictions` (answers -> JSONL) for `vlmctl generate`.

Importing this package is cheap: torch, transformers and vllm are imported when a function needs them.
"""

from __future__ import annotations

from vlmctl.inference.batch import PredictionsResult, read_prompts, write_predictions
from vlmctl.inference.chat import COMMANDS, ChatInput, ChatSession, parse_input, read_audio, read_image
from vlmctl.inference.generation import ProgressFn, generate, generate_vllm, read_video, stream_generate
from vlmctl.inference.load import (
    BACKENDS,
    DTYPES,
    check_backend,
    check_model_dir,
    folder_family,
    load_for_generation,
    load_vllm,
    resolve_device,
    resolve_dtype,
    video_settings,
)
from vlmctl.inference.prompt import (
    Generation,
    GenerationRequest,
    RenderedPrompt,
    RenderedRequest,
    check_requests,
    render_inputs,
    render_prompt,
    render_request,
    request_from_sample,
)

__all__ = [
    "BACKENDS", "COMMANDS", "DTYPES", "ChatInput", "ChatSession", "Generation", "GenerationRequest", "PredictionsResult",
    "ProgressFn", "RenderedPrompt", "RenderedRequest", "check_backend", "check_model_dir", "check_requests", "folder_family",
    "generate", "generate_vllm", "load_for_generation", "load_vllm", "parse_input", "read_audio", "read_image", "read_prompts",
    "read_video", "render_inputs", "render_prompt", "render_request", "request_from_sample", "resolve_device", "resolve_dtype",
    "stream_generate", "video_settings", "write_predictions",
]
