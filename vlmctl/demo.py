"""`vlmctl demo`: the whole pipeline on a generated shapes VQA set, on this machine, with nothing downloaded.

    result = run_demo(Path("vlmctl-demo"))
    result.overall, result.baseline_overall      # exact-match accuracy on the val split vs the blind baseline

Stages, each through the library function (or the launcher) of its command:

1. init      `project.init_project(template="tiny")`: vlmctl.yaml + the generated data set in data/raw/
2. prepare   `data.prepare.prepare_data`: Parquet shards, train/val split
3. build     `models.build.build_model`: the tiny random-init preset with a tokenizer trained on the data
4. train     `train.launch`: torchrun with 2 processes and FSDP2 when the machine has 2+ cores, else one process;
             the workers' output goes to `<run>/train.log`, progress is read from `<run>/metrics.jsonl`
5. eval      `evaluation.run_eval` on the val split; exact-match accuracy per question type (the sample
             id's prefix, see `vlmctl.data.synthetic`) next to the blind baseline: the most common answer of each
             question type on the train split, which is what a model gets from the question alone.

Everything the demo measured is written to `outputs/demo_summary.json` in the demo folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from vlmctl.errors import UsageError, VlmctlError

STAGES = ("init", "prepare", "build", "train", "eval")

ProgressFn = Callable[[str, int, "int | None"], None]
"""Called as progress(stage, done, total) while a stage runs (total None: unknown length)."""


@dataclass
class TypeScore:
    """Exact-match accuracy of one question type on the val split, and its blind baseline."""

    qtype: str
    n: int
    accuracy: float
    baseline: float
    baseline_answer: str


@dataclass
class DemoResult:
    """What `run_demo` did and measured. Times are wall seconds; accuracies are fractions in [0, 1]."""

    folder: Path
    launcher: str
    nproc: int
    strategy: str
    stage_seconds: dict[str, float] = field(default_factory=dict)
    scores: list[TypeScore] = field(default_factory=list)
    overall: float = 0.0
    baseline_overall: float = 0.0
    train_samples: int = 0
    val_samples: int = 0
    steps: int = 0
    final_loss: float | None = None
    prepared_dir: Path | None = None
    model_dir: Path | None = None
    run_dir: Path | None = None
    eval_dir: Path | None = None

    @property
    def total_seconds(self) -> float:
        return sum(self.stage_seconds.values())

    @property
    def learned(self) -> bool:
        """The demo's bar: overall accuracy at least 2x the blind baseline and above it for every question type."""
        return bool(self.scores) and self.overall >= 2 * self.baseline_overall and all(s.accuracy > s.baseline for s in self.scores)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("folder", "prepared_dir", "model_dir", "run_dir", "eval_dir"):
            d[key] = str(d[key]) if d[key] is not None else None
        d["total_seconds"] = self.total_seconds
        d["learned"] = self.learned
        return d


