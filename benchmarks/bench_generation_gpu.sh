#!/usr/bin/env bash
# Everything that generates, on one GPU, in one call: GRPO's rollouts in `vlmctl train`, `vlmctl serve` with the
# openai client, and `vlmctl eval` on 500 VQA samples against an older tree of vlmctl.
#   benchmarks/bench_generation_gpu.sh WORKDIR [PRESET]                      # from the repository root
# Builds a project in WORKDIR once (512 generated shapes-VQA samples, prepared; the PRESET, default qwen2.5-vl-3b,
# built with random weights in bf16), then
#  1. GRPO: `vlmctl train` of train.objective=grpo for 6 steps (4 prompts x 8 rollouts of 64 tokens, FSDP2 on one
#     GPU, activation checkpointing and compile off, as the earlier figures): each step's rollouts/s, rollout and
#     train seconds, the generation share and the rollout/trainer log-prob gap, and their means over steps 2-6;
#  2. serve: benchmarks/bench_serve_gpu.sh on the built model (1, 8 and 32 clients);
#  3. eval: benchmarks/bench_eval.py on 500 samples of the data with this tree and with the tree in $OLD (a folder
#     holding an older `vlmctl/` package, e.g. `git archive 4bd9896 vlmctl | tar -x -C .old`), when it exists; each
#     after an untimed run of 32 samples (bytecode compiled, files cached: the state of a machine that ran it once).
# Bytecode is written beside the sources (PYTHONDONTWRITEBYTECODE unset), as a pip install leaves it.
# STEPS selects them (default "grpo serve eval"). Wheels come from $WHEELS (default .wheels) as in the other scripts.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 WORKDIR [PRESET]" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mkdir -p "$1" && cd "$1" && pwd) preset=${2:-qwen2.5-vl-3b}
old=${OLD:-$root/.old} steps=${STEPS:-grpo serve eval}
wheels=${WHEELS:-$root/.wheels}
python3 -c "import pydantic" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/py312/*.whl
python3 -c "import openai, uvicorn" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/serve/*.whl
export PYTHONPATH=$root:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# bytecode written where Python looks for it, as on a machine where the packages were installed with pip: the wheels
# above are installed without it, and with PYTHONDONTWRITEBYTECODE set every process compiles the sources of
# everything it imports again (10-15 s of a `vlmctl eval`'s start on the GPU machine)
unset PYTHONDONTWRITEBYTECODE

cd "$work"
source "$root/benchmarks/shapes_project.sh"
shapes_project gen-bench "$preset" "512" 0.0 || exit 1

if [[ " $steps " == *" grpo "* ]]; then
    echo "== GRPO: vlmctl train, 6 steps"
    keys=(train.objective=grpo train.strategy=fsdp train.stage=full train.micro_batch_size=4 train.gradient_accumulation_steps=1
          train.grpo.group_size=8 train.grpo.max_new_tokens=64 train.activation_checkpointing=off train.compile=off)
    rm -rf outputs/runs/grpo
    timeout "${GRPO_TIMEOUT:-300}" python3 -m vlmctl train --launcher none "${keys[@]}" train.max_steps=6 train.save_steps=1000 \
        train.logging_steps=1 train.run_name=grpo > grpo.log 2>&1 || tail -30 grpo.log
    python3 "$root/benchmarks/grpo_table.py" outputs/runs/grpo/metrics.jsonl
    grep -m2 "rollouts through\|decoding" grpo.log || true
fi

if [[ " $steps " == *" serve "* ]]; then
    echo "== serve"
    MODEL=$work/outputs/model WHEELS=$wheels START_TIMEOUT=240 BENCH_TIMEOUT=${SERVE_TIMEOUT:-240} \
        bash "$root/benchmarks/bench_serve_gpu.sh" "$work/serve" "$preset" 2>&1 | grep -v "^\[W" > "$work/serve.txt"
    grep -A4 "concurrency *requests_per_s" "$work/serve.txt" || tail -30 "$work/serve.txt"
fi

if [[ " $steps " == *" eval "* ]]; then
    echo "== eval: 500 samples"
    python3 "$root/benchmarks/bench_eval.py" --workdir "$work/eval" --model "$work/outputs/model" --samples 500 --prepare-only
    for tree in "$root" "$old"; do
        [ -d "$tree/vlmctl" ] || { echo "no vlmctl/ under $tree: skipped"; continue; }
        # an untimed run of 32 samples first: the tree's bytecode is compiled and the files are in the page cache
        PYTHONPATH=$tree:/tmp/site timeout "${EVAL_TIMEOUT:-240}" python3 "$root/benchmarks/bench_eval.py" --workdir "$work/eval" \
            --model "$work/outputs/model" --samples 32 --batch-size 32 --max-new-tokens 16 >/dev/null 2>&1 || true
        PYTHONPATH=$tree:/tmp/site timeout "${EVAL_TIMEOUT:-240}" python3 "$root/benchmarks/bench_eval.py" --workdir "$work/eval" \
            --model "$work/outputs/model" --samples 500 --batch-size 32 --max-new-tokens 16 2>&1 | grep "^RESULT" \
            | sed "s|^RESULT|EVAL $(basename "$tree")|" || echo "eval with $tree failed"
    done
fi
