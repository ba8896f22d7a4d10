#!/usr/bin/env bash
# Everything that needs a GPU, in one go: the gpu-marked tests, then benchmark rows.
#
#   bash scripts/gpu_suite.sh [--no-tests] [overlay.yaml ...] [--grid GRID.yaml ...] \
#       [--max-context-args "ARGS"] [--max-context overlay.yaml GiB ...] [--pytest "ARGS" ...] [--cmd "COMMAND" ...]
#   bash scripts/gpu_suite.sh --unpack-fa4libs    # only unpack .fa4libs (flash-attn-4, below)
#
# Without --no-tests, every gpu-marked test runs first; the items after it run in the order given.
# --grid: every row of a sweep grid (bench/grids/), in the grid's order, as an overlay (`longft
# sweep GRID --overlays`); a row named in an earlier grid or overlay runs once.
# --max-context: `longft max-context --confirm` for each overlay (merged onto
# params.yaml) at a GPU budget of GiB (a smaller card emulated with hardware.vram_limit_gib);
# the report goes to $OUT/results/<overlay>-<GiB>gib-maxctx.json and the last 20 kB of each
# run's log to $OUT/results/logs/<overlay>-<GiB>gib-seq-<L>.log; --max-context-args (e.g.
# "--host-mem 60 --max-seq 106496") are passed to the max-context items after it.
# --pytest "ARGS": the gpu-marked tests that ARGS select (e.g. "tests/test_gpu_qlora.py -k fp16"),
# logged to $OUT/gpu_tests-<n>.log. --cmd "COMMAND": any other command (a probe script), its output
# in $OUT/results/cmd-<n>.log.
#
# On the project's GPU machine (no package index there), first build the missing wheels here with
# `../shared/device/wheels.sh .whl`, carry .whl, and this script installs them into /tmp/site.
# flash-attn-4 (flash_attn.cute) takes two calls, its libraries being too big to travel with the
# rest: build .fa4 and .fa4libs here with scripts/fa4_payload.sh; call 1 carries .fa4libs and runs
# `bash scripts/gpu_suite.sh --unpack-fa4libs` (unpacks .fa4libs/libs.tar.xz to /tmp/fa4libs, then
# exits); call 2, on the still warm machine, carries .whl and .fa4 and runs the suite, which
# installs .fa4/*.whl into /tmp/site, copies /tmp/fa4libs over it and puts /tmp/site and
# /tmp/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH (the .pth file that would add the
# latter is not read from a PYTHONPATH folder).
# Results: $OUT/results/<row>.json (OUT defaults to ./gpu-out), test log: $OUT/gpu_tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
# flash-attn-4 is set up only where there is a GPU (nvidia-smi), not where the tests run this
# script on a CPU machine (whose checkout may hold .fa4 and .fa4libs too). Its CUDA-13 libraries
# (nvidia-cutlass-dsl-libs-cu13's files, as in site-packages) are unpacked by a call of their own
# (--unpack-fa4libs) or by this one; into a folder beside, renamed when complete, so that an
# interrupted unpack leaves no half of it behind.
gpu=$(command -v nvidia-smi || true)
if [ ! -d /tmp/fa4libs ] && [ -f .fa4libs/libs.tar.xz ] \
    && { [ -n "$gpu" ] || [ "${1:-}" = "--unpack-fa4libs" ]; }; then
  rm -rf /tmp/fa4libs.part && mkdir -p /tmp/fa4libs.part
  { tar -xJf .fa4libs/libs.tar.xz -C /tmp/fa4libs.part \
      || python3 -m tarfile -e .fa4libs/libs.tar.xz /tmp/fa4libs.part; } \
    && mv /tmp/fa4libs.part /tmp/fa4libs || { echo "gpu_suite: cannot unpack .fa4libs/libs.tar.xz" >&2; exit 1; }
fi
if [ "${1:-}" = "--unpack-fa4libs" ]; then
  [ -d /tmp/fa4libs ] || { echo "gpu_suite: --unpack-fa4libs: no .fa4libs/libs.tar.xz here" >&2; exit 1; }
  du -sh /tmp/fa4libs
  exit 0
