"""Sweep grid files (bench/grids/*.yaml), read without params.yaml: the rows and the optional
report metadata. `longft sweep` (run/sweep.py) validates the rows against params and queues them;
`longft report --grid` (metrics/grid_report.py) matches them to results.

A grid file is a YAML list of rows. Each row maps dotted param keys (`zero.offload_param`) to
values, plus an optional `name`; YAML anchors and `<<:` merge keys share values between rows. A
file that is one mapping (a params overlay, as `longft placement --out` writes) is one row, named
after the file (`overlay_name`). The first item may instead be report metadata, which
`longft sweep` ignores:

    - report: {x: train.micro_batch_size, series: [zero.offload_param]}   # both optional

`x` is the key on the plots' x axis (or `name`: one point per row, by row name); `series` the keys
whose combinations are drawn as separate lines. Without them `longft report` infers both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from longft.config.typed_yaml import DuplicateKeyError, load_yaml
from longft.errors import ProblemsError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""Experiment names that are valid git ref components and need no shell quoting."""
META_KEY = "report"
"""The key of the optional first item (report metadata, not a row)."""
META_FIELDS = ("x", "series")


class GridError(ProblemsError, ValueError):
    """Problems in a grid file; the message lists every one."""


@dataclass(frozen=True)
class GridRow:
    name: Optional[str]
    overrides: dict[str, Any]
    """Dotted param key -> value, in file order."""
    number: int = 1
    """Position among the grid's rows, from 1."""

    @property
    def label(self) -> str:
        return f"row {self.number}" + (f" ({self.name})" if self.name else "")

    @property
    def stem(self) -> str:
        """The file name (no suffix) of the row's bench overlay and result."""
        return self.name or f"row{self.number}"


@dataclass(frozen=True)
class GridMeta:
    """The optional `report:` item: plot axes chosen by the grid's author."""
    x: Optional[str] = None
    series: Optional[tuple[str, ...]] = None


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = value


def nest(flat: dict[str, Any]) -> dict:
    """{"zero.stage": 3} -> {"zero": {"stage": 3}} (a params overlay)."""
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _meta(item: dict, problems: list[str]) -> GridMeta:
    body = item[META_KEY]
    where = f"the {META_KEY}: item"
    if not isinstance(body, dict):
        problems.append(f"{where}: expected a mapping with {' and/or '.join(META_FIELDS)}")
        return GridMeta()
    unknown = sorted(str(k) for k in body if k not in META_FIELDS)
    if unknown:
        problems.append(f"{where}: unknown key(s) {', '.join(unknown)} "
                        f"(known: {', '.join(META_FIELDS)})")
    x = body.get("x")
    if x is not None and not isinstance(x, str):
        problems.append(f"{where}: x must be a dotted param key or `name`, got {x!r}")
        x = None
    series = body.get("series")
    if isinstance(series, str):
        series = [series]
    if series is not None and not (isinstance(series, list)
                                   and all(isinstance(s, str) for s in series)):
        problems.append(f"{where}: series must be a list of dotted param keys, got {series!r}")
        series = None
    return GridMeta(x, None if series is None else tuple(series))


def parse_grid_meta(raw: Any) -> tuple[list[GridRow], GridMeta, list[str]]:
    """Rows and metadata of a loaded grid file, and the problems with its shape (not with the
    params)."""
    problems: list[str] = []
    meta = GridMeta()
    if isinstance(raw, dict) and raw and set(raw) != {META_KEY}:
        raw = [raw]    # one overlay: one row
    if isinstance(raw, list) and raw and isinstance(raw[0], dict) and set(raw[0]) == {META_KEY}:
        meta = _meta(raw[0], problems)
        raw = raw[1:]
    if not isinstance(raw, list) or not raw:
        return [], meta, problems + [
            "expected a non-empty YAML list of rows (mappings of dotted param keys), or one "
            "mapping of params (an overlay)"]
    rows, names = [], set()
    for i, item in enumerate(raw):
        where = f"row {i + 1}"
        if not isinstance(item, dict):
            problems.append(f"{where}: expected a mapping of dotted param keys, got {item!r}")
            continue
        if META_KEY in item and set(item) == {META_KEY}:
            problems.append(f"{where}: the {META_KEY}: item must come first")
            continue
        item = dict(item)
        name = item.pop("name", None)
        if name is not None:
            if not isinstance(name, str) or not NAME_RE.fullmatch(name):
                problems.append(f"{where}: name {name!r} must match {NAME_RE.pattern}")
                name = None
            elif name in names:
                problems.append(f"{where}: name {name!r} is used by an earlier row")
            else:
                names.add(name)
        flat: dict[str, Any] = {}
        for key, value in item.items():
            if not isinstance(key, str) or not all(key.split(".")):
                problems.append(f"{where}: {key!r} is not a dotted param key")
                continue
            _flatten(value, key, flat)
        if not flat:
            problems.append(f"{where}: no params to set")
        clash = [k for k in flat if any(other.startswith(k + ".") for other in flat)]
        for key in clash:  # "zero: 3" and "zero.stage: 2" in one row cannot both apply
            problems.append(f"{where}: {key} is set both as a value and as a section")
        if not clash:
            rows.append(GridRow(name, flat, i + 1))
    return rows, meta, problems


def overlay_name(path: Path) -> str:
    """The experiment name of a one-overlay file: its file name without .yaml, made a valid name
    (overlay.lora-r-16.yaml -> overlay.lora-r-16)."""
    stem = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).stem))
    return stem.strip("-._") or "overlay"   # matches NAME_RE


def parse_grid(raw: Any) -> tuple[list[GridRow], list[str]]:
    """Rows of a loaded grid file (the metadata item skipped), and the problems with its shape."""
    rows, _, problems = parse_grid_meta(raw)
    return rows, problems


def read_raw(path: Path) -> Any:
    """The loaded YAML of a grid file, with the strict loader (a key given twice is refused);
    GridError for a file that is missing or does not parse."""
    path = Path(path)
    try:
        return load_yaml(path.read_text())
    except DuplicateKeyError as e:
        raise GridError([e.problem], str(path)) from None
    except FileNotFoundError:
        raise GridError(["no such grid file"], str(path)) from None
    except (OSError, yaml.YAMLError) as e:
        raise GridError([str(e)], str(path)) from None


def read_grid(path: Path) -> tuple[list[GridRow], GridMeta]:
    """Rows and metadata of a grid file; GridError listing every problem with its shape."""
    rows, meta, problems = parse_grid_meta(read_raw(path))
    if problems:
        raise GridError(problems, str(path))
    return rows, meta
