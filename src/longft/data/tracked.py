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

Kept out of git: `dvc exp run` commits every file git does not ignore into the experiment's ref,
so a local input with files that are neither git-ignored nor already in git (a model's
safetensors, say) is refused the same way, with `dvc add PATH` as the fix: DVC then keeps it in
its cache and writes PATH.dvc and a .gitignore entry.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from longft.config.params import Config, ConfigError
from longft.config.sections import PATH_SOURCES

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
    if d.path and d.source in PATH_SOURCES and Path(d.path).exists():
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


def git_would_add(path: Path) -> list[str]:
    """Files under path that neither git ignores nor git has (`git add -A` would add them); []
    outside a git work tree or without git."""
    try:
        p = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "-z", "--",
                            str(path)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return [f for f in p.stdout.split("\0") if f] if p.returncode == 0 else []


def left_to_git(cfg: Config) -> list[str]:
    """One problem per local input that `dvc exp run` would commit to git, with the fix."""
    problems = []
    for _, param, path in local_inputs(cfg):
        files = git_would_add(path)
        if files:
            problems.append(
                f"{param}: {str(path)!r} has {len(files)} file(s) that git neither ignores nor has "
                f"(e.g. {files[0]}), so `dvc exp run` would commit them to git; track it with DVC: "
                f"`dvc add {path}` (then `git add {path}.dvc` and the .gitignore it writes)")
    return problems


def check_tracked(cfg: Config, env=os.environ) -> list[str]:
    """Inside a DVC stage (DVC_ROOT set): raise a ConfigError listing every local input that is
    not a DVC dependency or would be committed to git. Outside DVC: return those problems as
    notes to print."""
    problems = untracked(cfg) + left_to_git(cfg)
    if problems and env.get("DVC_ROOT"):
        raise ConfigError(problems)
    return problems
