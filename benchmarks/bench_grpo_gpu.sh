#!/usr/bin/env bash
# GRPO on a GPU: rollouts/s and the generation share of the step, from `vlmctl train`'s own metrics and from
# `vlmctl bench` of the same settings.
#   benchmarks/bench_grpo_gpu.sh WORKDIR [PRESET] [TRAIN OVERRIDES...]
# Builds a project in WORKDIR: 256 generated shapes-VQA samples (the tiny template's data), prepared, the PRESET
# (default qwen2.5-vl-3b) built with random weights in bf16, then trains train.objective=grpo for 6 steps and prints
# each step's rollouts, rollouts/s and rollout / train seconds (metrics.jsonl), and their means over steps 2-6.
# Then `vlmctl bench` measures the same model and settings (5 steps after 1 warm-up step) on its synthetic prompts
# (one image of the model's size, a reference of 1-8 random tokens; docs/post-training.md) and prints its grpo
# figures as one JSON line (the whole result in WORKDIR/bench.json).
# The project is built once per WORKDIR (BUILD_ONLY=1: build it, nothing more); BENCH=0 skips `vlmctl bench`.
# NPROC (default 1): processes (GPUs) of both: 1 trains in-process (--launcher none), more through torchrun (each rank
# rolls out its own prompts: rollouts per step = NPROC x micro_batch_size x group_size).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$1 preset=${2:-qwen2.5-vl-3b}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$work/data/raw"
cd "$work"
if [ ! -f outputs/model/config.json ]; then  # built once per WORKDIR
    python3 -c "from vlmctl.data.synthetic import generate_shapes_vqa; generate_shapes_vqa('data/raw', num_samples=256)" >/dev/null
    cat > vlmctl.yaml <<YAML
project: {name: grpo-bench}
data: {sources: [{path: data/raw/shapes_vqa.json, format: llava}], prepared_dir: data/prepared, val_ratio: 0.0}
model: {preset: $preset, init: random, dtype: bf16, output_dir: outputs/model}
YAML
    python3 -m vlmctl --quiet data prepare --num-proc 4 >/dev/null
    python3 -m vlmctl --quiet model build --force >/dev/null
fi
[ "${BUILD_ONLY:-0}" = 1 ] && { echo "built under $work"; exit 0; }
keys=(train.objective=grpo train.strategy=fsdp train.stage=full train.micro_batch_size=4 train.gradient_accumulation_steps=1
      train.grpo.group_size=8 train.grpo.max_new_tokens=64)
rm -rf outputs/runs/grpo
nproc=${NPROC:-1}
launch=(--launcher none)
[ "$nproc" -gt 1 ] && launch=(--launcher torchrun --nproc-per-node "$nproc")
python3 -m vlmctl train "${launch[@]}" "${keys[@]}" train.max_steps=6 train.save_steps=1000 train.logging_steps=1 \
    train.run_name=grpo "$@" > train.log 2>&1 || { tail -40 train.log; exit 1; }
python3 "$here/grpo_table.py" outputs/runs/grpo/metrics.jsonl
[ "${BENCH:-1}" = 0 ] && exit 0
python3 -m vlmctl bench --nproc-per-node "$nproc" --steps 5 --warmup 1 --workload chat --text-tokens 1,8 --json "${keys[@]}" "$@" \
    > bench.json 2> bench.log || { tail -40 bench.log; exit 1; }
python3 - bench.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("steps", "rollouts_per_step", "rollouts_per_s", "generated_tokens_per_s", "rollout_s", "train_s",
        "generation_share", "train_tokens_per_s", "tokens_per_s", "mfu", "peak_memory_gib")
print(json.dumps({"bench": {k: r[k] for k in keys}}))
PY
