"""Experiment names for `longft sweep` (run/sweep.py): a one-overlay file's name made from its
content, and the names already taken on this commit, checked before DVC runs anything.

DVC refuses `dvc exp run -n NAME` where NAME already exists on the commit the experiment starts
from (`Experiment conflicts with existing experiment`, exit 255), after a queued sweep's earlier
rows have run. So an overlay's experiment is named after its file *and* a short hash of the params
it sets (overlay.yaml -> overlay-3fa8f8): two overlays written to the same file name never share
a name, and the same overlay twice is the same experiment. Before anything runs, every row's name
is looked up among the commit's experiments (DVC's public `dvc.api.exp_show`): one with the same
params is that row's result (skipped, and said so); one with other params is refused with the fix.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from longft.config.grid import GridRow, overlay_name
from longft.config.grid import nest as _nest
from longft.config.params import ConfigError, from_dict, merge, to_dict
from longft.config.typed_yaml import DuplicateKeyError, load_yaml

HASH_CHARS = 6
"""Hex digits of the params hash in an overlay's experiment name (16.7 M values: two different
overlays of one file name on one commit share one by chance about once in millions; the params
check below catches even that)."""


def overlay_experiment(path: Path, overrides: dict[str, Any]) -> str:
    """A one-overlay file's experiment name: the file's name (`overlay_name`) and a short hash of
    the params it sets, whatever their order or the file's comments (overlay.yaml ->
    overlay-3fa8f8)."""
    text = json.dumps(overrides, sort_keys=True, default=str)
    return f"{overlay_name(path)}-{hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]}"


@dataclass(frozen=True)
class Existing:
    """An experiment of the workspace's commit: its name, commit and state (None: it ran)."""
    name: str
    rev: str
    state: str | None

    @property
    def done(self) -> str:
        return f"already {self.state.lower()}" if self.state else "already ran"


def existing() -> dict[str, Existing]:
    """The experiments of the workspace's commit (HEAD), ran or queued, by name; {} where DVC
    cannot say (no DVC repository: `dvc exp run` will say so itself). A failed one is left out: it
    holds no experiment, and running its row again is how a sweep stopped by a failure is finished."""
    try:
        import dvc.api

        rows = dvc.api.exp_show()
    except Exception:  # noqa: BLE001 - not a git + DVC repository, or no commit yet
        return {}
    out: dict[str, Existing] = {}
    for r in rows:
        name = r.get("Experiment")
        if name and r.get("typ") != "baseline" and r.get("State") != "Failed" and name not in out:
            out[name] = Existing(name, str(r.get("rev")), r.get("State"))
    return out


def params_of(rev: str, params_path: Path) -> dict | None:
    """The params file of an experiment's commit, loaded; None where git cannot show it."""
    p = subprocess.run(["git", "show", f"{rev}:./{params_path.as_posix()}"], capture_output=True,
                       text=True)
    if p.returncode:
        return None
    try:
        return load_yaml(p.stdout) or {}
    except (DuplicateKeyError, yaml.YAMLError):
        return None


def _typed(raw: dict) -> dict:
    """Params as the pipeline reads them (types coerced, defaults filled in), so that 2 and 2.0,
    or a key left at its default, are the same params; the raw dict where they do not validate."""
    try:
        return to_dict(from_dict(raw))
    except ConfigError:
        return raw


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def differences(theirs: dict, ours: dict, most: int = 3) -> str:
    """The params that differ, `key: theirs -> ours`, at most `most` of them and how many more."""
    a, b = _flat(theirs), _flat(ours)
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    shown = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def against_existing(rows: list[GridRow], base: dict, params_path: Path,
                     taken: dict[str, Existing]) -> tuple[list[GridRow], list[str], list[str]]:
    """(the rows to run, a line for each row left out because its experiment exists with the
    same params, a problem for each row whose name an experiment of other params holds)."""
    run, same, clash = [], [], []
    for row in rows:
        ex = taken.get(row.name) if row.name else None
        if ex is None:
            run.append(row)
            continue
        ours = _typed(merge(base, _nest(row.overrides)))
        theirs = params_of(ex.rev, params_path)
        theirs = None if theirs is None else _typed(theirs)
        if theirs == ours:
            same.append(f"{row.label}: {ex.done} with these params on this commit (the same "
                        f"experiment, `dvc exp show`); left out. To run it again: "
                        f"`dvc exp remove {row.name}` first")
            continue
        what = ("other params (" + differences(theirs, ours) + ")" if theirs is not None
                else "params that cannot be read")
        clash.append(f"{row.label}: experiment {row.name!r} exists on this commit ({ex.done}) with "
                     f"{what}: give this run another name (`-n NAME` for an overlay, `name:` for a "
                     f"grid row) or remove that one (`dvc exp remove {row.name}`)")
    return run, same, clash
