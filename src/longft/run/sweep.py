"""`longft sweep`: a grid of runs (or one overlay) as DVC experiments, one
`dvc exp run --queue -S ...` (or `dvc exp run --temp -S ...`) per row.

    longft sweep bench/grids/reference.yaml --dry-run       # print the dvc commands only
    longft sweep bench/grids/reference.yaml                 # queue every row
    longft sweep bench/grids/reference.yaml --run           # queue, then `dvc queue start --jobs 1`
    longft sweep bench/grids/reference.yaml --only '8b-*'   # the rows whose name matches
    longft sweep GRID.yaml --overlays bench/configs/grid    # scripts/bench.py overlays (no DVC)
    longft sweep overlay.yaml --temp                        # a `longft placement` overlay, run now
    longft sweep overlay.yaml --temp -n lora-16k            # ... under a name of one's own

With --temp each row runs now, one after another, in the foreground, as
`dvc exp run --temp -n NAME -S ...`: in a temporary copy of the workspace, which (params.yaml
included) stays as it is, so every row starts from the same params and a failed row leaves nothing
behind. A file that is one mapping (an overlay, as `longft placement --out` writes) is one row,
named after the file and a short hash of the params it sets (overlay.yaml -> experiment
overlay-3fa8f8; `-n NAME` names it instead), so overlays written to one file name one after
another never share a name. Before DVC runs anything, every row's name is looked up among the
experiments of this commit (run/sweep_names.py): one of the same params is left out and said so,
one of other params is refused with the fix.

A grid file is a YAML list of rows. Each row maps dotted param keys (`zero.offload_param`) to
values, plus an optional `name` for the experiment; YAML anchors and `<<:` merge keys share common
values between rows; an optional first item `report: {x: KEY, series: [KEY, ...]}` is for
`longft report --grid` and skipped here (config/grid.py reads grids). Every row is merged onto
./params.yaml and validated with the same checks as the pipeline *before* anything is queued; all
problems of all rows are reported together.
Queued runs start one at a time (`--jobs 1`): each run takes the whole GPU box.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from longft.atomic import write_text
from longft.config.grid import NAME_RE, GridError, GridRow, overlay_name, parse_grid, read_raw  # noqa: F401 (re-exported)
from longft.config.grid import nest as _nest
from longft.config.params import ConfigError, from_dict, merge
from longft.config.typed_yaml import DuplicateKeyError, load_yaml
from longft.run import sweep_names

_BARE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
_HYDRA_WORDS = {"true", "false", "null", "nan", "inf"}
START = ["queue", "start", "--jobs", "1"]
"""One run at a time: each takes the whole GPU box."""


class SweepError(GridError):
    """Problems in a grid file or in its rows merged onto params.yaml; the message lists every
    one."""


def validate(rows: list[GridRow], base: dict) -> list[str]:
    """Every problem of every row merged onto the base params, each prefixed with its row."""
    problems = []
    for row in rows:
        try:
            from_dict(merge(base, _nest(row.overrides)))
        except ConfigError as e:
            problems += [f"{row.label}: {p}" for p in e.problems]
    return problems


def read_base(base_path: Path = Path("params.yaml")) -> dict:
    """The params every row is merged onto; SweepError where they cannot be read."""
    try:
        return load_yaml(Path(base_path).read_text()) or {}
    except DuplicateKeyError as e:
        raise SweepError([e.problem], str(base_path)) from None
    except (OSError, yaml.YAMLError) as e:
        hint = "" if Path(base_path).is_file() else f" (run from the folder with {base_path})"
        raise SweepError([f"{e}{hint}"], str(base_path)) from None


def load(grid_path: Path, base_path: Path = Path("params.yaml"),
         only: tuple[str, ...] = (), name: str | None = None) -> list[GridRow]:
    """Read, select (`only`: name globs) and validate a grid; raise SweepError listing all
    problems. `name`: the experiment name of a one-overlay file (default: its file name and a
    hash of its params, `sweep_names.overlay_experiment`)."""
    try:
        raw = read_raw(grid_path)   # the strict loader: a key given twice is refused
    except GridError as e:
        raise SweepError(e.problems, str(grid_path)) from None
    base = read_base(base_path)
    rows, problems = parse_grid(raw)
    one = isinstance(raw, dict) and len(rows) == 1 and rows[0].name is None
    if name is not None and not NAME_RE.fullmatch(name):
        problems.append(f"-n {name!r} must match {NAME_RE.pattern}")
    elif name is not None and not one:
        problems.append("-n names the experiment of one overlay (a file that is one mapping of "
                        "params); a grid's rows are named by their `name:`")
    if one:
        rows = [dataclasses.replace(rows[0], name=name or sweep_names.overlay_experiment(
            grid_path, rows[0].overrides))]
    if only:
        rows = [r for r in rows if r.name and any(fnmatch.fnmatchcase(r.name, p) for p in only)]
        if not rows and not problems:
            problems.append(f"no row name matches {' or '.join(only)}")
    problems += validate(rows, base)
    if problems:
        raise SweepError(problems, str(grid_path))
    return rows


def hydra_value(value: Any) -> str:
    """A value as DVC's `-S key=value` (Hydra override grammar) reads it back unchanged."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, str):
        if _BARE_RE.fullmatch(value) and value.lower() not in _HYDRA_WORDS:
            return value
        # Hydra's quoted strings: \' is a quote; backslashes are literal, except a run of them
        # right before a quote (or the closing quote), which is doubled.
        value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
        return "'" + value.replace("'", "\\'") + "'"
    raise TypeError(f"cannot pass {value!r} to dvc exp run -S")


