#!/usr/bin/env bash
# Compare `vlmctl bench` between two source trees of vlmctl in one call on one machine, alternating A B A B ...
#   benchmarks/bench_ab.sh TREE_A TREE_B CONFIG [ROUNDS] [BENCH ARGS...]
# TREE_A / TREE_B: folders that hold a `vlmctl/` package (e.g. `git archive <commit> vlmctl | tar -x -C DIR`, and
# `.` for the working tree). Each run prints one JSON line prefixed with the tree's label; a table follows.
# ARGS_A / ARGS_B (environment, optional): arguments for one tree only, e.g. a key the other tree's schema lacks.
set -euo pipefail
a=$1 b=$2 config=$3 rounds=${4:-2}
shift $(( $# < 4 ? $# : 4 ))
out=${OUT:-/tmp}/bench_ab.jsonl
: > "$out"
for i in $(seq "$rounds"); do
  for label in A B; do  # by position: A and B may be the same tree with different ARGS_A / ARGS_B
    tree=$([ "$label" = A ] && echo "$a" || echo "$b")
    extra=$([ "$label" = A ] && echo "${ARGS_A:-}" || echo "${ARGS_B:-}")
    # shellcheck disable=SC2086
    line=$(cd "$(dirname "$config")" && PYTHONPATH="$(cd "$OLDPWD" && realpath "$tree")${PYTHONPATH:+:$PYTHONPATH}" \
           python3 -m vlmctl --quiet bench -c "$(basename "$config")" --json "$@" $extra |
           python3 -c 'import json, sys; t = sys.stdin.read(); print(json.dumps(json.loads(t[t.index("{"):])))')
    echo "{\"tree\": \"$label\", \"round\": $i, \"result\": $line}" | tee -a "$out"
  done
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'tree':4} {'round':>5} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9}")
for r in rows:
    x = r["result"]
    print(f"{r['tree']:4} {r['round']:>5} {x['tokens_per_s']:>10,.0f} {x['mfu'] * 100:>6.1f}% {x.get('peak_memory_gib', 0):>9.1f}")
for t in "AB":
    v = [r["result"]["tokens_per_s"] for r in rows if r["tree"] == t]
    if v:
        print(t, "median tokens/s", f"{sorted(v)[len(v) // 2]:,.0f}")
PY
