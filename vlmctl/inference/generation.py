"""Generation over `GenerationRequest`s: `generate` (batched answers) and `stream_generate` (one answer as pieces of
text) through vlmctl's decoding engine (`vlmctl.inference.engine`), and `generate_vllm` through vLLM's offline
engine (optional; it targets vLLM 0.26 and is not tested here).

`generate` returns one `Generation(prompt, text)` per request, in request order. Decoding is greedy unless a positive
`temperature` is given (then sampling with `top_p`, each request from its own seed drawn from torch's generator: seed
it with `torch.manual_seed`). Audio clips and videos are read as training reads them (`vlmctl.inference.inputs`: the
data pipeline's audio and video units). A request with a modality the model's family does not take is a UsageError
(`check_requests`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from vlmctl.errors import UsageError
from vlmctl.inference.inputs import _model_inputs, audio_inputs, read_video, video_inputs  # noqa: F401 (their former home)
from vlmctl.inference.prompt import Generation, GenerationRequest, check_requests, model_family, render_request

if TYPE_CHECKING:
    from vlmctl.config.data import DataVideo

# torch and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# So are the vlmctl modules that load numpy when imported.
# vllm (an optional dependency) is imported only where used, so the rest works without it.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

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


def context_limit(model) -> int:
    """The longest row the model's language model takes, in tokens (`max_position_embeddings` of its text config;
    32,768 when the config names none): how far the engine of `generate` may grow its cache."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "max_position_embeddings", None) or 32_768)


def raise_failed(requests: Sequence[Any]) -> None:
    """Raise the error of the first failed engine request (`vlmctl.inference.engine.Request`): DataError for an
    input the processor or the context refuses (400), ModelError for a failure of the model (500)."""
    from vlmctl.errors import DataError, ModelError

    for request in requests:
        if request.error is None:
            continue
        status, message, code = request.error
        where = f"request {request.id}: " if request.id else ""
        if status < 500:
            hint = ("ask for fewer new tokens or shorten the prompt" if code == "context_length_exceeded"
                    else "check the request's messages and media")
            raise DataError(f"{where}{message}", hint=hint)
        raise ModelError(f"{where}{message}", hint="run again with VLMCTL_DEBUG=1 for the traceback")


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
    video: "DataVideo | None" = None,
) -> list[Generation]:
    """Answers for `requests` through the decoding engine (`vlmctl.inference.engine.DecodeEngine`), at most
    `batch_size` of them decoded at once: a request joins as soon as another one finishes (continuous batching),
    its prompt prefilled alone in its own cache slot, so with greedy decoding a request's answer does not depend on
    the requests beside it (up to floating-point ties between batch shapes). At most `max_new_tokens` tokens are
    generated per request, fewer when it reaches an end-of-sequence token of the model's generation config; the
    engine's cache grows for a long prompt up to the model's context (`context_limit`). Sampling with a positive
    `temperature` (and `top_p`) draws each request's tokens from its own seed, taken from torch's generator (seed it
    with `torch.manual_seed`). Audio clips and videos are read as the module docstring says (videos that are not
    stored clips sampled by `video`, the `data.video` settings; defaults when None).

    `model`, `processor` as returned by `load_for_generation`; `family` its `FamilySpec` (default: from the model's
    config, `model_family`). The engine (its CUDA graphs, its cache) is kept on the model for the next call with the
    same settings (`engine_for`). Raises UsageError for a non-positive `batch_size` / `max_new_tokens`, a negative
    `temperature`, `top_p` outside (0, 1], or a request with a modality the family does not take
    (`check_requests`); DataError for a request whose media parts point past its media, a clip or video that does
    not decode (`read_video`), or a prompt longer than the model's context; ModelError when the model fails.
    """
    from vlmctl.inference.engine import engine_for
    from vlmctl.inference.sampling import SamplingParams

    _check_sampling(batch_size, max_new_tokens, temperature, top_p)
    family = family if family is not None else model_family(model)
    check_requests(requests, family)
    if not requests:
        return []
    rendered = [render_request(r, processor, family) for r in requests]
    engine = engine_for(model, processor, family=family, max_slots=batch_size, max_length=2048, video=video,
                        strict_context=False, max_context=context_limit(model))
    done = engine.generate(rendered, SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p),
                           progress=progress)
    for request, asked in zip(done, requests):
        request.id = request.id or asked.id
    raise_failed(done)
    return [Generation(r.text, d.completions[0].text) for r, d in zip(rendered, done)]


