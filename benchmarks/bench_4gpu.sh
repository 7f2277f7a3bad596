#!/usr/bin/env bash
# Four GPUs of one host: weak scaling, long rows over 4 sequence-parallel ranks, hybrid sharding 2 x 2 and
# `vlmctl train` on real data. One phase per call (each fits one device command of at most 10 minutes):
#   benchmarks/bench_4gpu.sh scaling WORKDIR      # 7B preset, `vlmctl bench --scaling 1,2,4`, default and skewed workloads
#   benchmarks/bench_4gpu.sh sp WORKDIR           # 7B preset, one 131,072-token row: SP=1 on GPU 0 beside SP=2 on
#                                                 # GPUs 2-3, then SP=4 on all four
#   benchmarks/bench_4gpu.sh hybrid-prepare WORKDIR  # the data and model of `hybrid` only (CPU work: start it in the
#                                                    # background before `sp`'s single-GPU row ends, then `wait $!`)
#   benchmarks/bench_4gpu.sh hybrid WORKDIR       # 3B preset built once: full sharding over 4 vs hybrid 2 x 2 (two
#                                                 # launchers of 2 processes on this host)
#   benchmarks/bench_4gpu.sh real WORKDIR         # `vlmctl train` with its defaults on the real sample data
#                                                 # (tests/fixtures/real, each source 100x) on 4 GPUs
#   benchmarks/bench_4gpu.sh profile12 WORKDIR    # needs only 2 GPUs: the scaling project on 1 and 2 GPUs, default
#                                                 # and skewed workloads, each with `vlmctl bench --profile`; prints
#                                                 # the figures and rank 0's idle report (where the 1 -> 2 GPU loss goes)
# Every figure is printed and written as JSON under WORKDIR (and $OUT when set).
set -uo pipefail
phase=$1 work=$2
mkdir -p "$work"
out=${OUT:-$work}
here=$(pwd)

bench_yaml() {  # the 7B scaling project of docs/benchmarks.md: pure bf16 (round to nearest), fixed settings
    cat > "$work/7b.yaml" <<'YAML'
project: {name: scaling}
model: {preset: qwen2.5-vl-7b, init: random}
train: {strategy: fsdp, stage: full, precision: bf16, master_weights: bf16, stochastic_rounding: "off",
        tokens_per_batch: 8192, warmup_ratio: 0.0, lr_scheduler: constant, activation_checkpointing: "off",
        compile: "off"}
YAML
}

show_runs() {  # one line per `vlmctl bench --json` result $out/NAME.json of the names given
    python3 - "$out" "$@" <<'PY'
import json, sys, pathlib
for name in sys.argv[2:]:
    try:
        r = json.loads((pathlib.Path(sys.argv[1]) / f"{name}.json").read_text())
    except Exception as exc:
        print(name, "no result:", exc); continue
    print(f"{name}: {r['tokens_per_s']:.0f} tok/s ({r['tokens_per_s'] / r['world_size']:.0f} per GPU), MFU {r['mfu']:.1%}, "
          f"step {r['step_time_s']:.3f} s, {r['tokens_per_step']:.0f} tokens/step, peak {r['peak_memory_gib']:.1f} GiB, "
          f"balance {r.get('balance')}" + (f", slowest step {max(r['step_times_s']):.3f} s (median "
          f"{sorted(r['step_times_s'])[len(r['step_times_s']) // 2]:.3f})" if r.get("step_times_s") else ""))
PY
}

case $phase in
scaling)
    bench_yaml
    C="-c $work/7b.yaml --steps ${STEPS:-6} --warmup ${WARMUP:-2} --scaling 1,2,4 --json"
    timeout 290 python3 -m vlmctl --quiet bench $C > "$out/scaling-default.json" 2> "$out/scaling-default.err"
    echo "default rc=$?"; tail -c 600 "$out/scaling-default.err"
    timeout 290 python3 -m vlmctl --quiet bench $C --image-sizes 224,448,672,896 --text-tokens 64,3072 \
        > "$out/scaling-skewed.json" 2> "$out/scaling-skewed.err"
    echo "skewed rc=$?"; tail -c 600 "$out/scaling-skewed.err"
    python3 - "$out" <<'PY'
