"""The axes of a sweep grid's plot, from its rows alone (metrics/grid_report.py): x is one key
that varies over the rows; each combination of the other varying keys that x and the series do not
imply (data.num_samples that grows with the GPU count, say) is one line. Inferred: the x giving the
fewest lines, preferring a key that is not a batch or bookkeeping follower, then the one with the
fewest values, then the first in grid order. A grid's first item `report: {x: KEY, series: [...]}`
(config/grid.py) overrides either; `x: name` puts one point per row, labelled by row name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from longft.config.grid import GridError, GridMeta, GridRow
from longft.errors import UserError

FOLLOWERS = ("data.num_samples", "train.iterations", "train.warmup_iterations")
"""Keys a grid changes only to keep a run well-formed: last choice for x, first to drop."""
DERIVED = ("train.global_batch_size",)
"""Usually micro-batch x GPUs x accumulation: x only when nothing else explains the rows."""
UNSET = "(default)"
"""The value of a key that a row does not set (params.yaml's at run time)."""
ROW_NAME = "name"


class GridReportError(UserError, ValueError):
    """A grid that cannot be reported: no varying key, a bad report: item, or no results."""


@dataclass(frozen=True)
class Axes:
    x: str
    """A dotted key, or "name" (one point per row)."""
    series: tuple[str, ...]
    varying: tuple[str, ...]
    """Every key whose value differs between rows, in grid order."""
    inferred: bool


def value(row: GridRow, key: str) -> Any:
    if key == ROW_NAME:
        return row.stem
    return row.overrides.get(key, UNSET)


def hashable(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def varying_keys(rows: list[GridRow]) -> list[str]:
    keys = list(dict.fromkeys(k for r in rows for k in r.overrides))
    return [k for k in keys if len({hashable(value(r, k)) for r in rows}) > 1]


def _determined(rows: list[GridRow], key: str, by: list[str]) -> bool:
    """Whether `key`'s value follows from the values of `by` on every row."""
    seen: dict[str, str] = {}
    for r in rows:
        got = seen.setdefault(hashable([value(r, k) for k in by]), hashable(value(r, key)))
        if got != hashable(value(r, key)):
            return False
    return True


def _tier(key: str) -> int:
    return 2 if key in FOLLOWERS else 1 if key in DERIVED else 0


def series_keys(rows: list[GridRow], x: str, varying: list[str]) -> tuple[str, ...]:
    """The varying keys other than x, less those implied by x and the rest (followers first,
    then from the last key in grid order)."""
    keep = [k for k in varying if k != x]
    order = sorted(keep, key=lambda k: (-_tier(k), -varying.index(k)))
    for k in order:
        if _determined(rows, k, [x] + [s for s in keep if s != k]):
            keep.remove(k)
    return tuple(keep)


def n_series(rows: list[GridRow], keys: tuple[str, ...]) -> int:
    return len({hashable([value(r, k) for k in keys]) for r in rows})


def infer_axes(rows: list[GridRow], meta: GridMeta, source: str = "the grid") -> Axes:
    varying = varying_keys(rows)
    if meta.x == ROW_NAME:
        return Axes(ROW_NAME, meta.series or (), tuple(varying), inferred=False)
    if not varying:
        raise GridReportError(f"{source}: no key varies between its rows, so there is nothing to "
                              "plot against (set `report: {x: name}` to compare the rows)")
    problems = [f"report: {k} does not vary between the rows (varying: {', '.join(varying)})"
                for k in ([meta.x] if meta.x else []) + list(meta.series or ())
                if k not in varying]
    if meta.x and meta.series and meta.x in meta.series:
        problems.append(f"report: {meta.x} is both x and a series key")
    if problems:
        raise GridError(problems, source)
    if meta.x:
        series = meta.series if meta.series is not None else series_keys(rows, meta.x, varying)
        return Axes(meta.x, series, tuple(varying), inferred=False)
    candidates = [k for k in varying if k not in (meta.series or ())]
    if not candidates:
        raise GridError(["report: every varying key is a series key; name one as x"], source)
    scored = []
    for k in candidates:
        series = meta.series if meta.series is not None else series_keys(rows, k, varying)
        scored.append(((n_series(rows, series), _tier(k),
                        len({hashable(value(r, k)) for r in rows}), varying.index(k)), k, series))
    _, x, series = min(scored)
    return Axes(x, tuple(series), tuple(varying), inferred=meta.series is None)
