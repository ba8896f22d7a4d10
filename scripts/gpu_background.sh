#!/usr/bin/env bash
# Run scripts/gpu_suite.sh in the background on the GPU machine, so that a suite longer than one
# device call (10 minutes) keeps running while later calls poll it.
#
#   bash scripts/gpu_background.sh start [gpu_suite.sh args ...]   # copies the tree, starts, polls
#   bash scripts/gpu_background.sh wait                             # polls; packs $OUT/gpu-out.tgz
#
# The tree is copied to /tmp/longft-gpu/repo first, so a later call's sync of the working tree
# cannot change the code under a running suite. Each call polls for up to POLL_S seconds (570).
set -uo pipefail
W=/tmp/longft-gpu
POLL_S=${POLL_S:-570}
cmd=${1:?start or wait}; shift
if [ "$cmd" = start ]; then
  rm -rf "$W" && mkdir -p "$W/out" && cp -r "$(dirname "$0")/.." "$W/repo"
  (cd "$W/repo" && OUT="$W/out" setsid nohup bash scripts/gpu_suite.sh "$@" > "$W/log" 2>&1; \
   echo $? > "$W/rc") &
fi
for ((i = 0; i < POLL_S; i += 10)); do
  [ -f "$W/rc" ] && break
  sleep 10
done
tail -c 6000 "$W/log"
if [ -f "$W/rc" ]; then
  echo "gpu_background: finished, rc $(cat "$W/rc")"
else
  echo "gpu_background: still running"
fi
# one file back: the device tool returns at most 8 files a call (results, logs and the test log
# are more); unpack with tar xzf gpu-out.tgz (what exists so far, also while it runs)
[ -n "${OUT:-}" ] && cp "$W/log" "$W/out/suite.log" && tar czf "$OUT/gpu-out.tgz" -C "$W" out
exit 0
