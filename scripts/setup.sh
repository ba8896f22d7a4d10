#!/usr/bin/env bash
# Set up longft in ./.venv (idempotent: a second run only checks). Used by the README's commands
# and by CI. On a machine without a GPU it installs the CPU build of torch.
#   bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import longft, deepspeed, transformers, dvc, dvclive, tensorboard, pytest, ruff" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    # No GPU: the CPU build of torch (this pin is the one the CPU wheel exists for).
    python -m pip install -q "torch==2.13.0"
  fi
  python -m pip install -q -e ".[test]"
fi
python - <<'PY'
import deepspeed, torch, transformers
print(f"longft env ok: torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
      f"transformers {transformers.__version__}, cuda {torch.cuda.is_available()}")
PY
