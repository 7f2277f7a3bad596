"""Run an evaluation: samples -> answers (or teacher-forced loss) -> metrics -> output folder.

Output folder layout (every file written to a temporary name and renamed into place)::

    predictions.jsonl   one JSON object per sample: {"id", "prompt", "prediction", "references", "score"}
                        (+ "options" for multiple choice); `score` is the task's primary metric for that sample.
                        For --task loss: {"id", "loss", "tokens"} (mean loss in nats over the sample's
                        assistant tokens, and their count).
    metrics.json        {"task": str, "model": str, "data": str, "n": int, "metrics": {name: float}}
                        a flat mapping read by the model card; metric names and scales are in
                        `vlmctl.evaluation.metrics` (fractions in [0, 1]; CIDEr on its published scale; loss in
                        nats per assistant token and perplexity = exp(loss)).
    report.html         a self-contained page (images inlined as base64) with the first examples' image,
                        question, prediction, references and score.

Generation is greedy with left padding through `model.generate`, prompts rendered by the processor's chat
template from the sample's messages up to (not including) the last assistant turn. Under torchrun
(WORLD_SIZE > 1) every rank evaluates `samples[rank::world_size]` and rank 0 gathers the results and writes the
folder.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from vlmctl.data.sample import Sample
from vlmctl.errors import DataError, ModelError, UsageError
from vlmctl.evaluation.metrics import TASKS, ScoredRecord, infer_task, score_records

ProgressFn = Callable[[int, int], None]
"""Called as progress(done, total) after each batch (samples on this rank)."""

# Files a folder needs besides the weights to be usable for generation.
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class EvalResult:
    """What `run_eval` / `score_predictions_file` produced."""

    task: str
    model: str
    data: str
    metrics: dict[str, float]
    records: list[ScoredRecord] = field(default_factory=list)
    out_dir: Path | None = None
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The content of metrics.json."""
        return {"task": self.task, "model": self.model, "data": self.data, "n": len(self.records), "metrics": self.metrics}


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


def references_of(sample: Sample) -> list[str]:
    """The reference answers of a sample: `meta["answers"]` (a list of strings, or of {"answer": str} as in VQAv2
    annotations) when present, else `meta["answer"]`, else the text of the last assistant turn."""
    answers = sample.meta.get("answers")
    if answers:
        return [a["answer"] if isinstance(a, dict) else str(a) for a in answers]
    if sample.meta.get("answer") is not None:
        return [str(sample.meta["answer"])]
    for m in reversed(sample.messages):
        if m["role"] == "assistant":
            return [" ".join(p["text"] for p in m["content"] if p["type"] == "text").strip()]
    return []


def prompt_messages(sample: Sample) -> Sample:
    """The sample cut before its last assistant turn (the turn the model must produce)."""
    last = max((i for i, m in enumerate(sample.messages) if m["role"] == "assistant"), default=len(sample.messages))
    return Sample(id=sample.id, messages=sample.messages[:last], images=sample.images, source=sample.source, meta=sample.meta)


def load_samples(data: str, prepared_dir: Path, limit: int | None = None) -> list[Sample]:
    """Samples to evaluate: `data="val"` reads `prepared_dir/val/*.parquet`; otherwise `data` is a file or folder
    in any format `vlmctl.data.formats.read_source` reads (samples it rejects are skipped), or a prepared split
    folder / Parquet file. At most `limit` samples, in file order.

    Raises DataError when nothing is there (with the command that makes it) or no sample can be read.
    """
    if data == "val":
        folder = Path(prepared_dir) / "val"
        files = sorted(folder.glob("*.parquet"))
        if not files:
            raise DataError(f"no prepared val split in {folder}", hint="run `vlmctl data prepare` first, or pass --data PATH")
        samples = _read_parquet(files, limit)
    else:
        path = Path(data).expanduser()
        if not path.exists() and not any(ch in data for ch in "*?["):
            raise DataError(f"{data}: no such file or folder", hint="pass --data val (the prepared split) or an existing file")
        parquet = sorted(path.glob("*.parquet")) if path.is_dir() else ([path] if path.suffix == ".parquet" else [])
        samples = _read_parquet(parquet, limit) if parquet and _is_prepared(parquet[0]) else _read_source(data, limit)
    if not samples:
        raise DataError(f"{data}: no samples to evaluate", hint="check the file, or run `vlmctl data validate` on it")
    return samples


