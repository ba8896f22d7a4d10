"""DVC stage `patch`: resolve every `auto` against this machine, record the patches, build the
DeepSpeed config.

    python stages/patch.py [--params params.yaml] [--out artifacts]

Writes artifacts/plan.json (choices with reasons, replaced modules, model-state sizes) and
artifacts/ds_config.json. Exits 2 with the list of problems when the request cannot run here.
"""

import argparse
import sys
from pathlib import Path

from longft.atomic import write_json
from longft.config.checks import notes
from longft.config.params import load
from longft.config.plan import Plan
from longft.errors import UserError
from longft.hardware import detect
from longft.run.patch_stage import make_plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default="artifacts")
    a = ap.parse_args()
    try:
        cfg = load(a.params)
        hw = detect()
        made, ds = make_plan(cfg, hw)
    except UserError as e:
        print(f"longft patch: {e}", file=sys.stderr)
        return 2
    plan = Plan.from_dict(made)  # the shape every reader expects, checked before it is written
    out = Path(a.out)
    write_json(out / "ds_config.json", ds)
    write_json(out / "plan.json", plan.to_dict())
    print(f"patch: {hw.gpu_name or 'CPU'} x{max(hw.gpu_count, 1)}, "
          f"{plan.model.n_params / 1e6:.1f}M params")
    for k, c in plan.resolved.items():
        print(f"  {k:14s} {str(c.value):18s} {c.reason}")
    print(f"  replaced       {dict(plan.patches.replaced_modules) or 'nothing'}")
    for n in notes(cfg):
        print(f"patch: note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
