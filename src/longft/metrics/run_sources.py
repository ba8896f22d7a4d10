"""The runs a report covers (metrics/report.py, metrics/grid_report.py, metrics/results_table.py):
DVC revisions from `dvc exp show --json`, their detail files read from git at that revision, or
scripts/bench.py result files. Each is a `Run`; what is left out gets a note."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

DETAIL = ("metrics/train.json", "metrics/env.json")
"""A run's detail files: outputs committed with it, not DVC metrics."""


@dataclass(frozen=True)
class Run:
    """One measured revision: its params (a params.yaml mapping) and metrics."""
    name: str
    params: dict
    train: dict
    env: dict


def _metric(data: dict, path: str) -> dict:
    """The metrics file at `path` of one exp-show revision ({} when absent)."""
    got = ((data.get("metrics") or {}).get(path) or {}).get("data")
    return got if isinstance(got, dict) else {}


def git_detail(rev: str, path: str) -> dict:
    """A detail JSON of the run at `rev` ("workspace": the file here), {} when absent."""
    try:
        if rev == "workspace":
            text = Path(path).read_text()
        else:
            p = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
            if p.returncode:
                return {}
            text = p.stdout
        got = json.loads(text)
    except (OSError, json.JSONDecodeError):
        return {}
    return got if isinstance(got, dict) else {}


def _revision(rec: dict, name: str, state: Optional[str], notes: list[str],
              detail=git_detail) -> Optional[Run]:
    rev = rec.get("rev") or "?"
    label = name if rev == "workspace" or name == rev[:7] else f"{name} ({rev[:7]})"
    data = rec.get("data") or {}
    if state in ("queued", "running", "failed"):
        notes.append(f"{label}: {state}")
        return None
    if rec.get("error"):
        notes.append(f"{label}: {rec['error'].get('msg') or 'error'}")
        return None
    # runs before metrics/headline.json have their detail as exp-show metrics; later ones in git
    train, env = (_metric(data, p) for p in DETAIL)
    if not train and _metric(data, "metrics/headline.json"):
        train, env = (detail(rev, p) for p in DETAIL)
    if not train:
        notes.append(f"{label}: no metrics/train.json (not run)")
        return None
    params = ((data.get("params") or {}).get("params.yaml") or {}).get("data") or {}
    return Run(label, params, train, env)


def runs_from_exp_show(records: list[dict], detail=git_detail) -> tuple[list[Run], list[str]]:
    """Runs of a `dvc exp show --json` output (workspace, commits and their experiments), and
    a note for each revision left out. A run carried unchanged through several revisions (the
    workspace of a clean checkout, a commit of an applied experiment) is listed once.
    detail(rev, path) reads a detail JSON of a revision (default: git, in this directory)."""
    runs: list[Run] = []
    notes: list[str] = []
    for base in records:
        rev = base.get("rev") or "?"
        name = "workspace" if rev == "workspace" else base.get("name") or rev[:7]
        found = [_revision(base, name, None, notes, detail)]
        for exp in base.get("experiments") or []:
            state = (exp.get("executor") or {}).get("state")
            for rec in (exp.get("revs") or [])[:1]:  # revs[0] is the experiment's last commit
                found.append(_revision(rec, exp.get("name") or rec.get("name")
                                       or (rec.get("rev") or "?")[:7], state, notes, detail))
        runs += [r for r in found if r is not None]
    # The workspace goes last, so that the commit or experiment whose run it shows is named.
    seen: dict[str, Run] = {}
    for run in sorted(runs, key=lambda r: r.name == "workspace"):
        seen.setdefault(json.dumps([run.train, run.env], sort_keys=True), run)
    keep = {id(r) for r in seen.values()}
    return [r for r in runs if id(r) in keep], notes


def exp_show(all_commits: bool = False) -> list[dict]:
    """`dvc exp show --json` of the repository in the current directory."""
    cmd = [sys.executable, "-m", "dvc", "exp", "show", "--json"] + (["-A"] if all_commits else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"`dvc exp show --json` exited {p.returncode}: "
                           f"{(p.stderr or p.stdout).strip()[-2000:]}")
    return json.loads(p.stdout)


def bench_run(doc: Any, name: str) -> Run | str:
    """The run of one loaded scripts/bench.py result, or why it is not one."""
    if not isinstance(doc, dict) or not isinstance(doc.get("params"), dict):
        return "not a bench result (no params)"
    if not isinstance(doc.get("train"), dict):
        return f"no train metrics (status: {doc.get('status', '?')})"
    return Run(name, doc["params"], doc["train"],
               doc.get("env") if isinstance(doc.get("env"), dict) else {})


def read_bench(path: Path, name: str) -> Run | str:
    """The run of one scripts/bench.py result file, or why it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"not readable JSON ({e})"
    return bench_run(doc, name)


def runs_from_bench(folder: Path) -> tuple[list[Run], list[str]]:
    """Runs of scripts/bench.py result files (*.json with params, train and env) anywhere under
    `folder`, each named by its path relative to it."""
    runs, notes = [], []
    folder = Path(folder)
    for path in sorted(folder.rglob("*.json")):
        name = path.relative_to(folder).with_suffix("").as_posix()
        got = read_bench(path, name)
        if isinstance(got, Run):
            runs.append(got)
        else:
            notes.append(f"{name}: {got}")
    return runs, notes
