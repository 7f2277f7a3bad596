"""Batched generation over `GenerationRequest`s, through transformers (`generate`) or vLLM (`generate_vllm`).

Both return one `Generation(prompt, text)` per request, in request order. Decoding is greedy unless a positive
`temperature` is given (then nucleus sampling with `top_p`; seed it with `torch.manual_seed` for the HF backend).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from vlmctl.errors import UsageError
from vlmctl.inference.prompt import Generation, GenerationRequest, render_prompt

ProgressFn = Callable[[int, int], None]
"""Called as progress(done, total) after each batch, in requests."""


def _check_sampling(batch_size: int | None, max_new_tokens: int, temperature: float, top_p: float) -> None:
    if batch_size is not None and batch_size <= 0:
        raise UsageError(f"batch_size must be positive, got {batch_size}", hint="e.g. --batch-size 8")
    if max_new_tokens <= 0:
        raise UsageError(f"max_new_tokens must be positive, got {max_new_tokens}", hint="e.g. --max-new-tokens 32")
    if temperature < 0:
        raise UsageError(f"temperature must be >= 0, got {temperature}", hint="0 decodes greedily")
    if not 0 < top_p <= 1:
        raise UsageError(f"top_p must be in (0, 1], got {top_p}", hint="1 keeps the whole distribution")


def generate(
    model,
    processor,
    requests: Sequence[GenerationRequest],
    *,
    batch_size: int = 8,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    progress: ProgressFn | None = None,
) -> list[Generation]:
    """Answers for `requests` through `model.generate`, `batch_size` prompts at a time.

    Prompts are rendered by `render_prompt` and left-padded, so every row continues from its last position: with
    greedy decoding a request's answer does not depend on the batch it is in (up to floating-point ties). Each
    batch's `input_ids` is [batch_size, longest prompt in tokens]; at most `max_new_tokens` tokens are generated
    per request, fewer when it reaches an end-of-sequence token. Image tensors are cast to the model's dtype.

    `model`, `processor` as returned by `load_for_generation`. The tokenizer's pad token is set to its EOS token
    when it has none. Raises UsageError for a non-positive `batch_size` / `max_new_tokens`, a negative
    `temperature` or `top_p` outside (0, 1]; DataError for a request whose image parts point past its images.
    """
    import torch

    _check_sampling(batch_size, max_new_tokens, temperature, top_p)
    tok = processor.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    device = next(model.parameters()).device
    side, tok.padding_side = tok.padding_side, "left"  # generation continues from the last position of every row
    out: list[Generation] = []
    try:
        for start in range(0, len(requests), batch_size):
            rendered = [render_prompt(r, processor) for r in requests[start : start + batch_size]]
            texts = [t for t, _ in rendered]
            images = [img for _, imgs in rendered for img in imgs]
            inputs = processor(text=texts, images=images or None, padding=True, return_tensors="pt", add_special_tokens=False)
            inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in inputs.items()}
            if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
                inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
            with torch.inference_mode():
                generated = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **sampling)
            answers = tok.batch_decode(generated[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            out.extend(Generation(t, a.strip()) for t, a in zip(texts, answers))
            if progress:
                progress(len(out), len(requests))
    finally:
        tok.padding_side = side
    return out


def generate_vllm(
    llm: Any,
    processor,
    requests: Sequence[GenerationRequest],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> list[Generation]:
    """Answers for `requests` through vLLM's offline `LLM.generate` (prompt text + `multi_modal_data` images);
    vLLM batches and schedules the requests itself.

    `llm`, `processor` as returned by `load_vllm`. Raises UsageError for bad sampling values (see `generate`),
    DataError for a request whose image parts point past its images.
    """
    from vllm import SamplingParams

    _check_sampling(None, max_new_tokens, temperature, top_p)
    rendered = [render_prompt(r, processor) for r in requests]
    prompts = [{"prompt": t, **({"multi_modal_data": {"image": imgs if len(imgs) > 1 else imgs[0]}} if imgs else {})}
               for t, imgs in rendered]
    outputs = llm.generate(prompts, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens))
    return [Generation(t, o.outputs[0].text.strip()) for (t, _), o in zip(rendered, outputs)]


__all__ = ["ProgressFn", "generate", "generate_vllm"]
