"""DVC stage `metrics`: raw per-rank measurements -> metrics/ (headline.json: the declared DVC
metrics; train.json and env.json: the detail; loss.csv, memory.csv, eval.csv: the plots;
memory.png, retrieval.png, report.md).

Run from the repository root:
    python stages/metrics.py [--run runs/train] [--plan artifacts/plan.json] [--out metrics]

A partial or failed run still gets every output, with status "incomplete". Exit status 2 with a
one-line message (no traceback) when the run directory does not exist.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from longft.metrics.summary import load_plan, write_run_metrics


def _fmt(x, unit: str = "", nd: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{nd}f}{unit}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/train", help="raw measurements of the train stage")
    ap.add_argument("--plan", default="artifacts/plan.json", help="for the model's FLOPs per token")
    ap.add_argument("--out", default="metrics")
    a = ap.parse_args()
    run_dir, plan_path = Path(a.run), Path(a.plan)
    if not run_dir.is_dir():
        print(f"longft metrics: run directory {run_dir} does not exist; run the train stage first "
              "(dvc repro train)", file=sys.stderr)
        return 2
    plan, why = load_plan(plan_path)
    if why:
        print(f"longft metrics: note: no usable {plan_path} ({why}); "
              "FLOPs per token and MFU will be null", file=sys.stderr)
    train = write_run_metrics(run_dir, plan, Path(a.out))
    vram, dram, loss = train["peak_vram"], train["peak_dram"], train["loss"]
    vram_gib = vram["max_reserved_gib"] if vram["max_reserved_gib"] is not None \
        else vram["nvml_used_gib"]
    print(f"metrics: {train['status']}, {train['steps']} steps; "
          f"{_fmt(train['tokens_per_s'], ' tokens/s', 1)}, "
          f"peak VRAM {_fmt(vram_gib, ' GiB')}, "
          f"peak DRAM {_fmt(dram['rss_tree_gib'], ' GiB')} (tree RSS), "
          f"loss {_fmt(loss['first'], '', 4)} -> {_fmt(loss['last'], '', 4)}"
          + ("" if train["mfu"] is None else f", MFU {100 * train['mfu']:.1f} %"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
