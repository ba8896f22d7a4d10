#!/usr/bin/env bash
# Issue 51's disk-offload row on the GPU machine, in one lease: the disk's own read and write
# bandwidth, then bench/configs/h200-3b-32k-nvme-cap24-host32.yaml through scripts/bench.py, with the
# optimizer states in files under the swap path (bench/nvme/README.md).
#
#   bash bench/nvme/run_row.sh start     # call 1 carries .whl and .aio; starts the batch (setsid), polls
#   bash bench/nvme/run_row.sh wait      # polls until done (POLL_S, default 560 s); packs $OUT/nvme.tgz
# (COMMIT=<sha> in the environment of `start` is recorded in the result JSON; NVME_DIR=<dir> picks
# the swap path, default /tmp/longft-nvme; ROW=<overlay stem> another row.)
#
# The batch, in /tmp/longft-nvme-run: wheels into /tmp/site; libaio from .aio where the image has
# none (aio_env.sh); DeepSpeed's async_io op built once (its log kept); the disk's filesystem and
# free space (disk_before.txt); bench/nvme/disk_bandwidth.py on the swap path (disk_bandwidth.json);
# the row (results/<row>.json: train.peak_disk holds the swap files' peak bytes against the
# estimator's disk item); the free space after (disk_after.txt).
set -uo pipefail
cd "$(dirname "$0")/../.."
W=/tmp/longft-nvme-run
POLL_S=${POLL_S:-560}
ROW=${ROW:-h200-3b-32k-nvme-cap24-host32}
cmd=${1:?start or wait}
case $cmd in
  start)
    rm -rf "$W" && mkdir -p "$W/out/results" && cp -r . "$W/repo"
    # a new session: the batch outlives this call (the device tool ends what a call leaves running)
    (cd "$W/repo" && setsid nohup bash bench/nvme/run_row.sh run > "$W/log" 2>&1 < /dev/null &)
    sleep 5; cat "$W/log"; [ "${2:-}" = "--no-wait" ] && exit 0 ;;   # else it polls, as wait does
  run)
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
    export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=$W/ext
    if [ -d .whl ] && [ ! -d /tmp/site/deepspeed ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        || { echo "== done (the wheels did not install)"; exit 1; }
    fi
    [ -x /tmp/site/bin/deepspeed ] || { mkdir -p /tmp/site/bin; printf '%s\n' '#!/bin/bash' \
      'exec python3 -c "import sys; from deepspeed.launcher.runner import main; sys.argv[0]=\"deepspeed\"; main()" "$@"' \
      > /tmp/site/bin/deepspeed; chmod +x /tmp/site/bin/deepspeed; }
    export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD/src
    echo "== libaio ($(date +%T))"
    ldconfig -p 2>/dev/null | grep libaio; ls /usr/include/libaio.h 2>&1
    # DeepSpeed's libaio check imports distutils, which Python 3.12 has only through setuptools
    python3 -c "import distutils.ccompiler, setuptools; print('distutils from setuptools', setuptools.__version__)"
    source bench/nvme/aio_env.sh .aio
    nvcc=$(command -v nvcc) && stubs=$(dirname "$(dirname "$nvcc")")/lib64/stubs \
      && [ -d "$stubs" ] && export LIBRARY_PATH=${LIBRARY_PATH:+$LIBRARY_PATH:}$stubs  # -lcuda at link time
    echo "== async_io build ($(date +%T))"
    python3 -c "import time; t=time.time()
from deepspeed.ops.op_builder import AsyncIOBuilder
b = AsyncIOBuilder(); print('is_compatible', b.is_compatible(verbose=True))
b.load(verbose=True); print(f'async_io built and loaded in {time.time()-t:.0f} s')" > $W/out/aio_build.log 2>&1
    echo "   rc $?: $(tail -1 $W/out/aio_build.log)"
    # the swap path: NVME_DIR, else the first of these on a disk (not tmpfs) with the most free space
    best= ; bestfree=0
    for d in ${NVME_DIR:-} /tmp/longft-nvme /var/tmp/longft-nvme /root/longft-nvme; do
      mkdir -p "$d" 2>/dev/null || continue
      t=$(stat -f -c %T "$d"); f=$(df -B1 --output=avail "$d" | tail -1)
      echo "   candidate $d: $t, $((f / 2**30)) GiB free"
      [ -n "${NVME_DIR:-}" ] && [ "$d" = "$NVME_DIR" ] && { best=$d; break; }
      case $t in tmpfs|ramfs) continue ;; esac
      [ "$f" -gt "$bestfree" ] && { best=$d; bestfree=$f; }
    done
    echo "== swap path $best ($(date +%T))"
    { df -B1 -T / /tmp "$best"; echo; findmnt -T "$best" 2>/dev/null; lsblk -b -o NAME,SIZE,ROTA,MODEL 2>/dev/null; } \
      > $W/out/disk_before.txt 2>&1; cat $W/out/disk_before.txt
    echo "== disk bandwidth ($(date +%T))"
    python3 bench/nvme/disk_bandwidth.py "$best" --size-gib 4 --out $W/out/disk_bandwidth.json \
      > $W/out/disk_bandwidth.log 2>&1
    echo "   rc $?: $(grep -E '"(engine|write_gib_s|read_gib_s)"' $W/out/disk_bandwidth.json | tr -d '\n ')"
    overlay=bench/configs/$ROW.yaml
    if [ "$best" != /tmp/longft-nvme ]; then  # same row name, another swap path
      mkdir -p $W/configs && sed "s#nvme_path: /tmp/longft-nvme#nvme_path: $best#" "$overlay" > $W/configs/$ROW.yaml
      overlay=$W/configs/$ROW.yaml
    fi
    echo "== $ROW ($(date +%T))"
    python3 scripts/bench.py "$overlay" --commit "${COMMIT:-unknown}" --work $W --results $W/out/results \
      > $W/out/results/$ROW.log 2>&1
    echo "   rc $?: $(grep -E "^[|] $ROW" $W/out/results/$ROW.log | tail -1)"
    df -B1 -T "$best" > $W/out/disk_after.txt 2>&1; ls -la "$best" >> $W/out/disk_after.txt 2>&1
    echo "== done ($(date +%T))"
    exit 0 ;;
  wait) ;;
  *) echo "run_row.sh: start or wait" >&2; exit 2 ;;
esac
POLL_S=$POLL_S bash bench/poll_batch.sh "$W" 6000 nvme.tgz out log
tail -5 "$W/out/results/$ROW.log" 2>/dev/null
exit 0