def _is_prepared(path: Path) -> bool:
    import pyarrow.parquet as pq

    names = set(pq.read_schema(path).names)
    return {"id", "messages", "images"} <= names


def _read_parquet(files: Sequence[Path], limit: int | None) -> list[Sample]:
    import pyarrow.parquet as pq

    out: list[Sample] = []
    for f in files:
        try:
            table = pq.read_table(f)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataError(f"{f}: cannot read Parquet ({exc})", hint="re-run `vlmctl data prepare`") from exc
        for row in table.to_pylist():
            out.append(Sample.from_row(row))
            if limit is not None and len(out) >= limit:
                return out
    return out


def _read_source(path: str, limit: int | None) -> list[Sample]:
    try:
        from vlmctl.data.formats import read_source
    except ImportError as exc:
        raise DataError(f"{path}: reading this format needs vlmctl.data.formats, which is not available",
                        hint="pass a prepared split (folder of Parquet shards) or --data val") from exc
    from vlmctl.config import DataSource

    out: list[Sample] = []
    first_rejection = None
    for item in read_source(DataSource(path=str(path), max_samples=limit)):
        if isinstance(item, Sample):
            out.append(item)
            if limit is not None and len(out) >= limit:
                break
        elif first_rejection is None:
            first_rejection = item
    if not out and first_rejection is not None:
        r = first_rejection
        raise DataError(f"{path}: every sample was rejected, e.g. {getattr(r, 'location', '')}: {getattr(r, 'reason', '')} "
                        f"({getattr(r, 'detail', '')})", hint=f"run `vlmctl data validate {path}` for the full list")
    return out


def default_model_dir(train_output_dir: Path, model_output_dir: Path) -> Path:
    """The newest `final/` export under `train_output_dir/*/` (by modification time), else `model_output_dir`."""
    finals = [p for p in Path(train_output_dir).glob("*/final") if p.is_dir()]
    if finals:
        return max(finals, key=lambda p: p.stat().st_mtime)
    return Path(model_output_dir)


def check_model_dir(path: Path) -> None:
    """Raise ModelError unless `path` is a Hugging Face model folder (config.json) with a processor and tokenizer;
    a base-mode `model build` folder is checked through the local checkpoint it points at."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"no model folder at {path}", hint="train or build one first (`vlmctl train`, `vlmctl model build`), or pass MODEL")
    info = _build_info(path)
    if info.get("mode") == "base" and not (path / "config.json").is_file():
        # `model build` in base mode only records which checkpoint it describes; check that one when it is local.
        source = Path(str(info.get("source", ""))).expanduser()
        if source.is_dir():
            check_model_dir(source)
        return
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: it is not a Hugging Face model folder",
                         hint="pass a final export (RUN/final), or convert a checkpoint with `vlmctl convert`")
    if not any((path / f).is_file() for f in _PROCESSOR_FILES) or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelError(
            f"{path} has no processor (needs {' or '.join(_PROCESSOR_FILES)} and a tokenizer): cannot build prompts or read images",
            hint=f"save the base model's processor into it: AutoProcessor.from_pretrained(BASE).save_pretrained('{path}'), "
                 "or re-export it with `vlmctl convert`",
        )


def _build_info(path: Path) -> dict[str, Any]:
    from vlmctl.models import read_build_info

    return read_build_info(path) or {}


def load_model(path: Path, device: str, dtype: str = "auto"):
    """(model, processor) from a model folder through `vlmctl.models.load_model`, in eval mode on `device`.

    `dtype`: bf16 | fp16 | fp32 | auto (bf16 on GPUs that support it, else fp32). Raises ModelError (see
    `check_model_dir`; and for folders of unsupported families)."""
    import torch

    check_model_dir(path)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype)
    if torch_dtype is None:  # auto: bf16 where the GPU supports it, fp32 on CPU
        torch_dtype = torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32
    from vlmctl.models import load_model as load_vlm

    model, processor, _family = load_vlm(str(path), dtype=torch_dtype, device=device)
    model.eval()
    return model, processor


# ---------------------------------------------------------------------------------------------------------------
# Generation and loss
# ---------------------------------------------------------------------------------------------------------------


def render_prompt(sample: Sample, processor) -> tuple[str, list]:
    """(prompt text with the generation prompt appended, PIL images in order) for a sample cut before its answer."""
    from vlmctl.data.collate import decode_images, template_messages

    messages, image_bytes = template_messages(prompt_messages(sample))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, decode_images(image_bytes)


def generate_hf(model, processor, samples: Sequence[Sample], *, batch_size: int, max_new_tokens: int,
                progress: ProgressFn | None = None) -> list[tuple[str, str]]:
    """Greedy answers for `samples` through `model.generate`, `batch_size` prompts at a time with left padding.

    Returns [(prompt text, answer text)] in sample order; answers are decoded without special tokens and stripped.
    """
    import torch

    tok = processor.tokenizer
    tok.padding_side = "left"  # generation continues from the last position of every row
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    device = next(model.parameters()).device
    out: list[tuple[str, str]] = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        rendered = [render_prompt(s, processor) for s in batch]
        texts = [t for t, _ in rendered]
        images = [img for _, imgs in rendered for img in imgs]
        inputs = processor(text=texts, images=images or None, padding=True, return_tensors="pt", add_special_tokens=False)
        inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in inputs.items()}
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        with torch.inference_mode():
            generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=tok.pad_token_id)
        new_tokens = generated[:, inputs["input_ids"].shape[1]:]
        answers = tok.batch_decode(new_tokens, skip_special_tokens=True)
        out.extend(zip(texts, (a.strip() for a in answers)))
        if progress:
            progress(len(out), len(samples))
    return out


def generate_vllm(model_dir: Path, processor, samples: Sequence[Sample], *, max_new_tokens: int) -> list[tuple[str, str]]:
    """Greedy answers through vLLM's offline `LLM.generate` (prompt + `multi_modal_data`). Raises UsageError when
    vllm is not installed."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        raise UsageError("--backend vllm needs the vllm package, which is not installed",
                         hint="pip install vllm (GPU machines), or use --backend hf") from exc
    llm = LLM(model=str(model_dir))
    rendered = [render_prompt(s, processor) for s in samples]
    requests = [{"prompt": t, **({"multi_modal_data": {"image": imgs if len(imgs) > 1 else imgs[0]}} if imgs else {})}
                for t, imgs in rendered]
    outputs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
    return [(t, o.outputs[0].text.strip()) for (t, _), o in zip(rendered, outputs)]


