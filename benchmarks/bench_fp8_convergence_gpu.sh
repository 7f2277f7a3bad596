#!/usr/bin/env bash
# FP8 against bf16 convergence on one GPU, for docs/benchmarks.md: the same project trained twice from the same seed,
# train.fp8=off and train.fp8=tensorwise, then each final export scored by `vlmctl eval` on the same held-out samples.
#   benchmarks/bench_fp8_convergence_gpu.sh WORKDIR [PRESET]          # from the repository root
# Builds a project in WORKDIR once: SAMPLES (default 8192) generated shapes-VQA samples (64 px pictures, VAL (default
# 0.25) of them held out by the data split: about 2,000, so that one answer is 0.05 points of accuracy), the PRESET
# (default qwen2.5-vl-3b) built with random weights in bf16. Each run: `vlmctl train` of STEPS (default 300) steps,
# full fine-tuning, compiled decoder layers (FP8 needs them; bf16 gets the same),
# packed rows of TOKENS (default 4096) tokens, learning rate LR (default 1e-4, cosine), no validation during the
# run, activation checkpointing off. Then `vlmctl eval` of its final export on EVAL_SAMPLES (default 2048) of the val
# split, 8 new tokens. Last: one `FP8CONV {json}` line, keyed by run: its mean loss over its last 100 steps, eval
# metrics and tokens/s; for every run after the first, the relative difference of its loss from the first run's, the
# difference of its metrics in points, and the paired comparison of the two evals (samples both / only the first /
# only this run answered right; McNemar's exact two-sided p-value of the difference, from the binomial distribution
# of the discordant samples; the difference's standard error in points).
# MODES (default "off tensorwise") picks the runs, the first being the reference the others are compared with. A mode is
# a train.fp8 value, optionally followed by more overrides after a colon, comma-separated: "off off:train.seed=1
# tensorwise:train.fp8_layers=sized" compares bf16 with itself under another data order (the measure's own spread)
# and float8 with torchao's size rule; each run is named by its mode (":", "," and "=" turned into "-").
# On one H200 a 3B run of 300 steps trains in about 190 s and its
# final checkpoint and export take more than another 20 s, so the two runs and their evals need about 9 minutes;
# where one call has less, run MODES=off and MODES=tensorwise apart (each call builds the project again) and compare
# the two FP8CONV lines, or with PARALLEL=1 on a machine of two GPUs run each mode on its own GPU at once (as many GPUs as modes; each
# run's speed then shares the host with the other). RUN_TIMEOUT bounds each run (default 420 s).
# On the GPU image, install what it lacks first (`source .wheels/install.sh`). Outputs stay under WORKDIR.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 WORKDIR [PRESET]" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mkdir -p "$1" && cd "$1" && pwd) preset=${2:-qwen2.5-vl-3b}
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cd "$work"
source "$root/benchmarks/shapes_project.sh"
shapes_project fp8-convergence "$preset" "${SAMPLES:-8192}" "${VAL:-0.25}" || exit 1
label() { echo "$1" | tr ':,=' '---'; }  # a mode's run name
run_mode() {  # MODE [GPU]: train, then evaluate the final export; everything it prints goes to lane-LABEL.txt
    local mode=${1%%:*} extra=() name t0=$SECONDS
    name=$(label "$1")
    [ "$1" != "$mode" ] && IFS=, read -r -a extra <<< "${1#*:}"
    [ -n "${2:-}" ] && export CUDA_VISIBLE_DEVICES=$2
    rm -rf "outputs/runs/fp8-$name"
    timeout "${RUN_TIMEOUT:-420}" python3 -m vlmctl train --launcher none train.fp8=$mode train.stage=full train.compile=on \
        train.activation_checkpointing=off train.max_steps="${STEPS:-300}" train.tokens_per_batch="${TOKENS:-4096}" \
        train.learning_rate="${LR:-1e-4}" train.logging_steps=1 train.save_steps=100000 train.seed=0 "${extra[@]}" \
        train.run_name="fp8-$name" > "train-$name.log" 2>&1 || { echo "$1: training failed"; tail -20 "train-$name.log"; }
    echo "== $1 trained in $(( SECONDS - t0 )) s${2:+ on GPU $2}"
    # only the final export and the metrics are read below: a 3B run's last checkpoint (weights and optimizer state,
    # tens of GB) would otherwise fill the disk of a machine that runs this script more than once
    rm -rf "outputs/runs/fp8-$name/checkpoints"
    grep -m3 -i "fp8\|float8" "train-$name.log" | cut -c1-200
    t0=$SECONDS
    timeout "${EVAL_TIMEOUT:-150}" python3 -m vlmctl --quiet eval "outputs/runs/fp8-$name/final" --data val \
        --limit "${EVAL_SAMPLES:-2048}" --max-new-tokens 8 --batch-size 64 -o "outputs/eval/fp8-$name" --force --json \
        > "eval-$name.json" 2> "eval-$name.err" || { echo "$1: eval failed"; tail -5 "eval-$name.err"; }
    echo "== $1 evaluated in $(( SECONDS - t0 )) s"
}
modes=(${MODES:-off tensorwise})
if [ "${PARALLEL:-0}" = 1 ]; then  # one GPU per mode, all at once
    for i in "${!modes[@]}"; do run_mode "${modes[$i]}" "$i" > "lane-$(label "${modes[$i]}").txt" 2>&1 & done
    wait
    for mode in "${modes[@]}"; do cat "lane-$(label "$mode").txt"; done
