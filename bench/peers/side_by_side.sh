#!/usr/bin/env bash
# longft and Unsloth side by side on the GPU machine, in one lease: the same random-init checkpoint,
# the same token rows, LoRA, optimizer, steps and memory cap (bench/peers/README.md).
#
#   bash bench/peers/side_by_side.sh install           # call 1 carries .whl and .bnb; call 2 .peer
#   bash bench/peers/side_by_side.sh start TAG ...      # in the background (setsid): TAG = 32k 64k 16k
#   bash bench/peers/side_by_side.sh wait               # polls; packs $OUT/side.tgz
# (COMMIT=<sha> in the environment of `start` is recorded in longft's result JSONs.)
#
# Per TAG, longft's row bench/configs/side-8b-qlora-TAG-cap24.yaml runs first (scripts/bench.py,
# its prepared rows kept in /tmp/longft-side/<row>/data), then Unsloth's on those rows
# (bench/peers/unsloth_row.py). Results: /tmp/longft-side/out/results/*.json, logs beside them.
set -uo pipefail
cd "$(dirname "$0")/../.."
W=/tmp/longft-side
POLL_S=${POLL_S:-560}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
longft_path=/tmp/site:$PWD/src
peer_path=/tmp/usite:/tmp/site
cmd=${1:?install, start or wait}; shift
case $cmd in
  install)
    if [ -d .whl ] && [ ! -d /tmp/site/deepspeed ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    fi
    if [ -d .bnb ] && [ ! -d /tmp/site/bitsandbytes ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/bnb .bnb/*.whl \
        && cp -r /tmp/bnb/* /tmp/site/ || exit 1
    fi
    if [ -f .peer/usite.tar.xz ] && [ ! -d /tmp/usite/unsloth ]; then
      mkdir -p /tmp/usite && tar -xJf .peer/usite.tar.xz -C /tmp/usite || exit 1
    fi
    [ -x /tmp/site/bin/deepspeed ] || { mkdir -p /tmp/site/bin; printf '%s\n' '#!/bin/bash' \
      'exec python3 -c "import sys; from deepspeed.launcher.runner import main; sys.argv[0]=\"deepspeed\"; main()" "$@"' \
      > /tmp/site/bin/deepspeed; chmod +x /tmp/site/bin/deepspeed; }
    ls /tmp/site | head -50 | tr '\n' ' '; echo
    [ -d /tmp/usite/unsloth ] && PYTHONPATH=$peer_path timeout 300 python3 -c \
      "import unsloth, unsloth_zoo, bitsandbytes, transformers, torch; print('peer env:', unsloth.__version__, bitsandbytes.__version__, transformers.__version__, torch.__version__)"
    exit 0 ;;
  start)
    rm -rf "$W/out" "$W/log" && mkdir -p "$W/out/results"
    rm -rf "$W/repo" && cp -r . "$W/repo"
    # a new session: the batch outlives this call (the device tool ends what a call leaves running)
    (cd "$W/repo" && setsid nohup bash bench/peers/side_by_side.sh run "$@" > "$W/log" 2>&1 < /dev/null &)
    ;;
  run)
    export PATH=/tmp/site/bin:$PATH
    PYTHONPATH=$longft_path python3 bench/peers/make_checkpoint.py llama3.1-8b /tmp/llama3.1-8b 2>&1 | tail -3
    for tag in "$@"; do
      row=side-8b-qlora-$tag-cap24
      seq=$(python3 -c "import yaml;print(yaml.safe_load(open('bench/configs/$row.yaml'))['data']['max_seq_length'])")
      echo "== longft $row ($(date +%T))"
      PYTHONPATH=$longft_path python3 scripts/bench.py bench/configs/$row.yaml --commit "${COMMIT:-unknown}" \
        --work $W --results $W/out/results > $W/out/results/$row.log 2>&1
      echo "   rc $?: $(grep -E "^[|] $row" $W/out/results/$row.log | tail -1)"
      echo "== unsloth $row ($(date +%T))"
      PYTHONPATH=$peer_path python3 bench/peers/unsloth_row.py --model /tmp/llama3.1-8b --rows $W/$row/data \
        --seq "$seq" --steps 5 --warmup 2 --vram-limit-gib 22.1 --name unsloth-$row \
        --out $W/out/results/unsloth-$row.json > $W/out/results/unsloth-$row.log 2>&1
      echo "   rc $?: $(tail -1 $W/out/results/unsloth-$row.log)"
    done
    echo "== done ($(date +%T))"
    exit 0 ;;
  wait) ;;
  *) echo "side_by_side.sh: install, start or wait" >&2; exit 2 ;;
esac
POLL_S=$POLL_S bash bench/poll_batch.sh "$W" 5000 side.tgz out log
