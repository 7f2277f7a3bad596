#!/usr/bin/env bash
# Does the data path keep the GPU busy on video? `vlmctl train` on real video clips (MP4 files decoded and sampled
# by `data prepare`, stored clips decoded again by the loader's workers) against `vlmctl bench` on the same shapes
# (clips of the same frame counts and sizes made in memory), same model and training keys. Prints both tokens/s
# and their ratio; writes $OUT/video_train_vs_bench.json when $OUT is set.
#
#   bash benchmarks/video_train_vs_bench.sh                         # GPU: Qwen2.5-VL-3B preset, random init
#   PRESET=tiny-qwen2.5-vl N=12 FRAMES=4,8 SIZES=56,84 STEPS=3 WARMUP=1 TOKENS=4096 \
#     KEYS="train.precision=fp32 train.master_weights=fp32 train.activation_checkpointing=off" \
#     bash benchmarks/video_train_vs_bench.sh                       # a CPU smoke run
#
# Env: PRESET, N (clips), FRAMES (comma-separated frame counts), SIZES (px), FPS (of the clips; data.video.fps is
# set to it so every frame is kept), STEPS, WARMUP (first steps left out of train's figure; bench's --warmup),
# TOKENS (tokens per packed row), NPROC, WORKERS (train.num_workers), KEYS (more key=value for both sides), WORK
# (the folder to work in; a new temporary one by default). Both sides read the same vlmctl.yaml (step 2) plus KEYS.
# Train's figure is bench's: the tokens of the steps after WARMUP over their seconds (data waits included).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PRESET=${PRESET:-qwen2.5-vl-3b} N=${N:-480} FRAMES=${FRAMES:-16,32,48,64} SIZES=${SIZES:-224,336,448} FPS=${FPS:-8}
STEPS=${STEPS:-14} WARMUP=${WARMUP:-4} TOKENS=${TOKENS:-16384} NPROC=${NPROC:-1} WORKERS=${WORKERS:-4}
KEYS=${KEYS:-"train.precision=bf16 train.master_weights=bf16 train.activation_checkpointing=full"}
WORK=${WORK:-$(mktemp -d)}; mkdir -p "$WORK"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
cd "$WORK"

# 1. clips: N in all over every (frames, size) pair, written in parallel (benchmarks/video_clips.py: a square
#    that wraps around the frame, since generate_moving_shapes cannot make clips of more than ~20 frames)
python3 "$REPO/benchmarks/video_clips.py" clips "$N" "$FRAMES" "$SIZES" "$FPS"

# 2. the project: every frame kept (data.video.fps = the clips' fps), frames at their own size
cat > vlmctl.yaml <<EOF
project: {name: video-train-vs-bench}
data:
  sources: [{path: clips/all.json, format: sharegpt}]
  prepared_dir: prepared
  val_ratio: 0.0
  max_length: $TOKENS
  video: {fps: $FPS, max_frames: 64, min_pixels: 3136, max_pixels: 262144}
model: {preset: $PRESET, init: random, output_dir: model}
train: {stage: full, packing: true, tokens_per_batch: $TOKENS, warmup_ratio: 0.0, lr_scheduler: constant,
        max_steps: $STEPS, logging_steps: 1, save_steps: 1000000, output_dir: runs, run_name: video,
        nproc_per_node: $NPROC, num_workers: $WORKERS}
EOF
python3 -m vlmctl --quiet data prepare > prepare.log 2>&1 || { tail -20 prepare.log; exit 1; }
python3 -m vlmctl --quiet model build > build.log 2>&1 || { tail -20 build.log; exit 1; }

# 3. train on the prepared clips
python3 -m vlmctl --quiet train $KEYS > train.log 2>&1 || { tail -30 train.log; exit 1; }

# 4. bench on the same shapes (frames and sizes of the clips, one-word answers)
python3 -m vlmctl --quiet bench --json --steps $((STEPS - WARMUP)) --warmup "$WARMUP" --nproc-per-node "$NPROC" \
  --workload chat --text-tokens 4,16 --video-frames "$(echo "$FRAMES" | tr , '\n' | sort -n | sed -n '1p;$p' | paste -sd,)" \
  --video-sizes "$SIZES" $KEYS > bench.json 2> bench.log || { tail -30 bench.log; exit 1; }

# 5. the figures
python3 - "$WARMUP" "${OUT:-}" <<'PY'
import json, statistics, sys
from pathlib import Path

warmup, out = int(sys.argv[1]), sys.argv[2]
rows = [json.loads(line) for line in Path("runs/video/metrics.jsonl").read_text().splitlines() if line.strip()]
rows = [r for r in rows if "tokens_per_s" in r and r.get("step", 0) > warmup]
assert rows, f"no metrics rows after step {warmup} in runs/video/metrics.jsonl"
# as bench counts: all measured tokens over all measured seconds (logging_steps=1: one row per step)
tokens, seconds = sum(r["text_tokens"] + r["visual_tokens"] for r in rows), sum(r["step_time_s"] for r in rows)
text = Path("bench.json").read_text()
bench = json.loads(text[text.index("{"):])
mfus = [r["mfu"] * r["step_time_s"] for r in rows if r.get("mfu") is not None]
train = {"tokens_per_s": tokens / seconds, "mfu": sum(mfus) / seconds if len(mfus) == len(rows) else None,
         "steps": len(rows), "tokens_per_step": tokens / len(rows),
         "data_wait": statistics.mean(r["data_wait"] for r in rows) if all("data_wait" in r for r in rows) else None,
         "median_step_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows)}
result = {"train": train, "bench": {k: bench.get(k) for k in ("tokens_per_s", "mfu", "steps", "tokens_per_step", "data_wait", "peak_memory_gib", "settings", "media")},
          "ratio": train["tokens_per_s"] / bench["tokens_per_s"]}
mfu = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
pct = lambda x: "-" if x is None else f"{100 * x:.2f}%"  # noqa: E731
print(f"train: {train['tokens_per_s']:,.0f} tokens/s over {train['steps']} steps after {warmup}, MFU {mfu(train['mfu'])}, "
      f"{train['tokens_per_step']:,.0f} tokens/step, data wait {pct(train['data_wait'])}")
print(f"bench: {bench['tokens_per_s']:,.0f} tokens/s over {bench['steps']} steps, MFU {mfu(bench['mfu'])}, "
      f"{bench['tokens_per_step']:,.0f} tokens/step, data wait {pct(bench.get('data_wait'))} | {bench['media']} | {bench['settings']}")
print(f"train / bench: {result['ratio']:.3f}")
# An epoch's last row holds the samples left over (few tokens): in a short window it weighs on train's figure.
short = [r["step"] for r in rows if r["text_tokens"] + r["visual_tokens"] < 0.5 * train["tokens_per_step"]]
if short:
    print(f"note: step(s) {short} carried under half the mean tokens per step (an epoch's last row?): raise N")
if out:
    Path(out, "video_train_vs_bench.json").write_text(json.dumps(result, indent=1))
PY
