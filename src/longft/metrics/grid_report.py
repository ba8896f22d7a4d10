"""`longft report --from-json DIR --grid GRID.yaml`: one sweep grid's findings, from the bench
results of its rows (DIR/<row name>.json, as `longft sweep GRID --overlays` and scripts/bench.py
name them): a markdown table in grid order and, with `--plots`, DIR/<grid stem>.png.

    longft report --from-json bench/results --grid bench/grids/q1.yaml --plots plots/

A row without a result file is listed as not run. A result whose recorded params disagree with a
key its row sets (the grid was edited after the run) is flagged and left out of the table's
numbers and the plot, as is an incomplete run (OOM, killed).

The plots' x axis and series come from the rows (metrics/grid_axes.py), or from the grid's
first item `report: {x: KEY, series: [KEY, ...]}` (config/grid.py); `x: name` puts one point per
row, labelled by row name (for one-knob-at-a-time grids).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from longft.atomic import write_text
from longft.config.grid import GridMeta, GridRow, read_grid
from longft.errors import UserError
from longft.metrics import grid_plot
from longft.metrics.grid_axes import ROW_NAME, UNSET, Axes, GridReportError, hashable, infer_axes, value
from longft.metrics.report import Row, to_row
from longft.metrics.run_sources import bench_run

METRICS = ("tok/s", "tok/s per GPU", "MFU (%)", "Peak VRAM alloc (GiB)", "Peak DRAM RSS (GiB)",
           "GPU util (%)", "fwd (s)", "bwd (s)", "opt (s)")
DEFINITIONS = ("tok/s: non-padding tokens per second over all GPUs, warm-up steps excluded. MFU: "
               "model FLOPs utilisation of the dense bf16/fp16 peak. Peak VRAM alloc: torch max "
               "allocated on the busiest GPU. Peak DRAM RSS: the whole process tree. GPU util: "
               "mean NVML utilisation over the timed steps and GPUs. fwd/bwd/opt: median seconds "
               "per step (slowest rank).")


@dataclass(frozen=True)
class Point:
    """One grid row with a usable result."""
    row: GridRow
    result: Row
    train: dict

    def metric(self, key: str) -> Optional[float]:
        v = self.train.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return float(v) if ok else None

    @property
    def per_gpu(self) -> Optional[float]:
        got = self.metric("tokens_per_s_per_gpu")
        tps = self.result.tokens_per_s
        return got if got is not None else None if tps is None else tps / self.result.gpus


@dataclass(frozen=True)
class GridResults:
    path: Path
    rows: list[GridRow]
    axes: Axes
    points: dict[int, Point]
    """Row number -> its point."""
    status: dict[int, str]
    """Row number -> why it has no point: "not run", "params differ", "failed"."""
    notes: list[str]


# -- results -----------------------------------------------------------------------------------

_MISSING = object()


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def same(a: Any, b: Any) -> bool:
    """Grid value == recorded value: 1e5 and 100000 agree, True and 1 do not, lists by item."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def differences(row: GridRow, doc: dict) -> list[str]:
    """Each key the row sets that the result's params (else its overlay) record otherwise."""
    out = []
    for key, want in row.overrides.items():
        got = _lookup(doc.get("params"), key)
        if got is _MISSING:
            got = _lookup(doc.get("overlay"), key)
        if got is _MISSING:
            out.append(f"{key} {want!r} in the grid, not recorded in the result")
        elif not same(want, got):
            out.append(f"{key} {want!r} in the grid, {got!r} in the result")
    return out


def collect(path: Path, rows: list[GridRow], meta: GridMeta, folder: Path) -> GridResults:
    """Match each row to folder/<row name>.json."""
    axes = infer_axes(rows, meta, str(path))
    points: dict[int, Point] = {}
    status: dict[int, str] = {}
    notes: list[str] = []
    not_run = []
    for row in rows:
        file = Path(folder) / f"{row.stem}.json"
        if not file.is_file():
            status[row.number] = "not run"
            not_run.append(row.stem)
            continue
        try:
            doc = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            status[row.number] = "failed"
            notes.append(f"failed: {row.stem}: {file} is not readable JSON ({e})")
            continue
        run = bench_run(doc, row.stem)
        diff = differences(row, doc) if isinstance(doc, dict) else []
        if diff:  # checked first: an edited grid is the thing to fix, whatever the run did
            status[row.number] = "params differ"
            notes.append(f"PARAMS DIFFER (not used): {row.stem}: " + "; ".join(diff)
                         + " (re-run the row, or restore the grid)")
            continue
        got = to_row(run) if not isinstance(run, str) else run
        if isinstance(got, str):
            status[row.number] = "failed"
            notes.append(f"failed: {row.stem}: {got}")
            continue
        points[row.number] = Point(row, got, run.train)
    if not_run:
        notes.insert(0, f"not run ({len(not_run)} of {len(rows)}, no <name>.json in {folder}): "
                     + ", ".join(not_run))
    return GridResults(Path(path), rows, axes, points, status, notes)


# -- the table ---------------------------------------------------------------------------------