def teacher_forced_loss(model, processor, samples: Sequence[Sample], *, batch_size: int,
                        progress: ProgressFn | None = None) -> list[tuple[float, int]]:
    """Per-sample (summed cross-entropy in nats, number of label tokens) on the assistant tokens.

    Inputs and labels come from `vlmctl.data.collate.Collator` (assistant turns labelled, everything else -100);
    logits at position t predict the token at t + 1.
    """
    import torch
    import torch.nn.functional as F

    from vlmctl.data.collate import IGNORE_INDEX, Collator, model_inputs

    collator = Collator(processor, dummy_image=False)
    device = next(model.parameters()).device
    out: list[tuple[float, int]] = []
    for start in range(0, len(samples), batch_size):
        batch = collator(list(samples[start : start + batch_size]))
        labels = batch["labels"].to(device)
        inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in model_inputs(batch).items()}
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        with torch.inference_mode():
            logits = model(**inputs).logits.float()
        shifted = labels[:, 1:]
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), shifted, ignore_index=IGNORE_INDEX, reduction="none")
        mask = shifted != IGNORE_INDEX
        for row in range(labels.shape[0]):
            out.append((float(nll[row][mask[row]].sum()), int(mask[row].sum())))
        if progress:
            progress(len(out), len(samples))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Distributed helpers
# ---------------------------------------------------------------------------------------------------------------


def _dist_info() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def _setup_distributed(world: int, local_rank: int) -> tuple[str, bool]:
    """(this rank's device, whether a process group was created here): one is created when WORLD_SIZE > 1 and
    none exists yet (nccl on GPUs, gloo on CPU)."""
    import torch

    device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    created = False
    if world > 1:
        import torch.distributed as dist

        if device.startswith("cuda"):
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
            created = True
    return device, created


def _gather(items: list, world: int) -> list | None:
    """All ranks' lists concatenated in rank order on rank 0 (None elsewhere)."""
    if world == 1:
        return items
    import torch.distributed as dist

    gathered: list | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(items, gathered, dst=0)
    return [x for part in gathered for x in part] if gathered is not None else None


# ---------------------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------------------


