#!/usr/bin/env bash
# Sequence parallelism on 2 GPUs of one host (docs/benchmarks.md, "Sequence parallelism on 2 GPUs"): long samples
# (8-16 images of 448 px + 16,000-30,000 answer tokens, the chat workload), random-init presets, pure bf16, full
# activation checkpointing, liger on (the GPU default), compile off (its recompiles for new row shapes would land in
# the two measured steps). One JSON line per run under $OUT (or /tmp), then a table.
#   benchmarks/sp_gpu.sh [RUN ...]    RUN = PRESET:SP:TOKENS_PER_GPU[:TEXT_MIN,TEXT_MAX[:KEY=VALUE,...]], e.g.
#   qwen2.5-vl-3b:2:16384:8000,14000 (a 32,768-token row of samples with 8,000-14,000 answer tokens; default
#   16,000-30,000) or qwen2.5-vl-7b:2:32768::train.activation_checkpointing=2 (config overrides of that run only)
#   PROFILE=1: each run's last warm-up step profiled on every rank (`vlmctl bench --profile`) under
#   $OUT/profile/I_PRESET_SP_TOKENS/rank<N>/ (trace.json.gz) and $OUT/ops_I_PRESET_SP_TOKENS_rank<N>.txt (the
#   operator tables; I: the run's number); STEPS / WARMUP: measured and warm-up steps (2, 3: with 2 warm-up steps a
#   Triton compilation of liger's cross-entropy for a new labelled-token count could land in a measured step)
set -uo pipefail
out=${OUT:-/tmp}/sp_gpu.jsonl
: > "$out"
common=(--steps "${STEPS:-2}" --warmup "${WARMUP:-3}" --nproc-per-node 2 --workload chat --images-per-sample 8,16
        --image-sizes 448 model.init=random train.stage=full train.precision=bf16 train.master_weights=bf16
        train.packing=true train.warmup_ratio=0.0 train.lr_scheduler=constant train.activation_checkpointing=full
        train.liger=auto train.compile=off)
i=0
for run in "$@"; do
  i=$((i + 1))
  IFS=: read -r preset sp tokens text extra <<< "$run"
  IFS=, read -r -a overrides <<< "${extra:-}"
  prof=()
  [[ -n "${PROFILE:-}" ]] && prof=(--profile "${OUT:-/tmp}/profile/${i}_${preset}_${sp}_${tokens}")
  line=$(python3 -m vlmctl --quiet bench -c "$(dirname "$0")/ab/sp.yaml" --json "${common[@]}" "${prof[@]}" --text-tokens "${text:-16000,30000}" model.preset="$preset" train.sequence_parallel="$sp" \
         train.tokens_per_batch="$tokens" "${overrides[@]}" 2>"${OUT:-/tmp}/sp_${i}_${preset}_${sp}_${tokens}.err.txt" |
         python3 -c 'import json, sys; t = sys.stdin.read(); print(json.dumps(json.loads(t[t.index("{"):])))' 2>/dev/null) ||
    line='{"error": "failed: see the .err file"}'
  echo "{\"run\": \"$run\", \"result\": $line}" | tee -a "$out"
  if [[ -n "${PROFILE:-}" ]]; then
    for f in "${OUT:-/tmp}/profile/${i}_${preset}_${sp}_${tokens}"/rank*/ops.txt; do
      [[ -f "$f" ]] && mv "$f" "${OUT:-/tmp}/ops_${i}_${preset}_${sp}_${tokens}_$(basename "$(dirname "$f")").txt"
    done
  fi
done
python3 - "$out" <<'PY'
import json, sys
print(f"{'preset':15} {'SP':>2} {'row tokens':>10} {'tokens/s/GPU':>12} {'MFU':>6} {'step s':>7} {'peak GiB':>8}  overrides")
for line in open(sys.argv[1]):
    r = json.loads(line)
    preset, sp, tokens, *rest = r["run"].split(":")
    extra = rest[1] if len(rest) > 1 else ""
    x = r["result"]
    if "error" in x:
        print(f"{preset:15} {sp:>2} {int(sp) * int(tokens):>10,} {'failed':>12}  {extra}")
        continue
    print(f"{preset:15} {sp:>2} {int(sp) * int(tokens):>10,} {x['tokens_per_s_per_gpu']:>12,.0f} {x['mfu'] * 100:>5.1f}% "
          f"{x['step_time_s']:>7.2f} {x.get('peak_memory_gib', 0):>8.1f}  {extra}")
PY
