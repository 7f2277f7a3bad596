"""Batched generation over `GenerationRequest`s, through transformers (`generate`) or vLLM (`generate_vllm`), and
streamed generation of one answer (`stream_generate`).

The batched functions return one `Generation(prompt, text)` per request, in request order. Decoding is greedy
unless a positive `temperature` is given (then nucleus sampling with `top_p`; seed it with `torch.manual_seed` for
the HF backend).

Audio clips (`GenerationRequest.audios`, audio families such as qwen2_audio) go through the data pipeline's audio
unit (`vlmctl.data.modalities.audio.AudioUnit.processor_inputs`): decoded with soundfile, down-mixed to mono and
resampled with soxr to the feature extractor's rate (16 kHz for Whisper-style extractors), then handed to the
processor's `audio=`, exactly as training hands them over; the processor returns `input_features` and
`feature_attention_mask`.

Videos (`GenerationRequest.videos`, Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA-OneVision) go through the data pipeline's video
unit (`vlmctl.data.modalities.video`): a video file is checked and sampled by the `data.video` settings passed as
`video=` (`normalize_video`: frames per second, frame and pixel bounds; defaults when None), a stored clip (prepared
shards, `read_video`'s output) is used as it is, as training uses it; the frames [T, H, W, 3] uint8 and their
metadata go to the processor's `videos=` as the collator hands them over (`VideoUnit.processor_inputs`), which
returns `pixel_values_videos`, `video_grid_thw` and, for Qwen2.5-VL, `second_per_grid_ts`. A request with a
modality the model's family does not take is a UsageError (`check_requests`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from vlmctl.errors import UsageError
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


def read_video(video: bytes | str | Path, settings: "DataVideo | None" = None) -> bytes:
    """A video as the data pipeline stores a clip (`vlmctl.data.modalities.video.normalize_video`: the frames
    sampled by `settings`, `data.video` defaults when None, as Motion JPEG in Matroska). `video`: a path or encoded
    bytes of any container and codec FFmpeg decodes. A stored clip (prepared shards' clips, this function's output)
    is returned as it is: its frames are the ones training uses, so they are not sampled again.

    Raises DataError naming the file (or the clip) when it is missing, not a video, has a codec FFmpeg cannot
    decode, is shorter than `settings.min_frames` frames or longer than `settings.max_seconds` (the video unit's
    reason codes).
    """
    from vlmctl.data.modalities.video import MAX_VIDEO_FILE_BYTES, VideoError, normalize_video, probe
    from vlmctl.errors import DataError

    name = "a video clip" if isinstance(video, (bytes, bytearray)) else str(video)
    hint = "use a video file FFmpeg decodes (MP4, WebM, MKV, MOV...; pip install 'vlmctl[video]' for PyAV)"
    if not isinstance(video, (bytes, bytearray)):
        path = Path(video).expanduser()
        if not path.is_file():
            raise DataError(f"{path}: no such video file", hint="check the path (relative to the folder vlmctl started in)")
        if path.stat().st_size > MAX_VIDEO_FILE_BYTES:
            raise DataError(f"{path}: {path.stat().st_size / 2**30:,.1f} GiB, over the limit of {MAX_VIDEO_FILE_BYTES >> 30} GiB "
                            "per video file", hint="cut the video into shorter clips")
        video = path.read_bytes()
    try:
        if probe(bytes(video)).tagged:
            return bytes(video)
        return normalize_video(bytes(video), settings).data
    except VideoError as exc:
        if exc.reason in ("video_too_short", "video_too_long"):
            hint = "change data.video (min_frames, max_seconds) in the project, or cut the video"
        raise DataError(f"{name}: {exc.detail} ({exc.reason})", hint=hint) from None


def video_inputs(videos: Sequence[bytes | str | Path], settings: "DataVideo | None" = None) -> dict[str, Any]:
    """The processor call's video keywords for `videos` (paths or encoded bytes, read by `read_video` with
    `settings`): `videos=` (frames [T, H, W, 3] uint8 per clip), `video_metadata=` (the sampled frame count and
    rate per clip) and `do_sample_frames=False`, from the data pipeline's video unit; {} without videos. Raises
    DataError as `read_video` does."""
    if not videos:
        return {}
    from vlmctl.data.modalities import get_unit

    return get_unit("video").processor_inputs([read_video(v, settings) for v in videos])


def _model_inputs(model, processor, texts: list[str], images: list, audios: list[bytes] = (), videos: Sequence = (),
                  video: "DataVideo | None" = None) -> dict[str, Any]:
    """The processor's tensors for rendered prompts (padded on the tokenizer's padding side), on the model's
    device; floating image, video and audio-feature tensors in the model's dtype. `audios`: the encoded clips of
    the prompts' audio parts, in order (`audio_inputs`); `videos`: those of their video parts (`video_inputs`,
    sampled by `video`)."""
    device = next(model.parameters()).device
    media = {"images": images} if images else {}
    inputs = processor(text=texts, **media, **audio_inputs(processor, list(audios)), **video_inputs(list(videos), video),
                       padding=True, return_tensors="pt", add_special_tokens=False)
    inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in inputs.items()}
    for key in ("pixel_values", "pixel_values_videos", "input_features"):
        if key in inputs and inputs[key].is_floating_point():
            inputs[key] = inputs[key].to(model.dtype)
    return inputs


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
