#!/usr/bin/env bash
# Everything that needs a GPU, in one go: the gpu-marked tests, then benchmark rows.
#
#   bash scripts/gpu_suite.sh [--no-tests] [overlay.yaml ...]
#
# On the project's GPU machine (no package index there), first build the missing wheels here with
# `../shared/device/wheels.sh .whl`, carry .whl, and this script installs them into /tmp/site.
# Results: $OUT/results/<row>.json (OUT defaults to ./gpu-out), test log: $OUT/gpu_tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/results"
if [ -d .whl ] && ! python3 -c "import deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# DeepSpeed's op builder cannot parse arch suffixes such as 9.0a (set by some CUDA images).
export TORCH_CUDA_ARCH_LIST=$(echo "${TORCH_CUDA_ARCH_LIST:-}" | sed -E 's/([0-9]+\.[0-9]+)[a-z]+/\1/g')
[ -n "$TORCH_CUDA_ARCH_LIST" ] || unset TORCH_CUDA_ARCH_LIST
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rc=0
if [ "${1:-}" = "--no-tests" ]; then
  shift
else
  python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ $# -gt 0 ]; then
  python3 scripts/bench.py "$@" --commit "${LONGFT_COMMIT:-unknown}" --results "$OUT/results" || rc=1
fi
exit $rc
