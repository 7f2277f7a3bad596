#!/usr/bin/env bash
# Compare `vlmctl serve` between two source trees of vlmctl in one call on one GPU, a new server per run, alternating
# A B A B ... (the rounds of one server drift together: only alternated servers compare two trees).
#   benchmarks/bench_serve_ab.sh TREE_A TREE_B [SERVERS] [BENCH_SERVE OPTIONS...]     # from the repository root
# TREE_A / TREE_B: folders holding a `vlmctl/` package (`git archive <commit> | tar -x -C DIR`; `.` for this tree).
# Both are served by this tree's benchmarks/bench_serve_gpu.sh and bench_serve.py, so only the server differs. The
# model (PRESET, default qwen2.5-vl-3b, random weights in bf16) is built once under WORKDIR (default /tmp/serve_ab)
# by this tree's code, or taken from MODEL. SERVERS (default 3) servers per tree; BENCH_SERVE OPTIONS default to
# `--warmup 3 --concurrency 32 --rounds 3`. RUN_TIMEOUT (seconds, default 120) bounds each server's run.
# Prints each run's rounds (output tokens/s, and whether the round captured a graph or met a new picture layout),
# then per tree: the median of the runs' medians, the mean of all rounds, and the mean of the steady rounds (none
# captured, none new). Each run's log: WORKDIR/<A|B><n>.log.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 TREE_A TREE_B [SERVERS] [BENCH_SERVE OPTIONS...]" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
a=$(realpath "$1") b=$(realpath "$2") servers=${3:-3}
shift $(( $# < 3 ? $# : 3 ))
options=("$@")
[ ${#options[@]} -eq 0 ] && options=(--warmup 3 --concurrency 32 --rounds 3)
work=${WORKDIR:-/tmp/serve_ab} preset=${PRESET:-qwen2.5-vl-3b}
mkdir -p "$work"
cd "$root"
model=${MODEL:-}
if [ -z "$model" ]; then
    model=$(PYTHONPATH=$root:/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "${BUILD_TIMEOUT:-420}" python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from bench_serve import preset_model
print(preset_model(Path(sys.argv[1]), sys.argv[2]))" "$work" "$preset" | tail -1)
fi
[ -f "$model/config.json" ] || { echo "no model at '$model' (the build failed, or MODEL is wrong)" >&2; exit 1; }
for i in $(seq "$servers"); do
    for label in A B; do
        tree=$([ $label = A ] && echo "$a" || echo "$b")
        TREE=$tree MODEL=$model timeout "${RUN_TIMEOUT:-120}" \
            bash benchmarks/bench_serve_gpu.sh "$work/$label$i" "$preset" "${options[@]}" > "$work/$label$i.log" 2>&1 \
            || echo "$label$i ended with an error: see $work/$label$i.log" >&2
        echo "$label$i: $(grep -c '^RESULT ' "$work/$label$i.log") rounds"
    done
done
python3 - "$work" "$servers" <<'PY'
import json, statistics, sys
from pathlib import Path
work, servers = Path(sys.argv[1]), int(sys.argv[2])
for label in "AB":
    medians, rounds, steady = [], [], []
    for i in range(1, servers + 1):
        log = work / f"{label}{i}.log"
        rows = [json.loads(l[len("RESULT "):]) for l in log.read_text().splitlines() if l.startswith("RESULT ")] if log.exists() else []
        values = [r["output_tokens_per_s"] for r in rows]
        marks = ["" if not (r.get("graphs_captured") or r.get("new_layouts")) else "*" for r in rows]
        print(f"{label}{i}: " + ", ".join(f"{v:,.0f}{m}" for v, m in zip(values, marks)))
        if values:
            medians.append(statistics.median(values))
        rounds += values
        steady += [v for v, m in zip(values, marks) if not m]
    if rounds:
        print(f"{label}: median of the runs' medians {statistics.median(medians):,.0f}, mean of {len(rounds)} rounds "
              f"{statistics.mean(rounds):,.0f}, mean of {len(steady)} steady rounds "
              f"{statistics.mean(steady) if steady else float('nan'):,.0f}  (* a round that captured a graph or met a new layout)")
PY