else
    for mode in "${modes[@]}"; do run_mode "$mode"; done
fi
labels=$(for mode in "${modes[@]}"; do label "$mode"; done) python3 - <<'PY'
import json
import os
from math import comb
from pathlib import Path

labels = os.environ["labels"].split()
out = {}
for mode in labels:
    path = Path(f"outputs/runs/fp8-{mode}/metrics.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    losses = [r["loss"] for r in rows if "loss" in r]
    speeds = [r["tokens_per_s"] for r in rows[10:] if "tokens_per_s" in r]
    text = Path(f"eval-{mode}.json").read_text() if Path(f"eval-{mode}.json").is_file() else ""
    try:
        metrics = json.loads(text[text.index("{"):]).get("metrics", {})
    except ValueError:
        metrics = {}
    out[mode] = {"steps": len(losses), "loss_last100": round(sum(losses[-100:]) / max(len(losses[-100:]), 1), 5),
                 "loss_first": round(losses[0], 4) if losses else None,
                 "tokens_per_s": round(sum(speeds) / len(speeds), 1) if speeds else None, "eval": metrics}


def paired(ref: dict, other: dict) -> dict:
    """Samples both / only the reference / only the other answered right, McNemar's exact two-sided p-value, and the
    standard error of the accuracy difference in points (paired proportions: sqrt(b + c - (b - c)^2 / n) / n, with b
    and c the discordant counts; Agresti, Categorical Data Analysis, 10.1), the noise a difference is read against."""
    both = sorted(set(ref) & set(other))
    only_ref = sum(ref[i] and not other[i] for i in both)
    only_other = sum(other[i] and not ref[i] for i in both)
    n, k = only_ref + only_other, min(only_ref, only_other)
    p = min(1.0, 2 * sum(comb(n, j) for j in range(k + 1)) / 2 ** n) if n else 1.0
    m = len(both)
    se = (max(n - (only_ref - only_other) ** 2 / m, 0.0)) ** 0.5 / m if m else 0.0
    return {"samples": m, "both_right": sum(ref[i] and other[i] for i in both),
            f"only_{labels[0]}_right": only_ref, "only_other_right": only_other, "mcnemar_p": round(p, 4),
            "diff_se_points": round(100 * se, 2)}


scores = {}
for mode in labels:
    path = Path(f"outputs/eval/fp8-{mode}/predictions.jsonl")
    if path.is_file():  # one object per sample: its id and score (1 right, 0 wrong)
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        scores[mode] = {r["id"]: float(r.get("score") or 0) > 0 for r in rows}
base = out[labels[0]]
for mode in labels[1:]:  # each run against the first
    run = out[mode]
    if base["steps"] and run["steps"]:
        run["loss_rel_diff"] = round((run["loss_last100"] - base["loss_last100"]) / base["loss_last100"], 5)
        run["eval_diff_points"] = {k: round(100 * (run["eval"][k] - v), 2) for k, v in base["eval"].items()
                                   if isinstance(v, (int, float)) and isinstance(run["eval"].get(k), (int, float))}
    if labels[0] in scores and mode in scores:
        run["paired"] = paired(scores[labels[0]], scores[mode])
print("FP8CONV " + json.dumps(out))
PY
