#!/usr/bin/env bash
# `vlmctl serve` on one GPU: requests/s, output tokens/s, time to first token and rows per decode step at 1, 8 and 32
# concurrent clients (the decoding engine alone: benchmarks/bench_decode_gpu.py).
#   benchmarks/bench_serve_gpu.sh WORKDIR [PRESET] [BENCH_SERVE OPTIONS...]      # from the repository root
# Builds the PRESET (default qwen2.5-vl-3b) with random weights in bf16 under WORKDIR (reused when already built), then
# starts `vlmctl serve` on a free local port (log: WORKDIR/serve.log; --max-batch-size $MAX_BATCH, default 32), waits
# for its /health, runs benchmarks/bench_serve.py --url against it at concurrency 1,8,32 (default $REQUESTS=96 requests of 32
# tokens; later options override), and prints a table.
# The server is stopped (SIGTERM, then SIGKILL after 30 s) however the script ends. Python packages the machine lacks
# come from the wheel folder $WHEELS (default .wheels: py312/ for pydantic and friends, serve/ for openai, httpx,
# starlette, uvicorn), installed into /tmp/site, which goes on PYTHONPATH with the repository root.
# Time limits (seconds, environment): BUILD_TIMEOUT (420), START_TIMEOUT (240),
# BENCH_TIMEOUT (420). DEVICE (cuda) is the device served on (DEVICE=cpu with the tiny preset checks the script).
# MODEL=DIR serves that model folder instead of building the preset. TREE=DIR serves the `vlmctl` package of DIR
# (another tree's source, first on PYTHONPATH) with this tree's scripts (benchmarks/bench_serve_ab.sh). SERVE_ARGS: more `vlmctl serve` options (e.g.
# "--warmup-length 0"). TRACE=C records the timed round at concurrency C with the server's torch.profiler
# (`serve --profile-dir WORKDIR/profiles`, bench_serve.py --trace-at C; trace.json.gz and ops.txt per round, and the
# idle report printed). PROFILE=1 runs the server (and its engine and processor processes) under py-spy (its wheel
# in $WHEELS/tools, fetched with `pip download py-spy -d $WHEELS/tools`, as the message says) and prints each thread's busiest functions (benchmarks/pyspy_summary.py; samples: WORKDIR/serve.pyspy).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 WORKDIR [PRESET] [BENCH_SERVE OPTIONS...]" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mkdir -p "$1" && cd "$1" && pwd) preset=${2:-qwen2.5-vl-3b}
shift $(( $# < 2 ? $# : 2 ))
wheels=${WHEELS:-$root/.wheels} device=${DEVICE:-cuda}
export PYTHONPATH=${TREE:+$TREE:}$root:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cd "$root"

has() { python3 -c "import $1" >/dev/null 2>&1; }
install() {  # install the wheels of folder $1 into /tmp/site
    compgen -G "$wheels/$1/*.whl" >/dev/null || { echo "no wheels in $wheels/$1 (set WHEELS)" >&2; exit 1; }
    python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site "$wheels/$1"/*.whl
}
has pydantic || install py312
{ has openai && has starlette && has uvicorn; } || install serve
for module in torch transformers pydantic openai starlette uvicorn vlmctl; do
    has "$module" || { echo "python3 cannot import $module (PYTHONPATH=$PYTHONPATH)" >&2; exit 1; }
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
git -C "$root" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' || true

if [ -n "${MODEL:-}" ]; then  # a model folder built before (benchmarks/bench_generation_gpu.sh)
    model=$MODEL
else
    echo "== building $preset under $work"
    model=$(timeout "${BUILD_TIMEOUT:-420}" python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from bench_serve import preset_model
print(preset_model(Path(sys.argv[1]), sys.argv[2]))" "$work" "$preset" | tail -1)
fi
[ -f "$model/config.json" ] || { echo "the build left no $model/config.json" >&2; exit 1; }

port=$(python3 -c "from vlmctl.serve import free_port; print(free_port())")
url=http://127.0.0.1:$port
echo "== vlmctl serve at $url (log: $work/serve.log)"
trace=()
[ -n "${TRACE:-}" ] && trace=(--trace-at "$TRACE")
serve=(python3 -m vlmctl serve "$model" --device "$device" --port "$port" --max-batch-size "${MAX_BATCH:-32}" --model-name bench
       ${TRACE:+--profile-dir "$work/profiles"} ${SERVE_ARGS:-})
if [ -n "${PROFILE:-}" ]; then  # sample the server's Python stacks (every thread) with py-spy, summarized at the end
    has_spy() { command -v py-spy >/dev/null || [ -x /tmp/site/bin/py-spy ]; }
    if ! has_spy; then
        compgen -G "$wheels/tools/py_spy-*.whl" >/dev/null || { echo "PROFILE=1 needs the py-spy wheel in $wheels/tools: on a" \
            "machine with the package index, pip download py-spy --only-binary=:all: --platform manylinux2014_x86_64" \
            "--python-version 3.12 -d $wheels/tools" >&2; exit 1; }
        python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site "$wheels"/tools/py_spy-*.whl
    fi
    spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    (cd "${TREE:-$root}" && exec "$spy" record -r "${PROFILE_RATE:-100}" -t --subprocesses -f raw -o "$work/serve.pyspy" -- "${serve[@]}") \
        > "$work/serve.log" 2>&1 &
else
    # from TREE's folder: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
    (cd "${TREE:-$root}" && exec "${serve[@]}") > "$work/serve.log" 2>&1 &
fi
server=$!
stop_server() {
    if kill -0 "$server" 2>/dev/null; then
        if [ -n "${PROFILE:-}" ]; then  # stop the server under py-spy, which then writes its samples and exits
            pkill -INT -P "$server" 2>/dev/null || true
            for _ in $(seq 120); do kill -0 "$server" 2>/dev/null || break; sleep 0.5; done
        fi
        kill -TERM "$server" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$server" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$server" 2>/dev/null || true
    fi
    wait "$server" 2>/dev/null || true
}
trap stop_server EXIT
trap 'exit 130' INT TERM

deadline=$(( SECONDS + ${START_TIMEOUT:-240} ))
until python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)" "$url" 2>/dev/null; do
    if ! kill -0 "$server" 2>/dev/null; then
        echo "the server exited before answering /health:" >&2; tail -40 "$work/serve.log" >&2; exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
        echo "the server did not answer /health within ${START_TIMEOUT:-240} s:" >&2; tail -40 "$work/serve.log" >&2; exit 1
    fi
    sleep 1
done
python3 -c "import sys, urllib.request; print('health', urllib.request.urlopen(sys.argv[1] + '/health').read().decode())" "$url"

echo "== bench_serve.py at concurrency 1, 8, 32"
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_serve.py --url "$url" --device "$device" --concurrency 1,8,32 \
    --requests "${REQUESTS:-96}" --max-tokens 32 --max-batch-size "${MAX_BATCH:-32}" "${trace[@]}" "$@" | tee "$work/bench.log"
# the server's counters after every round (collated prefills and positions, graphs, the collector's pauses)
python3 -c "import sys, urllib.request; print('health after', urllib.request.urlopen(sys.argv[1] + '/health').read().decode())" "$url" || true
python3 - "$work/bench.log" <<'PY'
import json, sys
rows = [json.loads(line[len("RESULT "):]) for line in open(sys.argv[1]) if line.startswith("RESULT ")]
keys = ["concurrency", "warmup_passes", "requests_per_s", "output_tokens_per_s", "mean_latency_s", "ttft_ms_median", "rows_per_step",
        "ms_per_step", "busy_share", "graphs_captured", "new_layouts", "prefills", "prefill_ms", "inputs_ms", "decode_ms_per_step", "read_ms", "queue_ms", "gc_ms", "gc_full"]
print(" ".join(f"{k:>16}" for k in keys))
for r in rows:
    print(" ".join(f"{r.get(k, ''):>16}" for k in keys))
PY
if [ -n "${PROFILE:-}" ]; then
    stop_server
    [ -f "$work/serve.pyspy" ] && python3 benchmarks/pyspy_summary.py "$work/serve.pyspy" --top "${PROFILE_TOP:-45}"
fi
