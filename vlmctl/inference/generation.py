"""Batched generation over `GenerationRequest`s, through transformers (`generate`) or vLLM (`generate_vllm`), and
streamed generation of one answer (`stream_generate`).

The batched functions return one `Generation(prompt, text)` per request, in request order. Decoding is greedy
unless a positive `temperature` is given (then nucleus sampling with `top_p`; seed it with `torch.manual_seed` for
the HF backend).

Audio clips (`GenerationRequest.audios`, audio families such as qwen2_audio) go through the data pipeline's audio
unit (`vlmctl.data.modalities.audio.AudioUnit.processor_inputs`): decoded with soundfile, down-mixed to mono and
resampled with soxr to the feature extractor's rate (16 kHz for Whisper-style extractors), then handed to the
processor's `audio=`, exactly as training hands them over; the processor returns `input_features` and
`feature_attention_mask`. A request with a modality the model's family does not take is a UsageError
(`check_requests`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from vlmctl.errors import UsageError
from vlmctl.inference.prompt import Generation, GenerationRequest, check_requests, model_family, render_inputs

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


def _sampling(temperature: float, top_p: float) -> dict[str, Any]:
    """`model.generate` keyword arguments: greedy for temperature 0, else nucleus sampling."""
    return {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}


def audio_inputs(processor, clips: list[bytes]) -> dict[str, Any]:
    """The processor call's audio keywords for encoded `clips`: `audio=` (mono float32 waveforms [n] at the feature
    extractor's rate) and `sampling_rate=`, through the data pipeline's audio unit; {} without clips. Raises
    DataError for a clip that does not decode (the unit's AudioError, with its reason)."""
    if not clips:
        return {}
    from vlmctl.data.modalities import get_unit
    from vlmctl.data.modalities.audio import AudioError
    from vlmctl.errors import DataError

    try:
        return get_unit("audio").processor_inputs(list(clips), processor)
    except AudioError as exc:
        raise DataError(f"an audio clip cannot be read ({exc.reason}): {exc.detail}",
                        hint="use WAV, FLAC, MP3 or OGG clips (pip install 'vlmctl[audio]' for the decoders)") from None


def _model_inputs(model, processor, texts: list[str], images: list, audios: list[bytes] = ()) -> dict[str, Any]:
    """The processor's tensors for rendered prompts (padded on the tokenizer's padding side), on the model's
    device; floating image and audio-feature tensors in the model's dtype. `audios`: the encoded clips of the
    prompts' audio parts, in order (`audio_inputs`)."""
    device = next(model.parameters()).device
    media = {"images": images} if images else {}
    inputs = processor(text=texts, **media, **audio_inputs(processor, list(audios)), padding=True, return_tensors="pt",
                       add_special_tokens=False)
    inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in inputs.items()}
    for key in ("pixel_values", "input_features"):
        if key in inputs and inputs[key].is_floating_point():
            inputs[key] = inputs[key].to(model.dtype)
    return inputs


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
    family: Any = None,
) -> list[Generation]:
    """Answers for `requests` through `model.generate`, `batch_size` prompts at a time.

    Prompts are rendered by `render_inputs` and left-padded, so every row continues from its last position: with
    greedy decoding a request's answer does not depend on the batch it is in (up to floating-point ties). Each
    batch's `input_ids` is [batch_size, longest prompt in tokens]; at most `max_new_tokens` tokens are generated
    per request, fewer when it reaches an end-of-sequence token. Image and audio-feature tensors are cast to the
    model's dtype; audio clips are read as the module docstring says.

    `model`, `processor` as returned by `load_for_generation`; `family` its `FamilySpec` (default: from the model's
    config, `model_family`). The tokenizer's pad token is set to its EOS token when it has none. Raises UsageError
    for a non-positive `batch_size` / `max_new_tokens`, a negative `temperature`, `top_p` outside (0, 1], or a
    request with a modality the family does not take (`check_requests`); DataError for a request whose media parts
    point past its media, or a clip that does not decode.
    """
    import torch

    _check_sampling(batch_size, max_new_tokens, temperature, top_p)
    family = family if family is not None else model_family(model)
    check_requests(requests, family)
    tok = processor.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    side, tok.padding_side = tok.padding_side, "left"  # generation continues from the last position of every row
    out: list[Generation] = []
    try:
        for start in range(0, len(requests), batch_size):
            rendered = [render_inputs(r, processor, family) for r in requests[start : start + batch_size]]
            texts = [r.text for r in rendered]
            inputs = _model_inputs(model, processor, texts, [img for r in rendered for img in r.images],
                                   [clip for r in rendered for clip in r.audios])
            with torch.inference_mode():
                generated = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                           **_sampling(temperature, top_p))
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
    family: Any = None,
) -> list[Generation]:
    """Answers for `requests` through vLLM's offline `LLM.generate` (prompt text + `multi_modal_data`: images, and
    audio clips as (waveform, sampling rate) pairs, read as `generate` reads them); vLLM batches and schedules the
    requests itself.

    `llm`, `processor` as returned by `load_vllm`; `family` the model's `FamilySpec` (the modality check and the
    audio prompt; without it nothing is checked and an audio part is the processor's audio token). Raises
    UsageError for bad sampling values or modalities (see `generate`), DataError for a request whose media parts
    point past its media.
    """
    from vllm import SamplingParams

    _check_sampling(None, max_new_tokens, temperature, top_p)
    check_requests(requests, family)
    rendered = [render_inputs(r, processor, family) for r in requests]
    prompts = []
    for r in rendered:
        media: dict[str, Any] = {}
        if r.images:
            media["image"] = r.images if len(r.images) > 1 else r.images[0]
        if r.audios:
            audio = audio_inputs(processor, r.audios)
            clips = [(wave, audio.get("sampling_rate")) for wave in audio["audio"]]
            media["audio"] = clips if len(clips) > 1 else clips[0]
        prompts.append({"prompt": r.text, **({"multi_modal_data": media} if media else {})})
    outputs = llm.generate(prompts, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens))
    return [Generation(r.text, o.outputs[0].text.strip()) for r, o in zip(rendered, outputs)]