def run_eval(
    model_dir: Path,
    samples: Sequence[Sample],
    *,
    task: str = "auto",
    data_name: str = "val",
    out_dir: Path | None = None,
    batch_size: int = 8,
    max_new_tokens: int = 32,
    backend: str = "hf",
    dtype: str = "auto",
    progress: ProgressFn | None = None,
) -> EvalResult | None:
    """Evaluate the model in `model_dir` on `samples` and write the output folder (module docstring) to `out_dir`.

    `task`: one of `metrics.TASKS`, `loss` (teacher-forced loss / perplexity on assistant tokens) or `auto`
    (from the samples, see `metrics.infer_task`). Returns the result on rank 0 and None on other ranks.
    Raises ModelError for a folder that cannot be loaded, UsageError for a bad task/backend, DataError for
    samples without references.
    """
    task = resolve_task(task, samples)
    if backend not in ("hf", "vllm"):
        raise UsageError(f"unknown backend {backend!r}", hint="choose hf or vllm")
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError("--backend vllm needs the vllm package, which is not installed",
                         hint="pip install vllm (GPU machines), or use --backend hf")
    check_model_dir(Path(model_dir))
    records = [_record_of(s) for s in samples]
    if task != "loss":
        missing = [r.id for r in records if not r.references]
        if missing:
            raise DataError(f"sample {missing[0]!r} has no reference answer ({len(missing)} such samples)",
                            hint="the last turn must be the assistant's answer, or meta must carry `answers`")
    t0 = time.perf_counter()
    rank, world, local_rank = _dist_info()
    device, created_group = _setup_distributed(world, local_rank)
    mine = list(range(rank, len(samples), world))
    try:
        results = _run_shard(Path(model_dir), task, [samples[i] for i in mine], mine, device=device, dtype=dtype,
                             world=world, backend=backend, batch_size=batch_size, max_new_tokens=max_new_tokens,
                             progress=progress)
    finally:
        if created_group:
            import torch.distributed as dist

            dist.destroy_process_group()
    if results is None:  # not rank 0
        return None
    results.sort(key=lambda x: x[0])
    if task == "loss":
        total_nll = sum(nll for _, (nll, _) in results)
        total_tokens = sum(n for _, (_, n) in results)
        if total_tokens == 0:
            raise DataError("no assistant tokens to score", hint="the samples need assistant turns for --task loss")
        loss = total_nll / total_tokens
        metrics = {"loss": loss, "perplexity": math.exp(loss), "tokens": float(total_tokens)}
        rows = [{"id": records[i].id, "loss": nll / n if n else None, "tokens": n} for i, (nll, n) in results]
        for (i, (nll, n)) in results:
            records[i].score = nll / n if n else None
    else:
        for i, (prompt, answer) in results:
            records[i].prompt, records[i].prediction = prompt, answer
        metrics = score_records(task, records)
        rows = [r.to_json() for r in records]
    result = EvalResult(task=task, model=str(Path(model_dir).resolve()), data=data_name, metrics=metrics, records=records,
                        seconds=time.perf_counter() - t0)
    if out_dir is not None:
        write_outputs(result, Path(out_dir), rows, samples=samples)
    return result


def _run_shard(model_dir: Path, task: str, my_samples: list[Sample], mine: list[int], *, device: str, dtype: str,
               world: int, backend: str, batch_size: int, max_new_tokens: int, progress: ProgressFn | None) -> list | None:
    """This rank's samples evaluated: [(sample index, (prompt, answer) | (nll, tokens))], all ranks' results
    gathered on rank 0 (None on other ranks)."""
    if backend == "vllm" and world > 1:
        raise UsageError("--backend vllm runs in one process", hint="run it without torchrun (vLLM shards the model itself)")
    if backend == "vllm" and task != "loss":
        from transformers import AutoProcessor  # vLLM loads the weights itself; only the chat template is needed here

        processor = AutoProcessor.from_pretrained(model_dir)
        return list(zip(mine, generate_vllm(model_dir, processor, my_samples, max_new_tokens=max_new_tokens)))
    model, processor = load_model(model_dir, device=device, dtype=dtype)
    if task == "loss":
        per_sample = teacher_forced_loss(model, processor, my_samples, batch_size=batch_size, progress=progress)
        return _gather(list(zip(mine, per_sample)), world)
    answers = generate_hf(model, processor, my_samples, batch_size=batch_size, max_new_tokens=max_new_tokens, progress=progress)
    return _gather(list(zip(mine, answers)), world)


def resolve_task(task: str, samples: Sequence[Sample]) -> str:
    """`task` itself, or for `auto` the task the samples call for (`metrics.infer_task`). Raises UsageError for an
    unknown task."""
    if task not in (*TASKS, "loss", "auto"):
        raise UsageError(f"unknown task {task!r}", hint=f"choose one of: auto, {', '.join(TASKS)}, loss")
    return infer_task([_record_of(s) for s in samples]) if task == "auto" else task