def default_launch(cpus: int | None = None) -> tuple[str, int]:
    """(launcher, processes): torchrun with 2 processes when 2+ cores are usable, else one in-process rank."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return ("torchrun", 2) if cpus >= 2 else ("none", 1)


def run_demo(
    folder: Path,
    *,
    force: bool = False,
    overrides: list[str] | None = None,
    num_samples: int | None = None,
    launcher: str | None = None,
    nproc: int | None = None,
    progress: ProgressFn | None = None,
    on_stage: Callable[[str, float], None] | None = None,
) -> DemoResult:
    """Run init -> prepare -> build -> train -> eval in `folder` and return the measurements.

    `overrides` are `section.key=value` strings applied to the tiny template's vlmctl.yaml for every stage (e.g.
    `train.max_steps=20`); `num_samples` sets the size of the generated set (default: the template's). `launcher`
    and `nproc` default to `default_launch()`. `on_stage(stage, seconds)` is called after each stage.

    Raises UsageError when `folder` already holds a project and `force` is not set; DataError / ModelError /
    VlmctlError from the stages (training failures name the run's train.log).
    """
    from vlmctl.config import load_config
    from vlmctl.project import init_project

    folder = Path(folder)
    overrides = list(overrides or [])
    default_launcher, default_nproc = default_launch()
    launcher = launcher or default_launcher
    nproc = nproc or (default_nproc if launcher == default_launcher else 1)
    run_overrides = [f"train.launcher={launcher}", f"train.nproc_per_node={nproc}"]
    if launcher == "none" or nproc == 1:
        run_overrides.append("train.strategy=ddp")  # one rank: nothing to shard
    if (folder / "vlmctl.yaml").exists() and not force:
        raise UsageError(f"{folder} already holds a project", hint="choose another folder, or pass --force to run the demo there again")

    def timed(stage: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        result.stage_seconds[stage] = time.perf_counter() - t0
        if on_stage:
            on_stage(stage, result.stage_seconds[stage])
        return out

    result = DemoResult(folder=folder.resolve(), launcher=launcher, nproc=nproc, strategy="")

    def init() -> Any:
        if force:
            _clear_outputs(folder, overrides)
        return init_project(folder, template="tiny", force=force, num_samples=num_samples)

    timed("init", init)
    config = folder / "vlmctl.yaml"
    cfg = _fit_connector(load_config(config, [*overrides, *run_overrides]))
    result.strategy = cfg.train.strategy

    def prepare() -> Any:
        from vlmctl.data.prepare import prepare_data

        return prepare_data(cfg.data, progress=False)

    prepared = timed("prepare", prepare)
    result.prepared_dir = prepared.prepared_dir
    result.train_samples = prepared.manifest["splits"]["train"]["samples"]
    result.val_samples = prepared.manifest["splits"]["val"]["samples"]
    if progress:
        progress("prepare", prepared.kept, prepared.kept)

    def build() -> Any:
        from vlmctl.models.build import build_model

        return build_model(cfg.model, prepared_dir=cfg.data.prepared_dir, force=True, seed=cfg.project.seed)

    built = timed("build", build)
    result.model_dir = built.output_dir

    run_dir = timed("train", lambda: train_stage(cfg, progress=progress))
    result.run_dir = run_dir
    rows = _metrics_rows(run_dir)
    result.steps = rows[-1]["step"] if rows else 0
    result.final_loss = rows[-1].get("loss") if rows else None

    def evaluate() -> Any:
        return eval_stage(cfg, run_dir / "final", progress=progress)

    scores, eval_dir = timed("eval", evaluate)
    result.eval_dir = eval_dir
    result.scores = scores
    total = sum(s.n for s in scores)
    result.overall = sum(s.accuracy * s.n for s in scores) / total if total else 0.0
    result.baseline_overall = sum(s.baseline * s.n for s in scores) / total if total else 0.0
    write_summary(result, Path(cfg.train.output_dir).parent / "demo_summary.json")
    return result


def _fit_connector(cfg):
    """The project config with the tiny template's `model.vision_feature_layer` dropped when an override picks a
    connector that reads the encoder's last layer (`model.projector` pixel_shuffle or perceiver), which refuses
    the key; any other config is returned as is."""
    from vlmctl.config import ModelSection

    model = cfg.model
    if model.projector in ("pixel_shuffle", "perceiver") and "vision_feature_layer" in model.model_fields_set:
        kept = model.model_dump(exclude_unset=True, exclude={"vision_feature_layer"})
        cfg = cfg.model_copy(update={"model": ModelSection(**kept)})
    return cfg


def _clear_outputs(folder: Path, overrides: list[str]) -> None:
    """Remove what an earlier demo run wrote (prepared data, built model, runs, eval) so this one starts clean."""
    from vlmctl.config import load_config

    config = folder / "vlmctl.yaml"
    if not config.is_file():
        return
    try:
        cfg = load_config(config, overrides)
    except VlmctlError:
        return
    for path in (cfg.data.prepared_dir, cfg.model.output_dir, cfg.train.output_dir, cfg.eval.output_dir):
        path = Path(path).resolve()
        if path.is_dir() and folder.resolve() in path.parents:  # only inside the demo folder
            shutil.rmtree(path)


def train_stage(cfg, progress: ProgressFn | None = None, poll_s: float = 0.5) -> Path:
    """Spawn the training run of `cfg.train` (launcher command of `vlmctl train`), its output in `<run>/train.log`.

    Returns the run folder (with `final/`). Raises VlmctlError with the log's last lines when the run fails.
    """
    from vlmctl.train import launch as L

    run_dir = L.prepare_run(cfg)
    launch = L.launch_command(cfg.train, run_dir)
    log_path = run_dir / L.TRAIN_LOG
    total = cfg.train.max_steps
    metrics = run_dir / "metrics.jsonl"
    running = L.Running(launch.command, env=L.launch_env(cfg.train), log_path=log_path, echo=False)
    proc = running.proc
    try:
        while proc.poll() is None:
            time.sleep(poll_s)
            if progress:
                progress("train", _last_step(metrics), total)
    except BaseException:
        proc.terminate()  # the launcher forwards SIGTERM to the workers, which stop cleanly
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        running.close()
    if proc.returncode != 0 or not (run_dir / "final" / "config.json").is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise VlmctlError(f"training failed (exit code {proc.returncode}); last lines of {log_path}:\n{tail}",
                          hint=f"see {log_path}; rerun the stage alone with `vlmctl train` in {Path(cfg.train.output_dir).parent.parent}")
    if progress:
        progress("train", _last_step(metrics), total)
    return run_dir


def _last_step(metrics: Path) -> int:
    rows = _metrics_rows(metrics.parent)
    return rows[-1]["step"] if rows else 0


def _metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            continue
    return rows


def question_type(sample_id: str) -> str:
    """The question type of a generated sample: the prefix of its id (`color-00012` -> `color`)."""
    return sample_id.split("-", 1)[0]


def blind_baseline(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """The most common answer per question type from (question type, answer) pairs; ties go to the answer that
    comes first alphabetically, so the baseline is deterministic."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for qtype, answer in pairs:
        counts[qtype][answer.strip().lower()] += 1
    return {q: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for q, c in counts.items()}


def score_by_type(records: list[tuple[str, str, list[str]]], baseline: dict[str, str]) -> list[TypeScore]:
    """Exact-match accuracy per question type (`evaluation.metrics.exact_match`) of (id, prediction, references)
    records, next to the accuracy of always answering the type's `baseline` answer."""
    from vlmctl.evaluation.metrics import exact_match

    by_type: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for sid, prediction, refs in records:
        q = question_type(sid)
        by_type[q].append((exact_match(prediction, refs), exact_match(baseline.get(q, ""), refs)))
    return [TypeScore(qtype=q, n=len(v), accuracy=sum(a for a, _ in v) / len(v), baseline=sum(b for _, b in v) / len(v),
                      baseline_answer=baseline.get(q, "")) for q, v in sorted(by_type.items())]


def eval_stage(cfg, model_dir: Path, progress: ProgressFn | None = None) -> tuple[list[TypeScore], Path]:
    """Generate answers on the val split with `run_eval` (writes predictions.jsonl, metrics.json, report.html) and
    score them per question type against the blind baseline of the train split. Returns (scores, output folder)."""
    from vlmctl.evaluation import load_samples, references_of, run_eval, unique_output_dir

    prepared = Path(cfg.data.prepared_dir)
    val = load_samples("val", prepared)
    train = load_samples(str(prepared / "train"), prepared)
    baseline = blind_baseline([(question_type(s.id), references_of(s)[0]) for s in train if references_of(s)])
    out_dir = unique_output_dir(Path(cfg.eval.output_dir) / f"{Path(model_dir).parent.name}-vqa", create=False)
    cb = (lambda done, total: progress("eval", done, total)) if progress else None
    result = run_eval(model_dir, val, task="vqa", data_name="val", out_dir=out_dir, batch_size=max(cfg.eval.batch_size, 32),
                      max_new_tokens=cfg.eval.max_new_tokens, dtype=cfg.eval.dtype, progress=cb)
    records = [(r.id, r.prediction, r.references) for r in result.records]
    return score_by_type(records, baseline), out_dir


def write_summary(result: DemoResult, path: Path) -> Path:
    """Write `result.to_dict()` as JSON to `path` (temporary file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def next_commands(result: DemoResult) -> list[str]:
    """What to try after the demo, from inside the demo folder."""
    run = result.run_dir.relative_to(result.folder) if result.run_dir else "outputs/runs/<run>"
    return [
        f"vlmctl convert {run} -o outputs/export            # checkpoint -> verified HF folder",
        "vlmctl push outputs/export --repo-id you/shapes-vlm --dry-run",
        "vlmctl init my-vlm --template llava             # a real model (or --template qwen2.5-vl-lora), on GPUs",
    ]


__all__ = ["DemoResult", "TypeScore", "run_demo", "default_launch", "blind_baseline", "score_by_type", "question_type",
           "train_stage", "eval_stage", "next_commands", "STAGES"]