def queue_args(row: GridRow, how: str = "--queue") -> list[str]:
    """`dvc exp run --queue` (or `how`: --temp) arguments (after `dvc`) for one row."""
    args = ["exp", "run", how]
    for key, value in row.overrides.items():
        args += ["-S", f"{key}={hydra_value(value)}"]
    return args + (["-n", row.name] if row.name else [])


def shell_line(args: list[str]) -> str:
    """`dvc ...` as one would type it; every -S value in single quotes."""
    out = ["dvc"]
    for prev, arg in zip([""] + args, args):
        out.append("'" + arg.replace("'", "'\\''") + "'" if prev == "-S" else arg)
    return " ".join(out)


def write_overlays(rows: list[GridRow], out_dir: Path, note: str) -> list[Path]:
    """One scripts/bench.py overlay (nested params) per row: out_dir/<name>.yaml."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for row in rows:
        path = out_dir / f"{row.stem}.yaml"
        doc = {"bench_note": f"{note} {row.label}", **_nest(row.overrides)}
        write_text(path, yaml.safe_dump(doc, sort_keys=False))
        paths.append(path)
    return paths


def _untaken(rows: list[GridRow], base_path: Path = Path("params.yaml")) -> list[GridRow]:
    """The rows whose experiment does not exist on this commit yet (each one left out is said on
    stdout); SweepError listing every row whose name an experiment of other params holds."""
    run, same, clash = sweep_names.against_existing(rows, read_base(base_path), base_path,
                                                    sweep_names.existing())
    if clash:
        raise SweepError(clash, "the names of this commit's experiments")
    for line in same:
        print(f"longft sweep: {line}")
    return run


# -- command line ------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("grid", type=Path, help="YAML list of rows (dotted param keys, optional name)")
    p.add_argument("--only", nargs="+", default=(), metavar="GLOB",
                   help="only the rows whose name matches one of these globs")
    p.add_argument("--dry-run", action="store_true", help="print the dvc commands, run none")
    p.add_argument("-n", "--name", help="the experiment name of one overlay (default: the file's "
                   "name and a short hash of its params, e.g. overlay-3fa8f8)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--run", action="store_true",
                      help="after queuing, start the queue: dvc queue start --jobs 1")
    what.add_argument("--temp", action="store_true",
                      help="run each row now, one after another, with dvc exp run --temp (in a "
                      "temporary copy: the workspace and its params.yaml stay as they are)")
    what.add_argument("--overlays", metavar="DIR", type=Path,
                      help="write scripts/bench.py overlays (DIR/NAME.yaml) instead of queuing")


def main(args: argparse.Namespace) -> int:
    try:
        rows = load(args.grid, Path("params.yaml"), tuple(args.only), args.name)
        if not (args.dry_run or args.overlays):
            rows = _untaken(rows)
    except SweepError as e:
        print(f"longft sweep: {e}\nNothing was run or queued.", file=sys.stderr)
        return 2
    if not rows:
        print("longft sweep: nothing to run: every row's experiment exists with its params")
        return 0
    if args.overlays:
        for path in write_overlays(rows, args.overlays, f"{args.grid}"):
            print(path)
        return 0
    commands = [queue_args(row, "--temp" if args.temp else "--queue") for row in rows]
    commands += [START] if args.run else []
    if args.dry_run:
        for cmd in commands:
            print(shell_line(cmd))
        return 0
    for i, cmd in enumerate(commands):
        print(f"$ {shell_line(cmd)}", flush=True)
        code = subprocess.run([sys.executable, "-m", "dvc", *cmd]).returncode
        if code and args.temp:
            print(f"longft sweep: `{shell_line(cmd)}` exited {code}; {i} row(s) before it ran "
                  "(`dvc exp show`); the workspace is as it was", file=sys.stderr)
            return 1
        if code:
            print(f"longft sweep: `{shell_line(cmd)}` exited {code}; {min(i, len(rows))} row(s)"
                  " before it are queued (`dvc queue status`, `dvc queue remove NAME`)",
                  file=sys.stderr)
            return 1
    if args.temp:
        print(f"longft sweep: {len(rows)} experiment(s) ran; compare them with "
              "`dvc exp show --only-changed --drop '.*/|Created'`, or bring one into the "
              "workspace with `dvc exp apply NAME` (its params and metrics; `dvc repro` then trains its "
              "model)")
    elif args.run:
        print(f"longft sweep: {len(rows)} experiment(s) running one at a time; follow with "
              "`dvc queue status` and `dvc queue logs NAME`, then `longft report`")
    else:
        print(f"longft sweep: {len(rows)} experiment(s) queued; start them with "
              "`dvc queue start --jobs 1`")
    return 0