def generate_vllm(
    llm: Any,
    processor,
    requests: Sequence[GenerationRequest],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    family: Any = None,
    video: "DataVideo | None" = None,
) -> list[Generation]:
    """Answers for `requests` through vLLM's offline `LLM.generate` (prompt text + `multi_modal_data`: images,
    videos as frames [T, H, W, 3] uint8 and audio clips as (waveform, sampling rate) pairs, read as `generate`
    reads them, videos sampled by `video`); vLLM batches and schedules the requests itself.

    `llm`, `processor` as returned by `load_vllm`; `family` the model's `FamilySpec` (the modality check and the
    video and audio prompts; without it nothing is checked and a video or audio part is the processor's token).
    Raises UsageError for bad sampling values or modalities (see `generate`), DataError for a request whose media
    parts point past its media, or a video that does not decode.
    """
    from vllm import SamplingParams

    _check_sampling(None, max_new_tokens, temperature, top_p)
    check_requests(requests, family)
    rendered = [render_request(r, processor, family) for r in requests]
    prompts = []
    for r in rendered:
        media: dict[str, Any] = {}
        if r.images:
            media["image"] = r.images if len(r.images) > 1 else r.images[0]
        if r.audios:
            audio = audio_inputs(processor, r.audios)
            clips = [(wave, audio.get("sampling_rate")) for wave in audio["audio"]]
            media["audio"] = clips if len(clips) > 1 else clips[0]
        if r.videos:
            frames = video_inputs(r.videos, video)["videos"]
            media["video"] = frames if len(frames) > 1 else frames[0]
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
    video: "DataVideo | None" = None,
) -> Iterator[str]:
    """The answer to one request as pieces of text, yielded while the decoding engine generates it (a piece is
    sent once it decodes to whole characters; `vlmctl.inference.engine`), in the calling thread.

    The pieces joined and stripped equal `generate(...)[0].text` for the same request and settings (greedy: the
    same tokens; both decode without special tokens). Closing the iterator early (a `break`, Ctrl-C in the
    consumer) stops generation after the current token and frees the request's cache slot. `family`, `video`: as
    in `generate`. Raises UsageError for bad sampling values or modalities (see `generate`), DataError for a request
    whose media parts point past its media, a video that does not decode or a prompt over the model's context,
    ModelError when the model fails (after the pieces generated before).
    """
    from vlmctl.inference.engine import engine_for
    from vlmctl.inference.sampling import SamplingParams

    _check_sampling(None, max_new_tokens, temperature, top_p)
    family = family if family is not None else model_family(model)
    check_requests([request], family)
    engine = engine_for(model, processor, family=family, max_slots=1, max_length=2048, video=video, strict_context=False,
                        max_context=context_limit(model))
    pieces: list[str] = []

    def on_event(event) -> None:
        if event[0] == "delta":
            pieces.append(event[2])

    handle = engine.submit(request, SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p),
                           on_event=on_event, id=request.id)
    try:
        while not handle.finished:
            engine.step()
            while pieces:
                yield pieces.pop(0)
        while pieces:
            yield pieces.pop(0)
    finally:
        if not handle.finished:  # the consumer stopped early: free the slot
            engine.cancel(handle)
            while engine.busy:
                engine.step()
    raise_failed([handle])


__all__ = ["ProgressFn", "audio_inputs", "context_limit", "generate", "generate_vllm", "raise_failed", "read_video",
           "stream_generate", "video_inputs"]
