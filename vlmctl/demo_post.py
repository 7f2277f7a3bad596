"""`vlmctl demo --objective dpo|grpo`: post-training on the shapes VQA demo, from a briefly fine-tuned model to a
better one, measured before and after on the same val split.

    result = run_post_demo(Path("dpo-demo"), "dpo")
    result.before.overall, result.overall, result.gain      # val exact match of the SFT start, after DPO, the gain

Stages (`POST_STAGES`), after the image demo's own (`vlmctl.demo.run_demo` with `SFT_STEPS[objective]` steps, so
its model is still below the accuracy a full run reaches; its eval is the "before" column):

- dpo:  `pairs`    preference pairs from the train split (`build_pairs`): the question and its picture, chosen = the
                   reference answer, rejected = another answer of the same question type (the model's own wrong
                   prediction where one is given), written in LLaMA-Factory's ranking layout to `data/pairs/`;
        `prepare`  `data.prepare.prepare_data` of the pairs (`data.kind: preference`, no val split: the demo's own
                   val split judges the model) into `data/prepared_dpo/`;
        `train`    `train.objective: dpo` from the SFT run's `final/` folder (`model.output_dir`, which
                   `train.setup.model_source` trains from), the frozen reference being that same model;
- grpo: `train`    `train.objective: grpo` on the demo's prepared train split (the assistant turn is the reference
                   answer) with the `exact_match` reward, from the SFT run's `final/` folder;
- both: `eval`     `vlmctl.demo.eval_stage` on the demo's val split: accuracy per question type next to the SFT
                   start's and the blind baseline.

The settings of the post-training stage are `POST_OVERRIDES[objective]` (config overrides, tuned so that the whole
demo runs in under 5 minutes on 2 CPU cores; docs/benchmarks.md, the post-training demos), then the caller's.
Everything measured goes to `outputs/demo_post_summary.json` in the demo folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from vlmctl.demo import DemoResult, ProgressFn, TypeScore, eval_stage, question_type, run_demo, train_stage, _metrics_rows
from vlmctl.errors import UsageError

# The vlmctl modules that load numpy, torch or the data pipeline when imported are imported inside the functions that
# use them: `vlmctl demo` imports this module at start-up. Light vlmctl modules sit next to their use as well.

OBJECTIVES = ("dpo", "grpo")
POST_STAGES = {"dpo": ("pairs", "prepare", "train", "eval"), "grpo": ("train", "eval")}
"""The stages after the SFT start, per objective (their names in `PostDemoResult.stage_seconds`)."""

SFT_STEPS = {"dpo": 150, "grpo": 150}
"""Steps of the SFT start: ~76% val exact match on the shapes set (a full demo run, 600 steps, reaches ~98%)."""

PAIRS_FILE = "data/pairs/shapes_pairs.json"
PAIRS_PREPARED = "data/prepared_dpo"

POST_OVERRIDES = {
    "dpo": [
        "train.objective=dpo",
        "train.packing=true",        # a pair's chosen and rejected answers are two segments of one packed row
        "train.tokens_per_batch=1280",  # ~16 pairs of 2 x 38 tokens per rank
        # RPO: the sigmoid loss with the chosen answer's NLL (rpo_alpha 1). The sigmoid loss alone drove the answers
        # of other question types up and the accuracy down; IPO kept the answers but gained 5 points
        # (docs/benchmarks.md, the post-training demos)
        "train.dpo.loss_type=sigmoid",
        "train.dpo.beta=0.1",
        "train.dpo.rpo_alpha=1.0",
        "train.learning_rate=3.0e-4",
        "train.max_steps=60",
        "train.save_steps=60",
        "train.logging_steps=10",
    ],
    "grpo": [
        "train.objective=grpo",
        "train.packing=true",         # each micro-batch's rollouts are packed into one row (LLaVA takes no padded rollouts)
        "train.micro_batch_size=8",   # prompts per rank and step, each with group_size rollouts
        "train.grpo.group_size=8",
        "train.grpo.max_new_tokens=4",  # the answers are one word
        "train.grpo.temperature=1.0",
        "train.grpo.rewards=[{name: exact_match}]",
        "train.learning_rate=1.0e-3",
        "train.max_steps=70",         # 40 steps learned position but lost colour and count on the way (-2.8 points)
        "train.save_steps=70",
        "train.logging_steps=10",
    ],
}
"""Config overrides of the post-training stage, per objective (the caller's come after them)."""


@dataclass
class PostDemoResult:
    """What `run_post_demo` did and measured: `before` is the SFT start (its own stages, scores and run), the rest
    the post-training stage. Times are wall seconds; accuracies fractions in [0, 1]."""

    objective: str
    before: DemoResult
    stage_seconds: dict[str, float] = field(default_factory=dict)
    scores: list[TypeScore] = field(default_factory=list)
    overall: float = 0.0
    pairs: int = 0
    pairs_from_predictions: int = 0
    steps: int = 0
    final_loss: float | None = None
    loss_terms: str = ""  # what `final_loss` sums, in words (DPO's: the pair loss + rpo_alpha x the chosen NLL)
    metrics: dict[str, float] = field(default_factory=dict)  # the last logged step's objective metrics (rewards/...)
    settings: list[str] = field(default_factory=list)         # the overrides of the post-training stage
    prepared_dir: Path | None = None
    run_dir: Path | None = None
    eval_dir: Path | None = None

    @property
    def gain(self) -> float:
        """Overall val accuracy after minus before (fraction; 0.10 = 10 points)."""
        return self.overall - self.before.overall

    @property
    def total_seconds(self) -> float:
        return self.before.total_seconds + sum(self.stage_seconds.values())

    @property
    def improved(self) -> bool:
        """The demo's bar: at least 10 points of overall val accuracy above the SFT start."""
        return bool(self.scores) and self.gain >= 0.10 - 1e-9

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("objective", "stage_seconds", "overall", "pairs", "pairs_from_predictions",
                                           "steps", "final_loss", "loss_terms", "metrics", "settings")}
        d["scores"] = [vars(s) for s in self.scores]
        for key in ("prepared_dir", "run_dir", "eval_dir"):
            d[key] = str(getattr(self, key)) if getattr(self, key) is not None else None
        d["before"] = self.before.to_dict()
        d.update(gain=self.gain, improved=self.improved, total_seconds=self.total_seconds)
        return d