def stream_generate(
    model,
    processor,
    request: GenerationRequest,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    family: Any = None,
) -> Iterator[str]:
    """The answer to one request as pieces of text, yielded while `model.generate` runs in a background thread
    (transformers' `TextIteratorStreamer`: a piece is yielded once it decodes to whole words).

    The pieces joined and stripped equal `generate(...)[0].text` for the same request and settings (greedy: the
    same tokens; both decode without special tokens). Closing the iterator early (a `break`, Ctrl-C in the
    consumer) stops generation after the current token. An exception raised by the model is raised here after the
    pieces generated before it. `family`: as in `generate`. Raises UsageError for bad sampling values or
    modalities (see `generate`), DataError for a request whose media parts point past its media.
    """
    _check_sampling(None, max_new_tokens, temperature, top_p)
    import threading

    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

    family = family if family is not None else model_family(model)
    check_requests([request], family)
    tok = processor.tokenizer
    text, images, audios = render_inputs(request, processor, family)
    inputs = _model_inputs(model, processor, [text], images, audios)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    stop = threading.Event()
    errors: list[BaseException] = []

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool, device=input_ids.device)

    def run() -> None:
        try:
            with torch.inference_mode():  # thread-local: entered in the generating thread
                model.generate(**inputs, max_new_tokens=max_new_tokens, streamer=streamer,
                               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                               stopping_criteria=StoppingCriteriaList([_Stop()]), **_sampling(temperature, top_p))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            errors.append(exc)
            streamer.end()  # generate() ends the stream itself only when it returns

    thread = threading.Thread(target=run, name="vlmctl-generate", daemon=True)
    thread.start()
    try:
        for piece in streamer:
            if piece:
                yield piece
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]


__all__ = ["ProgressFn", "audio_inputs", "generate", "generate_vllm", "stream_generate"]
