#!/usr/bin/env bash
# Set up longft in ./.venv: exactly requirements/lock-cpu.txt (every version and hash), longft itself
# (editable), then DeepSpeed's CPU Adam built once (idempotent: a second run only checks). Used by the
# README's commands and by CI.
#   bash scripts/setup.sh
#
# The lock is the CPU/dev environment for CPython 3.11 on x86_64 Linux (scripts/lock.sh makes it;
# torch is the CPU build). On a machine with an NVIDIA GPU, torch alone is PyPI's build of the locked
# version (CUDA) and its own dependencies; metrics/env.json lists what then differs from the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=requirements/lock-cpu.txt
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c 'import platform as p, sys; sys.exit(sys.version_info[:2] != (3, 11) or p.machine() != "x86_64")'; then
  echo "scripts/setup.sh: $LOCK is for CPython 3.11 on x86_64 Linux, and .venv has $(python -c \
'import platform as p; print("CPython", p.python_version(), "on", p.machine())'): delete .venv and run again \
with PYTHON=python3.11, or lock for this Python (--python-version in scripts/lock.sh)" >&2
  exit 2
fi
# the lock is whole (its seal: nothing cut or edited since scripts/lock.sh wrote it) before anything
PYTHONPATH=src python -m longft.engine.lockfile --check "$LOCK" || exit 2
if ! python -c "import longft" 2>/dev/null || ! python -m longft.engine.lockfile >/dev/null 2>&1; then
  echo "installing $LOCK into .venv: $(grep -c '==' "$LOCK") packages at their locked versions and hashes ..."
  if command -v nvidia-smi >/dev/null 2>&1; then
    torch=$(sed -n 's/^torch==\([^+ ]*\).*/\1/p' "$LOCK")
    awk '/^torch==/ {skip=1; next} skip && /^ / {next} {skip=0; print}' "$LOCK" > .venv/lock-gpu.txt
    python -m pip install -q --require-hashes --no-deps -r .venv/lock-gpu.txt
    # PyPI's torch of the locked version is its CUDA build (not the CPU wheel on local disk)
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= python -m pip install -q "torch==$torch"
  else
    python -m pip install -q --require-hashes --no-deps -r "$LOCK"
  fi
  python -m pip install -q --no-deps --no-build-isolation -e .
fi
# pip freeze equals the lock for every locked package (else this lists each difference and stops)
command -v nvidia-smi >/dev/null 2>&1 || python -m longft.engine.lockfile
python -m pip check
# What a first run or first test would otherwise compile silently: built here, once, with progress.
python -m longft.engine.opbuild || echo "(the first run that offloads the optimizer will say the same)"
python - <<'PY'
import deepspeed, torch, transformers
print(f"longft env ok: torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
      f"transformers {transformers.__version__}, cuda {torch.cuda.is_available()}")
PY