import json, sys, pathlib
for name in ("default", "skewed"):
    p = pathlib.Path(sys.argv[1]) / f"scaling-{name}.json"
    try:
        rows = json.loads(p.read_text())["rows"]
    except Exception as exc:
        print(name, "no result:", exc); continue
    for r in rows:
        print(f"{name:8} {r['world_size']} GPUs  {r['tokens_per_s'] / r['world_size']:>8.0f} tok/s/GPU  eff {r.get('efficiency', 0):.1%}  "
              f"MFU {r['mfu']:.1%}  peak {r['peak_memory_gib']:.1f} GiB  balance {r.get('balance')}  balance_flops {r.get('balance_flops')}")
PY
    ;;
sp)
    bench_yaml
    C="-c $work/7b.yaml --steps 2 --warmup 1 --json --workload chat --text-tokens 121000,122000 --images-per-sample 8,8 \
       --image-sizes 448 train.activation_checkpointing=full"
    # SP=1 on GPU 0 and SP=2 on GPUs 2-3 side by side (one host, separate GPUs), then SP=4 on all four
    CUDA_VISIBLE_DEVICES=0 timeout ${SP_LIMIT:-280} python3 -m vlmctl --quiet bench $C --nproc-per-node 1 \
        train.tokens_per_batch=131072 > "$out/sp1.json" 2> "$work/sp1.err" &
    CUDA_VISIBLE_DEVICES=2,3 timeout ${SP_LIMIT:-280} python3 -m vlmctl --quiet bench $C --nproc-per-node 2 \
        train.sequence_parallel=2 train.tokens_per_batch=65536 > "$out/sp2.json" 2> "$work/sp2.err" &
    wait
    timeout ${SP_LIMIT:-280} python3 -m vlmctl --quiet bench $C --nproc-per-node 4 train.sequence_parallel=4 \
        train.tokens_per_batch=32768 > "$out/sp4.json" 2> "$work/sp4.err"
    for n in 1 2 4; do echo "sp$n:"; tail -c 400 "$work/sp$n.err"; done
    show_runs sp1 sp2 sp4
    ;;
hybrid-prepare|hybrid|real)
    real=$here/tests/fixtures/real
    mkdir -p "$work/data/raw" "$work/lf"
    ln -sfn "$real/llamafactory_mllm_demo" "$work/lf/data"  # the messages file names images from LLaMA-Factory's root
    python3 -c "from vlmctl.data.synthetic import generate_shapes_vqa; generate_shapes_vqa('$work/data/raw', num_samples=1024)" >/dev/null
    cd "$work"
    cat > vlmctl.yaml <<YAML
project: {name: hybrid}
data: {sources: [{path: data/raw/shapes_vqa.json, format: llava}], prepared_dir: data/prepared, val_ratio: 0.0}
model: {preset: ${PRESET:-qwen2.5-vl-3b}, init: random, dtype: bf16, output_dir: outputs/model}
train: {strategy: fsdp, stage: full, precision: bf16, master_weights: bf16, stochastic_rounding: "off",
        tokens_per_batch: 8192, warmup_ratio: 0.0, lr_scheduler: constant, learning_rate: 1.0e-5,
        activation_checkpointing: "off", compile: "off", max_steps: 8, save_steps: 1000, logging_steps: 1}
YAML
    cat > real.yaml <<YAML
project: {name: real}
data: {sources: [{path: $real/llava_examples/llava_format.json, weight: 100},
                 {path: $real/llamafactory_mllm_demo/mllm_demo.json, weight: 100},
                 {path: $real/llamafactory_mllm_demo/v1_multimodal_demo.jsonl, image_root: lf, weight: 100}],
       prepared_dir: data/real-prepared, val_ratio: 0.0}
model: {preset: ${PRESET:-qwen2.5-vl-3b}, init: random, dtype: bf16, output_dir: outputs/model}
train: {strategy: fsdp, stage: full, precision: bf16, tokens_per_batch: 8192, max_steps: 12, save_steps: 1000,
        logging_steps: 1}
