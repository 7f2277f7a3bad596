"""Run an evaluation: samples -> answers (or teacher-forced loss) -> metrics -> output folder.

Output folder layout (every file written to a temporary name and renamed into place)::

    predictions.jsonl   one JSON object per sample: {"id", "prompt", "prediction", "references", "score"}
                        (+ "options" for multiple choice); `score` is the task's primary metric for that sample.
                        For --task loss: {"id", "loss", "tokens"} (mean loss in nats over the sample's
                        assistant tokens, and their count).
    metrics.json        {"task": str, "model": str, "data": str, "n": int, "metrics": {name: float}}
                        a flat mapping read by the model card; metric names and scales are in
                        `vlmctl.evaluation.metrics` (fractions in [0, 1]; CIDEr on its published scale; loss in
                        nats per assistant token and perplexity = exp(loss)). When the data had samples that
                        could not be evaluated, also "skipped": {"count", "reasons": {reason: count},
                        "file": "skipped.jsonl"}.
    skipped.jsonl       (only then) one JSON object per skipped sample: {"source", "location", "reason", "detail",
                        "id"}, with the reason codes of `vlmctl data validate`.
    report.html         a self-contained page (images inlined as base64) with the first examples' image,
                        question, prediction, references and score, and the skipped samples with their reasons.

`default_output_dir` names a folder after the model, the task and the data, and never reuses an existing one.

Generation goes through `vlmctl.inference` (greedy, left-padded batches through `model.generate`, or vLLM), each
sample asked as `inference.request_from_sample`: its messages up to (not including) the last assistant turn,
rendered by the processor's chat template. The teacher-forced loss is `evaluation.loss`. Under torchrun
(WORLD_SIZE > 1) every rank evaluates `samples[rank::world_size]` and rank 0 gathers the results and writes the
folder.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from vlmctl.data.sample import Sample
from vlmctl.errors import DataError, UsageError
from vlmctl.evaluation.loss import teacher_forced_loss
from vlmctl.evaluation.metrics import TASKS, ScoredRecord, check_task_packages, infer_task, score_records
from vlmctl.evaluation.report import write_report
from vlmctl.evaluation.results import SKIPPED_FILE, EvalResult, SampleList, atomic_write, skipped_reasons
from vlmctl.outputs import write_marker
from vlmctl.inference import (
    ProgressFn,
    check_backend,
    check_model_dir,
    generate,
    generate_vllm,
    load_for_generation,
    load_vllm,
    request_from_sample,
)

# pyarrow and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not
# pay for them.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules are imported next to their use as well.


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


def preflight(*, backend: str | None = None, lmms_eval: bool = False) -> None:
    """Raise UsageError (exit 2) before any model is loaded or process started when the evaluation needs a package
    that is not installed here: vllm for `backend="vllm"` (`inference.check_backend`, which also refuses an
    unknown backend), lmms-eval for `lmms_eval` (`lmms.check_installed`, whose hint installs it without replacing
    torch). Looks packages up with `importlib.util.find_spec`."""
    if backend is not None:
        check_backend(backend)
    if lmms_eval:
        from vlmctl.evaluation.lmms import check_installed

        check_installed()


def _scalar_text(value: Any) -> str | None:
    """A reference or option as text: a string as it is, a number in its JSON spelling; None for anything else (a
    boolean, null, a list or an object: no text of theirs is the answer)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return json.dumps(value)
    return None


def reference_texts(value: Any, where: str) -> list[str]:
    """Reference answers as a list of strings: one string (one reference, never its characters), a number, an
    `{"answer": ...}` object (VQAv2's annotations), or a list of those. Raises DataError naming `where` and the
    shape of anything else (a boolean, null, a nested list, an object without `answer`), rather than scoring its
    pieces."""
    items = value if isinstance(value, list) else [value]
    out = []
    for i, item in enumerate(items):
        text = _scalar_text(item["answer"] if isinstance(item, dict) and "answer" in item else item)
        if text is None:
            at = f"[{i}]" if isinstance(value, list) else ""
            raise DataError(f"{where}: reference answer{at} is {_shape(item)}, not text",
                            hint='give references as text: "cat", ["cat", "a cat"] or [{"answer": "cat"}, ...]')
        out.append(text)
    return out


