#!/usr/bin/env bash
# Everything that needs a GPU, in one go: the gpu-marked tests, then benchmark rows.
#
#   bash scripts/gpu_suite.sh [--no-tests] [overlay.yaml ...] [--grid GRID.yaml ...] \
#       [--max-context overlay.yaml GiB ...]
#
# --grid: every row of a sweep grid (bench/grids/), in the grid's order, as an overlay (`longft
# sweep GRID --overlays`); a row named in an earlier grid or overlay runs once.
# --max-context: after the rows, `longft max-context --confirm` for each overlay (merged onto
# params.yaml) at a GPU budget of GiB (a smaller card emulated with hardware.vram_limit_gib);
# the report goes to $OUT/results/<overlay>-<GiB>gib-maxctx.json.
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
rows=() maxctx=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--max-context" ]; then
    [ $# -ge 3 ] || { echo "gpu_suite: --max-context needs an overlay and a GiB budget" >&2; exit 2; }
    maxctx+=("$2" "$3"); shift 3
  elif [ "$1" = "--grid" ]; then
    [ $# -ge 2 ] || { echo "gpu_suite: --grid needs a grid file" >&2; exit 2; }
    dir=/tmp/longft-grid/$(basename "$2" .yaml)
    rm -rf "$dir"
    mapfile -t grid_rows < <(python3 -m longft.cli sweep "$2" --overlays "$dir") || exit 2
    [ ${#grid_rows[@]} -gt 0 ] || { echo "gpu_suite: $2 has no rows" >&2; exit 2; }
    rows+=("${grid_rows[@]}"); shift 2
  else
    rows+=("$1"); shift
  fi
done
# one run per row name (grids share their baseline rows)
declare -A seen=() && uniq=()
for r in ${rows[@]+"${rows[@]}"}; do
  n=$(basename "$r" .yaml); [ -n "${seen[$n]:-}" ] && continue; seen[$n]=1; uniq+=("$r")
done
rows=(${uniq[@]+"${uniq[@]}"})
if [ -n "${GPU_SUITE_DRY:-}" ]; then  # list what would run, run nothing
  printf 'row %s\n' ${rows[@]+"${rows[@]}"}; exit 0
fi
if [ ${#rows[@]} -gt 0 ]; then
  python3 scripts/bench.py "${rows[@]}" --commit "${LONGFT_COMMIT:-unknown}" --results "$OUT/results" || rc=1
fi
for ((i = 0; i < ${#maxctx[@]}; i += 2)); do
  ov=${maxctx[i]} gib=${maxctx[i+1]} name=$(basename "${maxctx[i]}" .yaml)
  work=/tmp/longft-maxctx/$name-${gib}gib
  mkdir -p "$work"
  python3 scripts/bench.py "$ov" --write-params "$work" || { rc=1; continue; }
  python3 -m longft.cli max-context --params "$work/$name.yaml" --gpu-mem "$gib" --confirm \
    --work "$work" --out "$OUT/results/$name-${gib}gib-maxctx.json" || rc=1
done
exit $rc
