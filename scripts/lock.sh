#!/usr/bin/env bash
# The environment's lock, from pyproject.toml's ranges (uv, from the set-up's .venv or PATH).
#
#   bash scripts/lock.sh                  # write requirements/lock-cpu.txt (commit it on its own)
#   bash scripts/lock.sh --images         # both images' pins resolve together: Python 3.12, x86_64
#   bash scripts/lock.sh --upgrade-check  # newest versions in a temp venv: what changes, what breaks
#
# The lock is the CPU/dev environment (CPython 3.11, x86_64 Linux: this project's machines and CI):
# exact versions with hashes of pyproject's dependencies and its `test` extra, constrained by
# requirements/common.txt (the images' shared pins: the lock agrees with them) and requirements/cpu.txt
# (torch's CPU build, a wheel on local disk: --find-links). scripts/setup.sh installs exactly it;
# tests/test_lock.py checks it against pyproject and common.txt.
#
# --images resolves requirements/common.txt with v100.txt, and with ampere.txt (with pyproject's own
# ranges), for CPython 3.12 on x86_64 manylinux_2_28, as the Dockerfiles install them: metadata only,
# nothing is installed (the CUDA wheels are not downloaded). flash-attn's wheel (a URL outside the
# package registries) is left out.
#
# --upgrade-check locks the newest versions pyproject's ranges allow (common.txt not applied) into a
# temporary file, prints each version that moves, installs them into a temporary venv and runs the fast
# test tier there. Exit status: pytest's (0: the newest versions pass; then re-pin common.txt and lock).
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-}
if [ -z "$UV" ]; then
  if [ -x .venv/bin/uv ]; then UV=.venv/bin/uv; else UV=$(command -v uv || true); fi
fi
if [ -z "$UV" ]; then
  echo "scripts/lock.sh needs uv: run scripts/setup.sh (the lock has it), or pip install uv" >&2
  exit 2
fi
FIND_LINKS=${FIND_LINKS:-/opt/wheels}   # where torch's CPU wheel lies (pip config find-links)
CPU=(--python-version 3.11 --python-platform x86_64-manylinux_2_28 --find-links "$FIND_LINKS")

lock() {  # lock OUT [extra uv args]: pyproject + test extra -> OUT, with hashes
  local out=$1; shift
  "$UV" pip compile pyproject.toml --extra test -c requirements/cpu.txt "$@" "${CPU[@]}" \
    --generate-hashes --emit-find-links --custom-compile-command "bash scripts/lock.sh" \
    --quiet -o "$out"
}

case "${1:-}" in
  "")
    lock requirements/lock-cpu.txt -c requirements/common.txt
    # sealed: its sha256 and pin count as its last line, so a lock cut short is refused (lockfile.py)
    PYTHONPATH=src python3 -m longft.engine.lockfile --seal requirements/lock-cpu.txt
    n=$(grep -c '==' requirements/lock-cpu.txt)
    echo "wrote requirements/lock-cpu.txt: $n packages ($(sha256sum requirements/lock-cpu.txt | cut -c1-16))"
    ;;
  --images)
    for image in v100 ampere; do
      echo "== Dockerfile.$image: requirements/common.txt + requirements/$image.txt, CPython 3.12, x86_64"
      "$UV" pip compile pyproject.toml requirements/common.txt "requirements/$image.txt" \
        --python-version 3.12 --python-platform x86_64-manylinux_2_28 --no-header --no-annotate \
        --quiet -o "${TMPDIR:-/tmp}/longft-$image-resolved.txt"
      grep -E '^(torch|triton|deepspeed|transformers|nvidia-cuda-runtime-cu12)==' \
        "${TMPDIR:-/tmp}/longft-$image-resolved.txt" | tr '\n' ' '
      echo "($(grep -c '==' "${TMPDIR:-/tmp}/longft-$image-resolved.txt") packages resolve)"
    done
    ;;
  --upgrade-check)
    tmp=$(mktemp -d)
    lock "$tmp/lock-newest.txt" --upgrade
    python3 - requirements/lock-cpu.txt "$tmp/lock-newest.txt" <<'PY'
import re, sys
pin = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
def pins(p):
    return {m[1].lower(): m[2] for m in map(pin.match, open(p)) if m}
old, new = pins(sys.argv[1]), pins(sys.argv[2])
moved = [f"  {n}: {old.get(n, '-')} -> {new.get(n, '-')}" for n in sorted(old | new) if old.get(n) != new.get(n)]
print(f"newest versions within pyproject's ranges: {len(moved)} differ from the lock")
print("\n".join(moved) or "  (none)")
PY
    echo "installing them into $tmp/venv and running the fast test tier there ..."
    python3 -m venv "$tmp/venv"
    "$tmp/venv/bin/python" -m pip install -q --require-hashes --no-deps -r "$tmp/lock-newest.txt"
    "$tmp/venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
    "$tmp/venv/bin/python" -m longft.engine.opbuild
    set +e
    "$tmp/venv/bin/python" -m pytest -q -p no:cacheprovider
    code=$?
    set -e
    echo "upgrade check: pytest exit $code with the newest versions (venv and lock left in $tmp)"
    exit $code
    ;;
  *)
    sed -n 2,6p "$0" >&2
    exit 2
    ;;
esac
