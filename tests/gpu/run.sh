#!/usr/bin/env bash
# The GPU suite (tests/gpu) on a device machine. Installs the packages the machine's image lacks from a wheel
# folder (VLMCTL_WHEELS, default .wheels: a copy of the shared wheels folder, with its install.sh), puts this
# source tree first on PYTHONPATH and runs pytest on tests/gpu; extra arguments go to pytest (e.g. -k two_gpus).
# Prints the suite's wall time and the GPUs it ran on. Without CUDA every test skips.
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=${VLMCTL_WHEELS:-.wheels}
if [ -f "$wheels/install.sh" ]; then
  # shellcheck disable=SC1091
  source "$wheels/install.sh" || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -rs tests/gpu "$@"
rc=$?
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)
echo "tests/gpu: exit $rc, $(( $(date +%s) - start )) s, on ${gpus:-no GPU}"
exit $rc
