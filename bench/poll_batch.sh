#!/usr/bin/env bash
# The `wait` end of a background batch on the GPU machine (bench/nvme/run_row.sh,
# bench/peers/side_by_side.sh): polls DIR/log until its "== done" line (up to POLL_S seconds,
# default 560, so a device call returns in time), prints the log's last BYTES, and packs
# DIR's PATHS into $OUT/TAR where OUT is set (what exists so far, also while the batch runs).
#
#   bash bench/poll_batch.sh DIR BYTES TAR PATH ...
set -uo pipefail
dir=${1:?DIR}; bytes=${2:?BYTES}; tarname=${3:?TAR}; shift 3
for ((i = 0; i < ${POLL_S:-560}; i += 10)); do
  grep -q "^== done" "$dir/log" 2>/dev/null && break
  sleep 10
done
tail -c "$bytes" "$dir/log"
[ -n "${OUT:-}" ] && tar czf "$OUT/$tarname" -C "$dir" "$@" 2>/dev/null
exit 0
