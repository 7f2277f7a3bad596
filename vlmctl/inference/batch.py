"""Answer a file of samples and write the answers as JSONL (`vlmctl generate`).

    samples, skipped = read_prompts(DataSource(path="questions.jsonl"))
    result = write_predictions("outputs/runs/run1/final", samples, Path("predictions.jsonl"), batch_size=8)

Each sample is asked as `request_from_sample`: its conversation up to (not including) its last assistant turn,
with its images, videos (a ShareGPT `videos` list, `video` parts) and audio clips (an audio family's, e.g. a ShareGPT
`audios` list or OpenAI `input_audio` parts).
One JSON object per sample, in input order::

    {"id": str, "prompt": str, "prediction": str, "references": [str, ...], "options": [...]}

`prompt` is the rendered prompt (chat template applied); `references` is there when the sample has reference
answers (`references` callable; e.g. `vlmctl.evaluation.references_of`) and `options` when its meta has them,
so the file can be scored by `vlmctl eval --predictions`. The file is written to a temporary name next to the
output and renamed into place when every sample is answered.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from vlmctl.errors import DataError
from vlmctl.inference.generation import ProgressFn, _check_sampling, generate, generate_vllm
from vlmctl.inference.load import check_backend, check_model_dir, folder_family, load_for_generation, load_vllm
from vlmctl.inference.prompt import Generation, check_requests, request_from_sample

if TYPE_CHECKING:
    from vlmctl.config.data import DataSource, DataVideo
    from vlmctl.data.checks import Rejection
    from vlmctl.data.sample import Sample

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Light vlmctl modules are imported next to their use as well.


@dataclass
class PredictionsResult:
    """What `write_predictions` wrote: the file, the number of rows, the backend, the wall time in seconds, and how the
    decoding engine decoded (`DecodeEngine.summary`; "" for vLLM)."""

    path: Path
    n: int
    backend: str
    seconds: float
    decoding: str = ""


def read_prompts(source: "DataSource", limit: int | None = None, *, min_image_side: int = 1,
                 media_roots: Sequence[Path | str] = (), video: "DataVideo | None" = None) -> tuple[list["Sample"], list["Rejection"]]:
    """(samples, rejections) of one data source in any input format (`vlmctl.data.formats.read_source`; a
    prepared split folder reads back with the parquet reader): at most `limit` samples, in file order, and the
    records the reader rejected (missing or corrupt images or audio clips, bad records). Pictures are read whatever
    their size (`min_image_side` pixels; the processor resizes them), unlike training data; audio clips pass the
    data pipeline's checks and become 16 kHz mono (`vlmctl.data.modalities.audio.normalize_audio`, `data.audio`
    defaults); videos pass the video checks and become stored clips sampled by `video` (`data.video`; defaults when
    None, `vlmctl.data.modalities.video.normalize_video`; a prepared split's clips are kept as they are); media
    paths may point into the source's folder or one of `media_roots` (`data.media_roots`). Raises DataError when the source
    cannot be opened or holds no readable sample (naming the first rejection)."""
    from vlmctl.data.formats import read_source
    from vlmctl.data.sample import Sample

    samples, rejected = [], []
    for item in read_source(source, min_image_side=min_image_side, media_roots=media_roots, video=video):
        if isinstance(item, Sample):
            samples.append(item)
            if limit is not None and len(samples) >= limit:
                break
        else:
            rejected.append(item)
    if not samples:
        first = f", e.g. {rejected[0].location}: {rejected[0].reason} ({rejected[0].detail})" if rejected else ""
        raise DataError(f"{source.path}: no readable sample{first}", hint=f"run `vlmctl data validate {source.path}` for the full list")
    return samples, rejected


def write_predictions(
    model_dir: Path,
    samples: Sequence["Sample"],
    out: Path,
    *,
    references: Callable[["Sample"], list[str]] | None = None,
    batch_size: int = 8,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    backend: str = "hf",
    device: str = "auto",
    dtype: str = "auto",
    seed: int | None = None,
    progress: ProgressFn | None = None,
    video: "DataVideo | None" = None,
) -> PredictionsResult:
    """Answer `samples` with the model in `model_dir` and write one row per sample to `out` (module docstring).

    `backend` `hf`: vlmctl's decoding engine (`vlmctl.inference.generate`: transformers models, continuous batching of
    `batch_size` rows) on `device`; `vllm`: vLLM's offline engine (it batches and places the model itself; `device`
    and `batch_size` are not used). `seed`
    seeds torch's generator before sampling (a positive `temperature`). `progress(done, total)` is called after
    each batch. `video`: the `data.video` settings that videos which are not stored clips are sampled by (defaults
    when None; `generate`). Raises UsageError for a bad backend (vllm not installed), device, dtype or sampling value, or a
    sample with a modality the model's family does not take (audio for a vision-language model: checked before the
    model is loaded, `check_requests`), ModelError for a folder that cannot be loaded, DataError for a sample whose
    media parts point past its media.
    """
    t0 = time.perf_counter()
    _check_sampling(batch_size, max_new_tokens, temperature, top_p)
    check_backend(backend)
    check_model_dir(Path(model_dir))
    requests = [request_from_sample(s) for s in samples]
    family = folder_family(Path(model_dir))
    check_requests(requests, family)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    decoding = ""
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            if backend == "vllm":
                llm, processor = load_vllm(Path(model_dir), dtype=dtype)
                answers = generate_vllm(llm, processor, requests, max_new_tokens=max_new_tokens, temperature=temperature,
                                        top_p=top_p, family=family, video=video)
                _write_rows(fh, samples, answers, references)
                if progress:
                    progress(len(samples), len(samples))
            else:
                model, processor = load_for_generation(Path(model_dir), device=device, dtype=dtype)
                if seed is not None:
                    import torch

                    torch.manual_seed(seed)
                chunk = max(8 * batch_size, 64)  # rows decoded together across a chunk: slots refill as answers end
                for start in range(0, len(requests), chunk):
                    # One chunk at a time, written as it comes: a long run shows its rows in the temporary file.
                    done = start
                    answers = generate(model, processor, requests[start : start + chunk], batch_size=batch_size,
                                       max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, family=family,
                                       video=video, progress=(lambda k, n, s=done: progress(s + k, len(requests))) if progress else None)
                    _write_rows(fh, samples[start : start + chunk], answers, references)
                    fh.flush()
                engine = getattr(model, "_vlmctl_decode_engine", None)
                decoding = engine.summary() if engine is not None else ""
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return PredictionsResult(path=out, n=len(samples), backend=backend, seconds=time.perf_counter() - t0,
                             decoding=decoding if backend != "vllm" else "")


def _write_rows(fh, samples: Sequence["Sample"], answers: Sequence[Generation], references) -> None:
    for sample, (prompt, text) in zip(samples, answers):
        row = {"id": sample.id, "prompt": prompt, "prediction": text}
        refs = references(sample) if references else []
        if refs:
            row["references"] = refs
        if sample.meta.get("options"):
            row["options"] = sample.meta["options"]
        fh.write(json.dumps(row, ensure_ascii=False) + "\n")


__all__ = ["PredictionsResult", "read_prompts", "write_predictions"]
