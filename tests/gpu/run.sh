#!/usr/bin/env bash
# The GPU suite (tests/gpu) on a device machine. Installs the packages the machine's image lacks from a wheel
# folder (VLMCTL_WHEELS, default .wheels: a copy of the shared wheels folder, with its install.sh), puts this
# source tree first on PYTHONPATH and runs pytest on tests/gpu; extra arguments go to pytest (e.g. -k two_gpus).
# Prints the suite's wall time and the GPUs it ran on. Without CUDA every test skips. VLMCTL_GPU_SHARDS=n (n GPUs):
# the two-GPU tests first, then n shards of the one-GPU tests at once, one per GPU (the two-GPU tests first: a call
# cut by its time limit then loses the end of a one-GPU shard, which any one-GPU machine can run, not them).
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=${VLMCTL_WHEELS:-.wheels}
if [ -f "$wheels/install.sh" ]; then
  # shellcheck disable=SC1091
  source "$wheels/install.sh" || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$(date +%s)
shards=${VLMCTL_GPU_SHARDS:-1}
if [ "$shards" -gt 1 ]; then
  # The two-GPU tests on all GPUs, then one pytest per GPU, each on its own shard of the one-GPU tests
  # (tests/gpu/conftest.py): the suite in about 1/n of its time on a machine of n GPUs.
  rc=0
  python3 -m pytest -q -p no:cacheprovider -rs tests/gpu -k two_gpus "$@" || rc=1
  pids=()
  for i in $(seq 0 $(( shards - 1 ))); do
    CUDA_VISIBLE_DEVICES=$i VLMCTL_GPU_SHARD=$i/$shards python3 -m pytest -q -p no:cacheprovider -rs tests/gpu \
      -k "not two_gpus" "$@" > "/tmp/gpu-shard-$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "== shard $i/$shards"; tail -25 "/tmp/gpu-shard-$i.log"
  done
else
  python3 -m pytest -q -p no:cacheprovider -rs tests/gpu "$@"
  rc=$?
fi
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)
echo "tests/gpu: exit $rc, $(( $(date +%s) - start )) s, on ${gpus:-no GPU}"
exit $rc