def option_texts(value: Any, where: str) -> list[str] | dict[str, str] | None:
    """A sample's multiple-choice options: None, a list of texts (lettered A, B, ...) or {letter: text}. Raises
    DataError naming `where` for anything else (a string would be lettered character by character)."""
    if value is None:
        return None
    if isinstance(value, list) and all(_scalar_text(v) is not None for v in value):
        return [_scalar_text(v) for v in value]  # type: ignore[misc]
    if isinstance(value, dict) and all(isinstance(k, str) and _scalar_text(v) is not None for k, v in value.items()):
        return {k: _scalar_text(v) for k, v in value.items()}  # type: ignore[misc]
    raise DataError(f"{where}: options are {_shape(value)}, not a list of texts or {{letter: text}}",
                    hint='give options as ["red", "blue"] or {"A": "red", "B": "blue"}')


def _shape(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return f"{type(value).__name__} {json.dumps(value, default=str)[:60]}"
    return f"{type(value).__name__} {value!r}"[:80]


def references_of(sample: Sample) -> list[str]:
    """The reference answers of a sample (`reference_texts`): `meta["answers"]` (a string, or a list of strings or
    of {"answer": str} as in VQAv2 annotations) when present, else `meta["answer"]`, else the text of the last
    assistant turn. Raises DataError naming the sample for answers of another shape."""
    where = f"sample {sample.id!r}" + (f" ({sample.location})" if sample.location else "")
    answers = sample.meta.get("answers")
    if answers is not None and answers != [] and answers != "":
        return reference_texts(answers, where)
    if sample.meta.get("answer") is not None:
        return reference_texts(sample.meta["answer"], where)
    for m in reversed(sample.messages):
        if m["role"] == "assistant":
            return [" ".join(p["text"] for p in m["content"] if p["type"] == "text").strip()]
    return []


def load_samples(data: str, prepared_dir: Path, limit: int | None = None, *, media_roots: Sequence[Path | str] = (),
                 video=None, audio=None) -> SampleList:
    """Samples to evaluate: `data="val"` reads `prepared_dir/val/*.parquet`; otherwise `data` is a file or folder
    in any format `vlmctl.data.formats.read_source` reads, or a prepared split folder / Parquet file. At most
    `limit` samples, in file order. `media_roots`: folders besides the data's own that image paths may point into.
    `video` / `audio`: the project's `data.video` / `data.audio` settings (`DataVideo`, `DataAudio`; defaults when
    None), by which the clips of a file that is not prepared are checked and sampled, as `data prepare` would.

    Samples the reader rejects are not evaluated: they are returned in `SampleList.skipped` with their reasons
    (run_eval reports them in metrics.json, skipped.jsonl and report.html).
    Raises DataError when nothing is there (with the command that makes it) or no sample can be read.
    """
    if data == "val":
        folder = Path(prepared_dir) / "val"
        files = sorted(folder.glob("*.parquet"))
        if not files:
            raise DataError(f"no prepared val split in {folder}", hint="run `vlmctl data prepare` first, or pass --data PATH")
        samples = SampleList(_read_parquet(files, limit))
        if not samples:
            raise DataError(f"the prepared val split in {folder} is empty: data prepare held no samples out",
                            hint="set data.val_ratio above 0 (e.g. 0.05) and re-run `vlmctl data prepare`, or pass "
                            "--data PATH (a file to evaluate on)")
    else:
        path = Path(data).expanduser()
        if not path.exists() and not any(ch in data for ch in "*?["):
            raise DataError(f"{data}: no such file or folder", hint="pass --data val (the prepared split) or an existing file")
        parquet = sorted(path.glob("*.parquet")) if path.is_dir() else ([path] if path.suffix == ".parquet" else [])
        if parquet and _is_prepared(parquet[0]):
            samples = SampleList(_read_parquet(parquet, limit))
        else:
            samples = _read_source(data, limit, media_roots, video=video, audio=audio)
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


def _read_source(path: str, limit: int | None, media_roots: Sequence[Path | str] = (), *, video=None,
                 audio=None) -> SampleList:
    try:
        from vlmctl.data.formats import read_source
    except ImportError as exc:
        raise DataError(f"{path}: reading this format needs vlmctl.data.formats, which is not available",
                        hint="pass a prepared split (folder of Parquet shards) or --data val") from exc
    from vlmctl.config import DataSource

    out = SampleList()
    for item in read_source(DataSource(path=str(path), max_samples=limit), media_roots=media_roots, video=video,
                            audio=audio):
        if isinstance(item, Sample):
            out.append(item)
            if limit is not None and len(out) >= limit:
                break
        else:
            out.skipped.append(item.to_dict())
    if not out and out.skipped:
        r = out.skipped[0]
        counts = ", ".join(f"{k} {n}" for k, n in skipped_reasons(out.skipped).items())
        raise DataError(f"{path}: every sample was rejected ({counts}), e.g. {r['location']}: {r['reason']} ({r['detail']})",
                        hint=f"run `vlmctl data validate {path}` for the full list")
    return out


def data_label(data: str) -> str:
    """A short, path-safe name of the evaluated data: `val`, or the file/folder name without its extension."""
    if data == "val":
        return "val"
    name = Path(data.rstrip("/")).name
    for suffix in (".jsonl", ".ndjson", ".json", ".parquet", ".arrow", ".tar.gz", ".tgz", ".tar"):
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
            break
    return safe_name(name) or "data"


def safe_name(text: str) -> str:
    """`text` with every run of characters outside [A-Za-z0-9._-] replaced by `_` (a folder name, never a path)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")


def unique_output_dir(path: Path, *, create: bool = True) -> Path:
    """`path`, else `path-2`, `path-3`, ...: the first that does not exist. With `create` it is made here, atomically
    (`mkdir` without exist_ok), so two evaluations started together never share a folder."""
    path = Path(path)
    for n in itertools.count(1):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        if not create:
            if not candidate.exists():
                return candidate
            continue
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def default_output_dir(root: Path, model_label: str, task: str, data: str, *, create: bool = True) -> Path:
    """The folder of an evaluation under `root` (eval.output_dir): `<model>-<task>` for the prepared val split,
    `<model>-<task>-<data name>` for other data; `-2`, `-3`, ... when it exists, so an earlier evaluation is never
    overwritten (see `unique_output_dir`)."""
    name = f"{safe_name(model_label) or 'model'}-{task}"
    if data != "val":
        name += f"-{data_label(data)}"
    return unique_output_dir(Path(root) / name, create=create)


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
    skipped: Sequence[dict] | None = None,
) -> EvalResult | None:
    """Evaluate the model in `model_dir` on `samples` and write the output folder (module docstring) to `out_dir`.

    `task`: one of `metrics.TASKS`, `loss` (teacher-forced loss / perplexity on assistant tokens) or `auto`
    (from the samples, see `metrics.infer_task`). `skipped`: the samples the reader rejected (default:
    `samples.skipped` of a SampleList), reported in the outputs. Returns the result on rank 0 and None on other
    ranks.
    Raises ModelError for a folder that cannot be loaded, UsageError for a bad task/backend, DataError for
    samples without references.
    """
    task = resolve_task(task, samples)
    check_task_packages(task)  # before generating: the metrics must be computable
    check_backend(backend)
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
        try:
            metrics = score_records(task, records)
        except Exception:
            if out_dir is not None:  # the generated answers are kept whatever happens to the scoring
                Path(out_dir).mkdir(parents=True, exist_ok=True)
                atomic_write(Path(out_dir) / "predictions.jsonl",
                             "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
            raise
        rows = [r.to_json() for r in records]
    if skipped is None:
        skipped = getattr(samples, "skipped", [])
    result = EvalResult(task=task, model=str(Path(model_dir).resolve()), data=data_name, metrics=metrics, records=records,
                        seconds=time.perf_counter() - t0, skipped=list(skipped))
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
        llm, processor = load_vllm(model_dir, dtype=dtype)
        answers = generate_vllm(llm, processor, [request_from_sample(s) for s in my_samples], max_new_tokens=max_new_tokens)
        return list(zip(mine, answers))
    model, processor = load_for_generation(model_dir, device=device, dtype=dtype)
    if task == "loss":
        per_sample = teacher_forced_loss(model, processor, my_samples, batch_size=batch_size, progress=progress)
        return _gather(list(zip(mine, per_sample)), world)
    answers = generate(model, processor, [request_from_sample(s) for s in my_samples], batch_size=batch_size,
                       max_new_tokens=max_new_tokens, progress=progress)
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
    atomic_write(path, json.dumps(summary, indent=2) + "\n")
    return result


def _record_of(sample: Sample) -> ScoredRecord:
    where = f"sample {sample.id!r}" + (f" ({sample.location})" if sample.location else "")
    return ScoredRecord(id=sample.id, prediction="", references=references_of(sample),
                        options=option_texts(sample.meta.get("options"), where), meta=sample.meta)


def read_predictions(path: Path) -> list[ScoredRecord]:
    """Records from a predictions JSONL: one object per line with `id`, `prediction` (text), the references as
    `references` (list), `answers` (list of strings or {"answer": str}) or `answer` (string) (`reference_texts`),
    optional `options` (`option_texts`) and `task`. Raises DataError naming the file and line of a bad row: a value
    of another type is refused, never turned into text or scored piece by piece."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such predictions file", hint="pass a JSONL file written by `vlmctl eval` or another system")
    records = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start})", hint="write the file as UTF-8 JSONL") from None
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})", hint="each line must be one JSON object") from None
            except RecursionError:
                raise DataError(f"{path}:{lineno}: nested too deeply", hint="each line must be one flat JSON object") from None
            if not isinstance(row, dict) or "prediction" not in row:
                raise DataError(f"{path}:{lineno}: missing key 'prediction'",
                                hint='each line needs {"id", "prediction", "references"|"answers"|"answer"}')
            refs = row.get("references", row.get("answers", row.get("answer")))
            if refs is None:
                raise DataError(f"{path}:{lineno}: missing references", hint="add `references` (list), `answers` or `answer`")
            where = f"{path}:{lineno}"
            refs = reference_texts(refs, where)
            prediction = "" if row["prediction"] is None else _scalar_text(row["prediction"])
            if prediction is None:
                raise DataError(f"{where}: prediction is {_shape(row['prediction'])}, not text",
                                hint="each prediction is the model's answer as a string")
            for key in ("id", "prompt", "task"):
                if row.get(key) is not None and _scalar_text(row[key]) is None:
                    raise DataError(f"{where}: {key} is {_shape(row[key])}, not text", hint=f"give {key} as a string")
            meta = {"task": row["task"]} if "task" in row else {}
            records.append(ScoredRecord(id=str(row.get("id", lineno)), prediction=prediction, references=refs,
                                        options=option_texts(row.get("options"), where), prompt=str(row.get("prompt") or ""),
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
    """Write predictions.jsonl, metrics.json, report.html and (when samples were skipped) skipped.jsonl into
    `out_dir` (each via a temporary file + rename)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "predictions.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    if result.skipped:
        atomic_write(out_dir / SKIPPED_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.skipped))
    atomic_write(out_dir / "metrics.json", json.dumps(result.summary(), indent=2) + "\n")
    images = {s.id: s.images[0] for s in samples or [] if s.images}
    write_report(out_dir / "report.html", result, images)
    write_marker(out_dir, "eval")
    result.out_dir = out_dir


__all__ = [
    "EvalResult", "SampleList", "run_eval", "score_predictions_file", "read_predictions", "load_samples",
    "default_output_dir", "unique_output_dir", "data_label", "references_of", "write_outputs",
    "resolve_task", "fold_into_metrics",
]
