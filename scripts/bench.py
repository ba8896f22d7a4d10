"""Run benchmark rows: each overlay YAML is merged onto params.yaml (or --base) and run through the
same four stages as `dvc repro` (prepare -> patch -> train -> metrics), in its own work folder; the
result goes to bench/results/<name>.json with the full params, the commit and the raw metrics
(with zero.offload_optimizer nvme, train.peak_disk: the swap files' peak bytes against the
estimator's disk item, and the disk's free space at the start, its least and at the end).

    python scripts/bench.py bench/configs/h200-1b-16k-gpu.yaml [more.yaml ...] \
        [--commit SHA] [--work /tmp/longft-bench] [--results bench/results] [--base params.yaml]

Use this where DVC is not installed (the GPU machine); elsewhere the same rows run as
`dvc exp run -S ...` experiments.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from longft.atomic import write_json, write_text  # noqa: E402
from longft.config.params import ConfigError, merge  # noqa: E402
from longft.config.typed_yaml import DuplicateKeyError, load_yaml  # noqa: E402
from longft.run.pipeline import run_params  # noqa: E402


def overlay_params(overlay_path: Path, base: Path) -> tuple[dict, dict, str]:
    """(the base params with the overlay merged on, the overlay, its bench_note). The strict
    loader, as params.load: a key given twice is a ConfigError, never the last one kept."""
    def read(path: Path) -> dict:
        try:
            return load_yaml(path.read_text()) or {}
        except DuplicateKeyError as e:
            raise ConfigError([e.problem], str(path)) from None

    overlay = read(overlay_path)
    note = overlay.pop("bench_note", "")
    return merge(read(base), overlay), overlay, note


def run_row(overlay_path: Path, base: Path, work_root: Path, results: Path, commit: str) -> dict:
    name = overlay_path.stem
    params, overlay, note = overlay_params(overlay_path, base)
    out = {"name": name, "note": note, "commit": commit, "overlay": overlay, "params": params,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"[bench] {name}: {note}", flush=True)
    # refuses bad rows (ConfigError) before any work
    run = run_params(params, work_root / name, str(overlay_path), echo=True)
    out["status"] = "ok"
    if run.failed:
        out["status"] = f"failed: stage {run.failed.name} exited {run.failed.code}"
        out["log_tail"] = run.failed.output.splitlines()[-80:]
    if run.metrics_failed:
        out["status"] += f"; metrics exited {run.metrics_failed.code}"
    for key, f in (("train", "metrics/train.json"), ("env", "metrics/env.json"),
                   ("plan", "artifacts/plan.json")):
        if (d := run.read_json(f)) is not None:
            out[key] = d
    if (d := run.read_json("run/profile/rank0.split.json")) is not None:  # output.profile_steps
        out["profile_split"] = d  # the trace stays in the work folder (too large to carry back)
    if "plan" in out:
        out["plan"] = {k: out["plan"][k] for k in ("resolved", "patches", "model", "batch",
                                                   "memory_estimate", "hardware")}
    write_json(results / f"{name}.json", out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overlays", nargs="+", type=Path)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--work", type=Path, default=Path("/tmp/longft-bench"))
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--base", type=Path, default=REPO / "params.yaml",
                    help="the params every overlay is merged onto (default: the repository's)")
    ap.add_argument("--write-params", type=Path, metavar="DIR",
                    help="only write each overlay merged onto the base params to DIR/<name>.yaml")
    a = ap.parse_args()
    if a.write_params:
        a.write_params.mkdir(parents=True, exist_ok=True)
        for o in a.overlays:
            write_text(a.write_params / f"{o.stem}.yaml",
                       yaml.safe_dump(overlay_params(o, a.base)[0], sort_keys=False))
        return 0
    rows = []
    for o in a.overlays:
        try:
            rows.append(run_row(o, a.base, a.work, a.results, a.commit))
        except ConfigError as e:
            print(f"[bench] {o}: {e}", file=sys.stderr)
            rows.append({"name": o.stem, "status": f"bad params: {e}"})
    print("\n| row | status | tokens/s | MFU | peak VRAM alloc GiB | peak DRAM GiB | NVMe swap GiB (predicted) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        t = r.get("train") or {}
        disk = t.get("peak_disk")  # offload_optimizer nvme only
        swap = f"{disk['swap_gib']} ({disk['predicted_gib']})" if disk else ""
        print(f"| {r['name']} | {r['status'][:60]} | {t.get('tokens_per_s')} | {t.get('mfu')} | "
              f"{(t.get('peak_vram') or {}).get('max_allocated_gib')} | "
              f"{(t.get('peak_dram') or {}).get('rss_tree_gib')} | {swap} |")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
