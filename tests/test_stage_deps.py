"""Every source file a DVC stage runs is one of its deps: follow each stage script's imports of
longft (function-level ones included, and the rank entry point the train stage launches) and
check each file reached is covered by a dep of that stage in dvc.yaml (the file, or a directory
above it). Without this, a change to a module DVC does not know about leaves `dvc repro` saying
"up to date" about results the code would no longer produce."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
ENTRY_MODULES = {"train": ["longft.engine.worker"]}
"""Modules a stage runs that its script does not import: the deepspeed launcher starts
`python -m longft.engine.worker` on every rank."""


def module_file(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _imported(path: Path, module: str | None) -> set[str]:
    """Names of the longft modules `path` imports anywhere in its body (lazy imports included)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if module else []
                base = base if is_pkg else base[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from longft.model import patches`
    return {m for m in out if m.split(".")[0] == "longft"}


def reached(script: Path, extra: list[str] = ()) -> set[Path]:
    """Every longft source file that running `script` (and `extra` modules) can execute."""
    files, todo = {script}, [(script, None), *[(module_file(m), m) for m in extra]]
    while todo:
        path, module = todo.pop()
        files.add(path)
        for name in _imported(path, module):
            parts = name.split(".")
            # importing a.b.c runs a/__init__.py and a/b/__init__.py too
            for i in range(1, len(parts) + 1):
                sub = ".".join(parts[:i])
                f = module_file(sub)
                if f is not None and f not in files:
                    files.add(f)
                    todo.append((f, sub))
    return files


def covered(path: Path, deps: list[str]) -> bool:
    rel = path.relative_to(REPO)
    return any(rel == Path(d) or Path(d) in rel.parents for d in deps)


STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_deps_cover_every_source_file_it_runs(stage):
    spec = STAGES[stage]
    script = REPO / spec["cmd"].split()[1]
    assert script.is_file(), f"{stage}: cmd does not start with `python <script>`"
    missing = sorted(str(p.relative_to(REPO)) for p in reached(script, ENTRY_MODULES.get(stage, []))
                     if not covered(p, spec["deps"]))
    assert not missing, f"dvc.yaml stage {stage} runs these files but does not list them as deps: {missing}"


def test_the_walker_follows_lazy_and_package_imports():
    """The walk itself: a function-level import, `from pkg import submodule`, and every package
    __init__ on the way are reached (if these stopped being found, the test above could not fail)."""
    files = {str(p.relative_to(REPO)) for p in reached(REPO / "stages/train.py", ["longft.engine.worker"])}
    assert "src/longft/metrics/summary.py" in files          # imported inside partial_metrics()
    assert "src/longft/engine/trainer.py" in files           # only through the worker
    assert "src/longft/__init__.py" in files and "src/longft/engine/__init__.py" in files
    assert not covered(REPO / "src/longft/engine/trainer.py", ["src/longft/engine/ds_config.py"])
    assert covered(REPO / "src/longft/engine/trainer.py", ["src/longft/engine"])
