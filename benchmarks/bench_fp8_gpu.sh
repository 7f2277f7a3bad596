#!/usr/bin/env bash
# FP8 training on one GPU, for docs/benchmarks.md: `vlmctl bench` (the trainer's own step, the
# baseline's packed workload) of random-init presets, full fine-tuning, compiled decoder layers, one process (the
# one-GPU defaults: ddp, bf16 master weights with stochastic rounding, liger's loss).
#   benchmarks/bench_fp8_gpu.sh [RUN ...]
# RUN (default: all five, in this order):
#   7b-bf16, 7b-tensorwise   the 7B preset at 8,192-token rows, no activation checkpointing, train.fp8 off / tensorwise
#                            with train.fp8_layers=sized (torchao's size rule skips the key/value projections: the
#                            default of train.fp8_layers)
#   7b-tensorwise-all        as 7b-tensorwise with train.fp8_layers=all (every aligned linear, k/v included)
#   7b-tensorwise-fast       as 7b-tensorwise with train.fp8_fast_accum=all (fast accumulation in the backward
#                            matmuls too); -all-fast both
#   3b-auto                  the 3B preset, train.fp8=auto and train.tokens_per_batch=auto (the start-up probe picks
#                            the rows and runs its float8 trial), no activation checkpointing (what the probe picks
#                            for the 3B on an H200, docs/benchmarks.md), so the probe compiles one mode and the
#                            float8 layers once
#   3b-bf16                  the 3B preset at the rows 3b-auto chose, train.fp8=off
#   7b-rowwise               as 7b-bf16 with train.fp8=rowwise (last: recorded beside tensorwise)
# Each run is one process (its compile included in the warm-up steps). BUDGET (seconds, default 450) bounds the
# whole call: a run that cannot start with MIN_RUN (120) seconds left is reported as not run, and each run is
# stopped when the budget is spent. STEPS / WARMUP: measured and warm-up steps (4, 3). On the GPU image, install what
# it lacks first (`source .wheels/install.sh`: pydantic, liger-kernel, torchao, ...). One JSON line per run under
# $OUT (or /tmp), its stderr beside it, then a table (the last lines printed): tokens/s and the median step's seconds,
# each against bf16 of the same preset, the garbage collector's milliseconds in the measured steps, the graphs
# torch.compile compiled in them (a recompilation stops a step for seconds), MFU (against
# the bf16 peak, float8 or not), peak GiB, and what auto chose. EXTRA: more KEY=VALUE overrides for every run
# (e.g. EXTRA=train.gc_freeze_step=0). NPROC: GPUs (processes) per run, default 1; with 2 and
# EXTRA=train.strategy=fsdp the tensorwise runs all-gather their float8 weights under FSDP2 (each GPU its own
# 8,192-token rows; tokens/s are the GPUs' sum). A RUN named more than once runs again in its place in the order
# (e.g. `7b-bf16 7b-tensorwise 7b-bf16 7b-tensorwise`, alternated): every row is then compared with its preset's
# bf16 runs pooled, and a last table pools each RUN's runs (mean tokens/s, median of all its measured steps).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # this source tree first
out=${OUT:-/tmp}
mkdir -p "$out"
results=$out/fp8_gpu.jsonl
: > "$results"
budget=${BUDGET:-450} min_run=${MIN_RUN:-120} start=$(date +%s)
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(7b-bf16 7b-tensorwise 3b-auto 3b-bf16 7b-rowwise)
common=(--steps "${STEPS:-4}" --warmup "${WARMUP:-3}" --nproc-per-node "${NPROC:-1}" model.init=random train.stage=full
        train.compile=on train.activation_checkpointing=off train.warmup_ratio=0.0 train.lr_scheduler=constant ${EXTRA:-})
