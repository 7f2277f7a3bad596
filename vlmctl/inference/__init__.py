"""Generation with a model folder: load it, render prompts with its chat template, generate in batches.

Used by `vlmctl eval`, `vlmctl demo` and any command that answers prompts::

    from vlmctl.inference import GenerationRequest, generate, load_for_generation

    model, processor = load_for_generation("outputs/runs/run1/final", device="cpu")
    answers = generate(model, processor, [GenerationRequest(messages=[...], images=[png_bytes])], batch_size=8)
    answers[0].text

- `load`: folder checks (`check_model_dir`), compute dtype, device, processor; `load_vllm` for the vLLM engine.
- `prompt`: `GenerationRequest` (messages + images), `Generation` (prompt, text), `render_prompt`.
- `generation`: `generate` (transformers, left-padded batches) and `generate_vllm`.

Importing this package is cheap: torch, transformers and vllm are imported when a function needs them.
"""

from __future__ import annotations

from vlmctl.inference.generation import ProgressFn, generate, generate_vllm
from vlmctl.inference.load import (
    BACKENDS,
    DTYPES,
    check_backend,
    check_model_dir,
    load_for_generation,
    load_vllm,
    resolve_dtype,
)
from vlmctl.inference.prompt import Generation, GenerationRequest, render_prompt, request_from_sample

__all__ = [
    "BACKENDS", "DTYPES", "Generation", "GenerationRequest", "ProgressFn", "check_backend", "check_model_dir",
    "generate", "generate_vllm", "load_for_generation", "load_vllm", "render_prompt", "request_from_sample",
    "resolve_dtype",
]