def label(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(label(x) for x in v) + "]"
    return str(v)


def _fmt(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _metric_cells(p: Point) -> list[str]:
    r = p.result
    mfu = p.metric("mfu")
    return [_fmt(r.tokens_per_s, ",.0f"), _fmt(p.per_gpu, ",.0f"),
            _fmt(None if mfu is None else mfu * 100, ".1f"), _fmt(r.vram_gib, ".1f"),
            _fmt(r.dram_gib, ".1f"), _fmt(p.metric("gpu_util_mean_pct"), ".0f"),
            *(_fmt(p.metric(k), ".2f") for k in ("fwd_s", "bwd_s", "opt_s"))]


def table_keys(axes: Axes) -> list[str]:
    """x, the series keys, then the other varying keys (those x and the series imply)."""
    first = [k for k in (axes.x, *axes.series) if k != ROW_NAME]
    return first + [k for k in axes.varying if k not in first]


def render(res: GridResults, source: str = "") -> str:
    """Markdown: a heading with the axes, the table in grid order, definitions, notes."""
    ax = res.axes
    how = "inferred" if ax.inferred else "from the grid's report: item"
    lines = [f"### {res.path.stem} ({res.path})", "",
             f"x: {ax.x}; series: {', '.join(ax.series) or 'none'} ({how}). "
             f"{len(res.points)} of {len(res.rows)} rows measured.", ""]
    keys = table_keys(ax)
    head = ["Row", *keys, *METRICS]
    lines += ["| " + " | ".join(head) + " |",
              "|" + "---|" * (1 + len(keys)) + "---:|" * len(METRICS)]
    for row in res.rows:
        p = res.points.get(row.number)
        cells = _metric_cells(p) if p else [res.status[row.number]] + [""] * (len(METRICS) - 1)
        lines.append("| " + " | ".join([row.stem, *(label(value(row, k)) for k in keys), *cells])
                     + " |")
    lines += ["", DEFINITIONS + (f" Source: {source}." if source else "")]
    if res.notes:
        lines += [""] + [f"- {n}" for n in res.notes]
    return "\n".join(lines) + "\n"


# -- the plot ----------------------------------------------------------------------------------

def x_scale(values: list[Any]) -> str:
    """"log2" for positive numbers spanning 4x or more, "linear" for other numbers, else
    "category" (grid order)."""
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        lo, hi = min(values), max(values)
        return "log2" if lo > 0 and hi / lo >= 4 else "linear"
    return "category"


def plot_data(res: GridResults) -> tuple[str, list[tuple[float, str]], grid_plot.Series]:
    """The x scale, the ticks and the series of a grid's points (x over all its rows)."""
    xs = list(dict.fromkeys(hashable(value(r, res.axes.x)) for r in res.rows))
    raw = {h: json.loads(h) if h != hashable(UNSET) else UNSET for h in xs}
    scale = x_scale(list(raw.values()))
    pos = {h: (float(v) if scale != "category" else float(i))
           for i, (h, v) in enumerate(raw.items())}
    ticks = [(pos[h], label(v)) for h, v in raw.items()]
    series: grid_plot.Series = {}
    for row in res.rows:
        p = res.points.get(row.number)
        if p is None:
            continue
        name = ", ".join(f"{k}={label(value(row, k))}" for k in res.axes.series) or res.path.stem
        r = p.result
        series.setdefault(name, []).append((pos[hashable(value(row, res.axes.x))], {
            "tok_s": r.tokens_per_s, "vram": r.vram_gib, "dram": r.dram_gib,
            "util": p.metric("gpu_util_mean_pct"), "fwd": p.metric("fwd_s"),
            "bwd": p.metric("bwd_s"), "opt": p.metric("opt_s")}))
    return scale, ticks, {k: sorted(v, key=lambda t: t[0]) for k, v in series.items()}


def write_plot(res: GridResults, out_dir: Path) -> Path:
    """out_dir/<grid stem>.png."""
    scale, ticks, series = plot_data(res)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"{res.path.name}: {len(res.points)} of {len(res.rows)} rows measured"
    path = out_dir / f"{res.path.stem}.png"
    path.write_bytes(grid_plot.png(title, res.axes.x, scale, ticks, series))
    return path


# -- command line (longft report --grid: cli/main.py) ------------------------------------------------------------

def main(args) -> int:
    """`longft report --from-json DIR --grid GRID [--grid ...] [--out FILE] [--plots DIR]`."""
    prog = "longft report"
    if not args.from_json:
        print(f"{prog}: --grid matches bench result files: give --from-json DIR", file=sys.stderr)
        return 2
    if not args.from_json.is_dir():
        print(f"{prog}: {args.from_json} is not a folder", file=sys.stderr)
        return 2
    try:
        results = []
        for path in args.grid:
            rows, meta = read_grid(path)
            results.append(collect(path, rows, meta, args.from_json))
        empty = [r for r in results if set(r.status.values()) == {"not run"}
                 and len(r.status) == len(r.rows)]
        if empty:
            raise GridReportError("no results at all: " + "; ".join(
                f"{r.path} has none of its {len(r.rows)} rows' result files in {args.from_json}"
                f" ({r.rows[0].stem}.json, ...)" for r in empty))
    except UserError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    source = f"bench results in {args.from_json}"
    text = "\n".join(render(r, source) for r in results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text(args.out, text)
        print(f"{prog}: {len(results)} grid(s) -> {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    for r in results:
        for note in r.notes:
            if note.startswith("PARAMS DIFFER"):
                print(f"{prog}: {r.path}: {note}", file=sys.stderr)
        if args.plots:
            if r.points:
                print(f"{prog}: {write_plot(r, args.plots)}", file=sys.stderr)
            else:
                print(f"{prog}: {r.path}: no usable result, no plot", file=sys.stderr)
    return 0