YAML
    if [ "$phase" = hybrid-prepare ] || [ ! -f outputs/model/config.json ]; then
    python3 -m vlmctl --quiet data prepare --num-proc 8 >/dev/null || echo "prepare failed"
    python3 -m vlmctl --quiet -c real.yaml data prepare --num-proc 4 > real-prepare.log 2>&1 || { echo "real prepare failed"; tail -20 real-prepare.log; }
    start=$(date +%s)
    python3 -m vlmctl --quiet model build --force >/dev/null || echo "build failed"
    echo "model build: $(( $(date +%s) - start )) s"
    fi
    [ "$phase" = hybrid-prepare ] && exit 0
    if [ "$phase" = hybrid ]; then
    runs_here="full hybrid"
    timeout 150 python3 -m vlmctl train --nproc-per-node 4 train.run_name=full train.max_steps=${HYBRID_STEPS:-30} > full.log 2>&1; echo "full rc=$?"
    port=$(python3 -c "from vlmctl.distributed.env import free_port; print(free_port())")
    for node in 0 1; do
        CUDA_VISIBLE_DEVICES=$(( node * 2 )),$(( node * 2 + 1 )) timeout 150 python3 -m vlmctl train --launcher torchrun \
            --nproc-per-node 2 --nnodes 2 --node-rank $node --master-addr 127.0.0.1 --master-port "$port" \
            train.fsdp_sharding=hybrid train.run_name=hybrid train.max_steps=${HYBRID_STEPS:-30} > hybrid-$node.log 2>&1 &
    done
    wait; echo "hybrid done"
    else
    runs_here=real  # the defaults (auto checkpointing and compile, liger): the start-up probe and compile take minutes
    timeout ${REAL_LIMIT:-300} python3 -m vlmctl -c real.yaml train --nproc-per-node 4 train.run_name=real > real.log 2>&1
    echo "real rc=$?"
    fi
    for n in $runs_here; do f=$n.log; [ $n = hybrid ] && f=hybrid-0.log; echo "== $f"; grep -v "^\s*$" "$f" | tail -6; done
    python3 - outputs/runs "$out" $runs_here <<'PY'
import json, sys, pathlib
runs, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
summary = {}
for name in sys.argv[3:]:
    p = runs / name / "metrics.jsonl"
    if not p.is_file():
        print(name, "no metrics"); continue
    rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    later = rows[2:] or rows
    keys = [k for k in rows[0] if "tok" in k or k in ("mfu", "balance", "balance_flops", "step_time_s", "loss")]
    mean = {k: sum(r.get(k) or 0 for r in later) / len(later) for k in keys if isinstance(rows[0].get(k), (int, float))}
    summary[name] = {"losses": [r.get("loss") for r in rows], "mean_from_step_3": mean}
    print(name, json.dumps(summary[name]))
(out / f"{sys.argv[3]}.json").write_text(json.dumps(summary, indent=1))
PY
    for n in $runs_here; do cp outputs/runs/$n/metrics.jsonl "$out/metrics-$n.jsonl" 2>/dev/null; done
    cd "$here"
    ;;
profile12)
    bench_yaml
    for workload in default skewed; do
        args=(); [[ $workload == skewed ]] && args=(--image-sizes 224,448,672,896 --text-tokens 64,3072)
        for n in 1 2; do
            name=$workload-$n
            # EXTRA: more overrides (a smaller preset, say) for trying the phase out
            # TORCH_LOGS: a recompilation for a new shape lands in the .err file (the compiled vision kernels)
            TORCH_LOGS=recompiles timeout 200 python3 -m vlmctl --quiet bench -c "$work/7b.yaml" --steps "${STEPS:-4}" --warmup "${WARMUP:-3}" \
                --json --nproc-per-node $n --profile "$work/profile-$name" "${args[@]}" ${EXTRA:-} \
                > "$out/$name.json" 2> "$work/$name.err"  # $OUT keeps 8 files: the JSON and the idle reports
            echo "$name rc=$?"; tail -c 400 "$work/$name.err"
            if [[ -f "$work/profile-$name/rank0/trace.json.gz" ]]; then
                python3 -m vlmctl.profiling "$work/profile-$name/rank0/trace.json.gz" > "$out/idle-$name.txt"
                head -n 14 "$out/idle-$name.txt"
            fi
        done
    done
    show_runs default-1 default-2 skewed-1 skewed-2
    ;;
*)
    echo "unknown phase $phase (scaling, sp, hybrid-prepare, hybrid, profile12)"; exit 2 ;;
esac