fi
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/results"
if [ -d .whl ] && ! python3 -c "import deepspeed" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
fi
# flash-attn-4 after .whl (pip --target skips a top-level folder that exists, such as bin/, and
# .whl's should win): its wheels, then the libraries over them, then the DSL's own import root
fa4_path=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
if [ -n "$gpu" ] && [ -d .fa4 ] && ! PYTHONPATH=$fa4_path:${PYTHONPATH:-} python3 -c "import flash_attn.cute" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .fa4/*.whl || exit 1
  if [ -d /tmp/fa4libs ]; then
    cp -a /tmp/fa4libs/. /tmp/site/ || exit 1
  else
    echo "gpu_suite: /tmp/fa4libs is missing (carry .fa4libs first, with --unpack-fa4libs):" \
      "flash_attn.cute will not import" >&2
  fi
fi
if [ -n "$gpu" ] && [ -d .fa4 ]; then
  export PYTHONPATH=$fa4_path:${PYTHONPATH:-}
fi
# hardware.bind_cores runs the ranks under numactl, which the GPU machine lacks: Debian's numactl
# and libnuma1 packages carried in .whl (`apt-get download numactl libnuma1`) are unpacked here
if ! command -v numactl >/dev/null 2>&1 && compgen -G ".whl/numactl_*.deb" >/dev/null; then
  mkdir -p /tmp/longft-debs
  for d in .whl/*.deb; do
    dpkg-deb -x "$d" /tmp/longft-debs 2>/dev/null || ar p "$d" data.tar.xz | tar xJ -C /tmp/longft-debs
  done
  export PATH=/tmp/longft-debs/usr/bin:$PATH \
    LD_LIBRARY_PATH=/tmp/longft-debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  numactl --show >/dev/null || echo "gpu_suite: the carried numactl does not run here" >&2
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
# The items run in the order given: rows (one bench.py run each; a row named twice, also by a
# grid, runs once), max-context confirmations and test selections.
jobs=()
declare -A seen=()
add_row() {
  local n; n=$(basename "$1" .yaml)
  [ -n "${seen[$n]:-}" ] && return; seen[$n]=1; jobs+=("row	$1")
}
mc_args=""
while [ $# -gt 0 ]; do
  if [ "$1" = "--max-context" ]; then
    [ $# -ge 3 ] || { echo "gpu_suite: --max-context needs an overlay and a GiB budget" >&2; exit 2; }
    jobs+=("max-context	$2	$3	$mc_args"); shift 3
  elif [ "$1" = "--max-context-args" ]; then
    [ $# -ge 2 ] || { echo "gpu_suite: --max-context-args needs its arguments in one word" >&2; exit 2; }
    mc_args=$2; shift 2
  elif [ "$1" = "--cmd" ]; then
    [ $# -ge 2 ] || { echo "gpu_suite: --cmd needs a command in one word" >&2; exit 2; }
    jobs+=("cmd	$2"); shift 2
  elif [ "$1" = "--pytest" ]; then
    [ $# -ge 2 ] || { echo "gpu_suite: --pytest needs pytest arguments in one word" >&2; exit 2; }
    jobs+=("pytest	$2"); shift 2
  elif [ "$1" = "--grid" ]; then
    [ $# -ge 2 ] || { echo "gpu_suite: --grid needs a grid file" >&2; exit 2; }
    dir=/tmp/longft-grid/$(basename "$2" .yaml)
    rm -rf "$dir"
    mapfile -t grid_rows < <(python3 -m longft.cli sweep "$2" --overlays "$dir") || exit 2
    [ ${#grid_rows[@]} -gt 0 ] || { echo "gpu_suite: $2 has no rows" >&2; exit 2; }
    for r in "${grid_rows[@]}"; do add_row "$r"; done
    shift 2
  else
    add_row "$1"; shift
  fi
done
if [ -n "${GPU_SUITE_DRY:-}" ]; then  # list what would run, run nothing
  for j in ${jobs[@]+"${jobs[@]}"}; do echo "${j//	/ }"; done
  exit 0
fi
n_tests=0 n_cmds=0
for j in ${jobs[@]+"${jobs[@]}"}; do
  IFS=$'\t' read -r kind a b c <<< "$j"
  echo "gpu_suite: $(date -u +%H:%M:%S) ${j//	/ }"
  case $kind in
    row)
      python3 scripts/bench.py "$a" --commit "${LONGFT_COMMIT:-unknown}" --results "$OUT/results" || rc=1 ;;
    max-context)
      name=$(basename "$a" .yaml) work=/tmp/longft-maxctx/$name-${b}gib
      mkdir -p "$work"
      python3 scripts/bench.py "$a" --write-params "$work" || { rc=1; continue; }
      # shellcheck disable=SC2086  # the extra arguments are words
      python3 -m longft.cli max-context --params "$work/$name.yaml" --gpu-mem "$b" $c --confirm \
        --work "$work" --out "$OUT/results/$name-${b}gib-maxctx.json" || rc=1
      # each run's log (its step lines) comes back too: the last 20 kB of each
      mkdir -p "$OUT/results/logs"
      for log in "$work"/seq-*/log.txt; do
        [ -f "$log" ] || continue
        seq=$(basename "$(dirname "$log")")
        tail -c 20000 "$log" > "$OUT/results/logs/$name-${b}gib-$seq.log"
      done ;;
    pytest)
      n_tests=$((n_tests + 1))
      # eval: ARGS may quote, as in -k 'fp16 or 8bit'
      eval "python3 -m pytest -m gpu -q -p no:cacheprovider $a" 2>&1 | tee "$OUT/gpu_tests-$n_tests.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    cmd)
      n_cmds=$((n_cmds + 1))
      eval "$a" 2>&1 | tee "$OUT/results/cmd-$n_cmds.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
  esac
done
exit $rc
