"""Are the local inputs of a run DVC dependencies? params.yaml's `track` section names them and
dvc.yaml interpolates those paths into the deps of the stages that read them (`${track.data}`;
DVC cannot depend on a null param, so the default is the shipped placeholder
configs/nothing-to-track). A local data.path, model.name or model.tokenizer that its track entry
does not cover would leave `dvc status` "up to date" after the file changed; the prepare stage
refuses to run then (stages/prepare.py), naming the line to add. Run outside DVC (no DVC_ROOT in
the environment, which `dvc repro` / `dvc exp run` set for every stage: scripts/bench.py, `longft
max-context --confirm`, a stage by hand), nothing is tracked anyway, and it only says so.

Covered: the entry is the path itself or a directory above it. Not local (nothing to track): a
hub id or dataset name, configs/models and configs/tokenizers (already deps of every stage that
reads them).
"""

from __future__ import annotations

import os
from pathlib import Path

from longft.config.params import Config, ConfigError

_SHIPPED = ("configs/models", "configs/tokenizers")


def _covers(entry: str, path: Path) -> bool:
    e, p = Path(entry).resolve(), path.resolve()
    return p == e or e in p.parents


def _shipped(path: Path) -> bool:
    return any(_covers(d, path) for d in _SHIPPED)


def local_inputs(cfg: Config) -> list[tuple[str, str, Path]]:
    """(track key, the param that names it, its path) for each local input of cfg."""
    out = []
    d, m = cfg.data, cfg.model
    if d.path and d.source in ("jsonl", "parquet", "hf") and Path(d.path).exists():
        out.append(("data", "data.path", Path(d.path)))  # an hf name that is no directory: a hub id
    name = Path(m.name)
    if m.source == "pretrained" and name.is_dir():
        out.append(("model", "model.name", name))
    elif m.source == "random" and name.suffix == ".json" and name.is_file() and not _shipped(name):
        out.append(("model", "model.name", name))
    if m.tokenizer and Path(m.tokenizer).exists() and not _shipped(Path(m.tokenizer)):
        out.append(("tokenizer", "model.tokenizer", Path(m.tokenizer)))
    return out


def untracked(cfg: Config) -> list[str]:
    """One problem per local input that its track entry does not cover, with the fix."""
    problems = []
    for key, param, path in local_inputs(cfg):
        entry = getattr(cfg.track, key)
        if not _covers(entry, path):
            problems.append(
                f"track.{key}: {param} is the local path {str(path)!r} but track.{key} is {entry!r}, "
                f"so DVC would not see it change (dvc.yaml's deps interpolate track.{key}); set "
                f"track.{key}: {str(path)} in params.yaml (or -S track.{key}={path})")
    return problems


def check_tracked(cfg: Config, env=os.environ) -> list[str]:
    """Inside a DVC stage (DVC_ROOT set): raise a ConfigError listing every local input that is
    not a DVC dependency. Outside DVC: return those problems as notes to print."""
    problems = untracked(cfg)
    if problems and env.get("DVC_ROOT"):
        raise ConfigError(problems)
    return problems
