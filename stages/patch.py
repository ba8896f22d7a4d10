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
from longft.config.params import ConfigError, load
from longft.hardware import detect
from longft.model.loading import ModelError
from longft.run.patch_stage import make_plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default="artifacts")
    a = ap.parse_args()
    try:
        cfg = load(a.params)
        hw = detect()
        plan, ds = make_plan(cfg, hw)
    except (ConfigError, ModelError) as e:
        print(f"longft patch: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    write_json(out / "ds_config.json", ds)
    write_json(out / "plan.json", plan)
    print(f"patch: {hw.gpu_name or 'CPU'} x{max(hw.gpu_count, 1)}, "
          f"{plan['model']['n_params'] / 1e6:.1f}M params")
    for k, c in plan["resolved"].items():
        print(f"  {k:14s} {str(c['value']):18s} {c['reason']}")
    print(f"  replaced       {plan['patches']['replaced_modules'] or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