def fold_into_metrics(out_dir: Path, scores: dict[str, float], *, model: str, data: str) -> EvalResult:
    """Merge `scores` into `out_dir/metrics.json` (created when absent; existing metrics are kept unless a name
    repeats) and return the merged result."""
    path = Path(out_dir) / "metrics.json"
    current: dict[str, Any] = {}
    if path.is_file():
        try:
            current = json.loads(path.read_text())
        except json.JSONDecodeError:
            current = {}
    metrics = {**(current.get("metrics") or {}), **scores}
    result = EvalResult(task=current.get("task", "lmms_eval"), model=current.get("model", model),
                        data=current.get("data", data), metrics=metrics, out_dir=Path(out_dir))
    summary = {**result.summary(), "n": current.get("n", 0)}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(summary, indent=2) + "\n")
    return result


def _record_of(sample: Sample) -> ScoredRecord:
    return ScoredRecord(id=sample.id, prediction="", references=references_of(sample),
                        options=sample.meta.get("options"), meta=sample.meta)


def read_predictions(path: Path) -> list[ScoredRecord]:
    """Records from a predictions JSONL: one object per line with `id`, `prediction`, the references as
    `references` (list), `answers` (list of strings or {"answer": str}) or `answer` (string), optional `options`
    and `task`. Raises DataError naming the file and line of a bad row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such predictions file", hint="pass a JSONL file written by `vlmctl eval` or another system")
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})", hint="each line must be one JSON object") from exc
            if not isinstance(row, dict) or "prediction" not in row:
                raise DataError(f"{path}:{lineno}: missing key 'prediction'",
                                hint='each line needs {"id", "prediction", "references"|"answers"|"answer"}')
            refs = row.get("references", row.get("answers", row.get("answer")))
            if refs is None:
                raise DataError(f"{path}:{lineno}: missing references", hint="add `references` (list), `answers` or `answer`")
            refs = [refs] if isinstance(refs, str) else refs
            refs = [r["answer"] if isinstance(r, dict) else str(r) for r in refs]
            meta = {"task": row["task"]} if "task" in row else {}
            records.append(ScoredRecord(id=str(row.get("id", lineno)), prediction=str(row["prediction"] or ""),
                                        references=refs, options=row.get("options"), prompt=str(row.get("prompt") or ""),
                                        meta=meta))
    if not records:
        raise DataError(f"{path}: no predictions", hint="the file is empty")
    return records


def score_predictions_file(path: Path, *, task: str = "auto", out_dir: Path | None = None,
                           limit: int | None = None) -> EvalResult:
    """Score an existing predictions JSONL (see `read_predictions`) with the same metrics, loading no model; writes
    predictions.jsonl (with scores), metrics.json and report.html (no images) to `out_dir` when given."""
    if task == "loss":
        raise UsageError("--task loss needs a model, not a predictions file", hint="drop --predictions, or choose another --task")
    if task not in (*TASKS, "auto"):
        raise UsageError(f"unknown task {task!r}", hint=f"choose one of: auto, {', '.join(TASKS)}")
    records = read_predictions(path)[:limit]
    if task == "auto":
        task = infer_task(records)
    metrics = score_records(task, records)
    result = EvalResult(task=task, model="(predictions file)", data=str(path), metrics=metrics, records=records)
    if out_dir is not None:
        write_outputs(result, Path(out_dir), [r.to_json() for r in records])
    return result


def write_outputs(result: EvalResult, out_dir: Path, rows: Iterable[dict], samples: Sequence[Sample] | None = None) -> None:
    """Write predictions.jsonl, metrics.json and report.html into `out_dir` (each via a temporary file + rename)."""
    from vlmctl.evaluation.report import write_report

    out_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(out_dir / "predictions.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    _atomic_write(out_dir / "metrics.json", json.dumps(result.summary(), indent=2) + "\n")
    images = {s.id: s.images[0] for s in samples or [] if s.images}
    write_report(out_dir / "report.html", result, images)
    result.out_dir = out_dir


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


__all__ = [
    "EvalResult", "run_eval", "score_predictions_file", "read_predictions", "load_samples", "default_model_dir",
    "check_model_dir", "load_model", "generate_hf", "teacher_forced_loss", "references_of", "write_outputs",
    "resolve_task", "fold_into_metrics",
]
