"""GRPO's per-step figures from a run's metrics.jsonl: rollouts, rollouts/s, rollout and train seconds, the
generation share of the step, the mean completion length and the rollout/trainer log-prob gap (mean, max), then one
`GRPO {json}` line of their means over the steps after the first (the first builds and captures what later steps
reuse).

Usage: python benchmarks/grpo_table.py RUN/metrics.jsonl   (benchmarks/bench_grpo_gpu.sh, bench_generation_gpu.sh)
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print(f"{'step':>4} {'rollouts':>8} {'rollouts/s':>10} {'rollout s':>9} {'train s':>8} {'gen share':>9} {'length':>7} "
          f"{'gap mean':>9} {'gap max':>8}")
    for r in rows:
        g, t = r.get("time/rollout_s", 0.0), r.get("time/train_s", 0.0)
        print(f"{r['step']:>4} {r.get('rollouts', 0):>8} {r.get('rollouts_per_s', 0):>10.1f} {g:>9.2f} {t:>8.2f} "
              f"{g / max(g + t, 1e-9):>9.1%} {r.get('completions/mean_length', 0):>7.1f} "
              f"{r.get('logprob_gap/mean', float('nan')):>9.4f} {r.get('logprob_gap/max', float('nan')):>8.4f}")
    later = rows[1:] or rows
    g = sum(r.get("time/rollout_s", 0.0) for r in later) / len(later)
    t = sum(r.get("time/train_s", 0.0) for r in later) / len(later)
    print("GRPO " + json.dumps({"steps": len(later), "rollouts_per_s": round(sum(r.get("rollouts_per_s", 0) for r in later) / len(later), 2),
                                "rollout_s": round(g, 3), "train_s": round(t, 3), "generation_share": round(g / max(g + t, 1e-9), 3),
                                "gap_mean": round(sum(r.get("logprob_gap/mean", 0) for r in later) / len(later), 5),
                                "gap_max": round(max(r.get("logprob_gap/max", 0) for r in later), 5)}))


if __name__ == "__main__":
    main(sys.argv[1])
