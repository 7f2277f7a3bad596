#!/usr/bin/env bash
# DPO against SFT throughput on one machine, in one call: `vlmctl bench` of CONFIG as SFT, then as DPO with a
# frozen reference and with precomputed reference log-probs (the chat workload for all three, so the samples are
# drawn alike; a DPO sample is a pair whose two answers have the same length, and its tokens count both).
#   benchmarks/bench_dpo.sh CONFIG [BENCH ARGS...]
# Prints one JSON line per row and a table with each row's tokens/s relative to SFT's.
set -euo pipefail
config=$1
shift
out=${OUT:-/tmp}/bench_dpo.jsonl
: > "$out"
for row in "sft" "dpo-frozen train.objective=dpo train.dpo.reference=frozen" \
           "dpo-precomputed train.objective=dpo train.dpo.reference=precomputed"; do
  label=${row%% *}
  extra=$([ "$label" = sft ] && echo "" || echo "${row#* }")
  # shellcheck disable=SC2086
  line=$(cd "$(dirname "$config")" && python3 -m vlmctl --quiet bench -c "$(basename "$config")" --json --workload chat "$@" $extra |
         python3 -c 'import json, sys; t = sys.stdin.read(); print(json.dumps(json.loads(t[t.index("{"):])))')
  echo "{\"row\": \"$label\", \"result\": $line}" | tee -a "$out"
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
sft = rows[0]["result"]["tokens_per_s"]
print(f"{'row':16} {'tokens/s':>10} {'x SFT':>6} {'MFU':>7} {'peak GiB':>9}")
for r in rows:
    x = r["result"]
    print(f"{r['row']:16} {x['tokens_per_s']:>10,.0f} {x['tokens_per_s'] / sft:>6.2f} {x['mfu'] * 100:>6.1f}% {x.get('peak_memory_gib', 0):>9.1f}")
PY