def build_pairs(records: Iterable[dict[str, Any]], *, exclude: set[str] = frozenset(), predictions: dict[str, str] | None = None,
                seed: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Preference pairs from the demo's generated samples (LLaVA layout: `id`, `image`, `conversations` of one
    question and its answer), in LLaMA-Factory's ShareGPT ranking layout (`conversations` = the question,
    `chosen` / `rejected` = answer turns, `images`; docs/formats.md "Preference data").

    chosen is the sample's answer; rejected is `predictions[id]` when the model's prediction for it is given and
    wrong (a non-empty answer other than the reference, compared lowercased and stripped), else an answer of the
    same question type (`demo.question_type`) drawn with `seed` from the others the records hold. Samples whose
    id is in `exclude` (the val split) are left out, and so is a sample whose type has no other answer.
    Returns (pairs, how many rejected answers are the model's predictions)."""
    records = [r for r in records if r["id"] not in exclude]
    answers: dict[str, set[str]] = {}
    for r in records:
        answers.setdefault(question_type(r["id"]), set()).add(r["conversations"][1]["value"])
    rng = random.Random(seed)
    pairs, predicted = [], 0
    for r in records:
        question, answer = r["conversations"][0], r["conversations"][1]["value"]
        guess = (predictions or {}).get(r["id"], "").strip()
        if guess and guess.lower() != answer.strip().lower():
            rejected, predicted = guess, predicted + 1
        else:
            others = sorted(answers[question_type(r["id"])] - {answer})
            if not others:
                continue
            rejected = rng.choice(others)
        pairs.append({"id": r["id"], "conversations": [question], "chosen": {"from": "gpt", "value": answer},
                      "rejected": {"from": "gpt", "value": rejected}, "images": [r["image"]]})
    return pairs, predicted


def post_overrides(objective: str, sft_run: Path, project: str) -> list[str]:
    """The overrides that turn the demo's project file into the post-training stage's: the SFT run's `final/`
    folder as the model to train (`train.setup.model_source` trains `model.output_dir` when it holds a model), a
    run name of its own, the pairs as the data (dpo), then `POST_OVERRIDES[objective]`."""
    words = [f"model.output_dir={Path(sft_run) / 'final'}", f"train.run_name={project}-{objective}", "train.resume=null"]
    if "pairs" in POST_STAGES[objective]:  # the demo's own preference pairs are the data
        words += [f"data.sources=[{{path: {PAIRS_FILE}, format: preference, image_root: data/raw}}]", "data.kind=preference",
                  f"data.prepared_dir={PAIRS_PREPARED}", "data.val_ratio=0"]
    return words + POST_OVERRIDES[objective]


def run_post_demo(
    folder: Path,
    objective: str,
    *,
    force: bool = False,
    overrides: list[str] | None = None,
    sft_steps: int | None = None,
    num_samples: int | None = None,
    launcher: str | None = None,
    nproc: int | None = None,
    progress: ProgressFn | None = None,
    on_stage: Callable[[str, float], None] | None = None,
) -> PostDemoResult:
    """The image demo trained briefly (`sft_steps`, default `SFT_STEPS[objective]`) and evaluated, then post-trained
    with `objective` (dpo or grpo) from its final model and evaluated again on the same val split.

    `overrides` (`section.key=value`): those under `train.` set the post-training stage (after
    `POST_OVERRIDES[objective]`, e.g. `train.dpo.beta=0.5`), the others both stages (e.g. `data.max_length=256`). `progress(stage, done, total)` and
    `on_stage(stage, seconds)` see the SFT start's stages as `run_demo` names them and the post-training ones as
    `<objective>:<stage>` (e.g. `dpo:train`).

    Raises UsageError for an objective without a demo; what `run_demo` raises; VlmctlError when the post-training
    run fails (with its train.log's last lines).
    """
    from vlmctl.config import load_config

    if objective not in OBJECTIVES:
        raise UsageError(f"no post-training demo for objective {objective!r}", hint=f"choose one of: {', '.join(OBJECTIVES)}")
    folder = Path(folder)
    overrides = list(overrides or [])
    steps = sft_steps if sft_steps is not None else SFT_STEPS[objective]
    if force:
        for sub in (PAIRS_FILE.rsplit("/", 1)[0], PAIRS_PREPARED):  # the post-training stage's own data
            path = (folder / sub).resolve()
            if path.is_dir() and folder.resolve() in path.parents:
                shutil.rmtree(path)

    shared = [o for o in overrides if not o.strip().startswith("train.")]
    post = [o for o in overrides if o.strip().startswith("train.")]
    before = run_demo(folder, force=force, overrides=[*shared, f"train.max_steps={steps}", f"train.save_steps={steps}"],
                      num_samples=num_samples, launcher=launcher, nproc=nproc, progress=progress, on_stage=on_stage)
    result = PostDemoResult(objective=objective, before=before)

    def timed(stage: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        result.stage_seconds[stage] = time.perf_counter() - t0
        if on_stage:
            on_stage(f"{objective}:{stage}", result.stage_seconds[stage])
        return out

    launcher = before.launcher
    run_words = [f"train.launcher={launcher}", f"train.nproc_per_node={before.nproc}"]
    if launcher == "none" or before.nproc == 1:
        run_words.append("train.strategy=ddp")
    config = folder / "vlmctl.yaml"
    sft_cfg = load_config(config, [*shared, *run_words])
    result.settings = [*POST_OVERRIDES[objective], *post]
    cfg = load_config(config, [*shared, *run_words, *post_overrides(objective, before.run_dir, sft_cfg.project.name), *post])

    if "pairs" in POST_STAGES[objective]:
        def pairs() -> int:
            from vlmctl.evaluation import load_samples

            source = Path(sft_cfg.data.sources[0].path)
            val_ids = {s.id for s in load_samples("val", Path(sft_cfg.data.prepared_dir))}
            made, predicted = build_pairs(json.loads(source.read_text()), exclude=val_ids, seed=sft_cfg.project.seed)
            out = folder / PAIRS_FILE
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(json.dumps(made))
            os.replace(tmp, out)
            result.pairs_from_predictions = predicted
            if progress:
                progress(f"{objective}:pairs", len(made), len(made))
            return len(made)

        result.pairs = timed("pairs", pairs)

        def prepare() -> Any:
            from vlmctl.data.prepare import prepare_data

            return prepare_data(cfg.data, progress=False)

        prepared = timed("prepare", prepare)
        result.prepared_dir = prepared.prepared_dir
        if progress:
            progress(f"{objective}:prepare", prepared.kept, prepared.kept)
    else:
        result.prepared_dir = Path(cfg.data.prepared_dir)

    stage_progress = (lambda stage, done, total: progress(f"{objective}:{stage}", done, total)) if progress else None
    run_dir = timed("train", lambda: train_stage(cfg, progress=stage_progress))
    result.run_dir = run_dir
    rows = _metrics_rows(run_dir)
    result.loss_terms = getattr(cfg.train, objective).loss_terms()  # the objective's section says what its loss sums
    if rows:
        from vlmctl.train.registry import get_objective

        result.steps, result.final_loss = rows[-1]["step"], rows[-1].get("loss")
        shown = [key for key, _ in get_objective(objective).step_line if not key.startswith("time/")]
        result.metrics = {k: rows[-1][k] for k in shown if isinstance(rows[-1].get(k), (int, float))}

    # the SFT start's data section: its val split and the train split's blind baseline, as in the "before" column
    scores, eval_dir = timed("eval", lambda: eval_stage(sft_cfg, run_dir / "final", progress=stage_progress))
    result.scores, result.eval_dir = scores, eval_dir
    total = sum(s.n for s in scores)
    result.overall = sum(s.accuracy * s.n for s in scores) / total if total else 0.0
    write_post_summary(result, Path(sft_cfg.train.output_dir).parent / "demo_post_summary.json")
    return result


def write_post_summary(result: PostDemoResult, path: Path) -> Path:
    """Write `result.to_dict()` as JSON to `path` (temporary file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


__all__ = ["OBJECTIVES", "POST_OVERRIDES", "POST_STAGES", "PostDemoResult", "SFT_STEPS", "build_pairs", "post_overrides",
           "run_post_demo", "write_post_summary"]