rows_3b=""
for run in "${runs[@]}"; do
  preset=qwen2.5-vl-${run%%-*} mode=${run#*-} layers=sized accum=forward
  [ "${mode%-fast}" != "$mode" ] && mode=${mode%-fast} accum=all
  [ "${mode%-all}" != "$mode" ] && mode=${mode%-all} layers=all
  case $run in
    7b-*) keys=(train.tokens_per_batch=8192 "train.fp8=${mode/bf16/off}" "train.fp8_layers=$layers" "train.fp8_fast_accum=$accum") ;;
    3b-auto) keys=(train.tokens_per_batch=auto train.fp8=auto) ;;
    3b-bf16) keys=("train.tokens_per_batch=${rows_3b:-auto}" train.fp8=off) ;;
    *) echo "unknown run $run (7b-bf16, 7b-tensorwise[-all][-fast], 7b-rowwise, 3b-auto, 3b-bf16)" >&2; exit 2 ;;
  esac
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt "$min_run" ]; then
    echo "{\"run\": \"$run\", \"result\": {\"error\": \"not run: ${left} s of the budget left\"}}" | tee -a "$results"
    continue
  fi
  t0=$(date +%s)
  line=$(timeout "$left" python3 -m vlmctl --quiet bench -c benchmarks/ab/fp8.yaml --json "${common[@]}" \
         model.preset="$preset" "${keys[@]}" 2>"$out/fp8_$run.err.txt" |
         python3 -c 'import json, sys; t = sys.stdin.read(); print(json.dumps(json.loads(t[t.index("{"):])))' 2>/dev/null) ||
    line="{\"error\": \"failed or stopped after $(( $(date +%s) - t0 )) s: see fp8_$run.err.txt\"}"
  echo "{\"run\": \"$run\", \"wall_s\": $(( $(date +%s) - t0 )), \"result\": $line}" | tee -a "$results"
  if [ "$run" = 3b-auto ]; then  # the rows the probe chose, for 3b-bf16
    rows_3b=$(python3 -c 'import json, re, sys; r = json.loads(sys.argv[1])["result"]; m = re.search(r"(\d+) tokens per row", r.get("settings", "")); print(m.group(1) if m else "")' \
              "$(tail -1 "$results")")
  fi
done
tail -3 "$out"/fp8_*.err.txt 2>/dev/null | grep -iE "error|Traceback" | head -5
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
# a run named more than once (float8's median step moves up to 8% from run to run): its runs are pooled, and each row
# is compared with its preset's bf16 runs pooled (the mean of their tokens/s, the median of all their measured steps)
pooled = {}
for r in rows:
    if "tokens_per_s" in r["result"]:
        p = pooled.setdefault(r["run"], {"tokens_per_s": [], "steps": []})
        p["tokens_per_s"].append(r["result"]["tokens_per_s"])
        p["steps"] += r["result"].get("step_times_s") or []
median = lambda x: statistics.median(x) if x else None  # noqa: E731
base = {k.split("-")[0]: statistics.mean(p["tokens_per_s"]) for k, p in pooled.items() if k.endswith("bf16")}
# the median step too: one slow step (a pause of the host) moves the mean tokens/s of a few steps
base_step = {k.split("-")[0]: median(p["steps"]) for k, p in pooled.items() if k.endswith("bf16")}
print(f"{'run':18} {'tokens/s':>9} {'x bf16':>7} {'median s':>8} {'x bf16':>7} {'gc ms':>6} {'graphs':>6} {'MFU':>6} {'peak GiB':>8} {'wall s':>6}  settings / auto")
for r in rows:
    x = r["result"]
    if "tokens_per_s" not in x:
        print(f"{r['run']:18} {x.get('error', 'no result')}")
        continue
    ref = base.get(r["run"].split("-")[0])
    ratio = f"{x['tokens_per_s'] / ref:.3f}" if ref else "-"
    step, ref_step = median(x.get("step_times_s") or []), base_step.get(r["run"].split("-")[0])
    step_ratio = f"{ref_step / step:.3f}" if step and ref_step else "-"
    gc_ms = f"{1000 * sum(x['step_gc_s']):.0f}" if x.get("step_gc_s") is not None else "-"  # the collector, measured steps
    graphs = str(sum(x["step_compiles"])) if x.get("step_compiles") is not None else "-"  # compiled in measured steps
    auto = x.get("auto") or {}
    chose = f" | fp8 {auto['fp8']}: {auto.get('fp8_reason', '')}" if auto.get("fp8") else ""
    print(f"{r['run']:18} {x['tokens_per_s']:>9,.0f} {ratio:>7} {step or 0:>8.4f} {step_ratio:>7} {gc_ms:>6} {graphs:>6} {100 * x['mfu']:>5.1f}% {x['peak_memory_gib']:>8.1f} "
          f"{r.get('wall_s', 0):>6}  {x.get('settings', '')}{chose}")
if any(len(p["tokens_per_s"]) > 1 for p in pooled.values()):
    print(f"pooled: {'run':18} {'runs':>4} {'steps':>5} {'tokens/s':>9} {'x bf16':>7} {'median s':>8} {'x bf16':>7}")
    for name, p in pooled.items():
        ref, ref_step = base.get(name.split("-")[0]), base_step.get(name.split("-")[0])
        mean, step = statistics.mean(p["tokens_per_s"]), median(p["steps"])
        ratio = f"{mean / ref:.3f}" if ref else "-"
        step_ratio = f"{ref_step / step:.3f}" if step and ref_step else "-"
        print(f"pooled: {name:18} {len(p['tokens_per_s']):>4} {len(p['steps']):>5} {mean:>9,.0f} {ratio:>7} {step or 0:>8.4f} {step_ratio:>7}")
PY
