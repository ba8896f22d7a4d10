"""Atomic file writes: a temporary file in the same folder, fsync, then rename over the target.

Readers (and `dvc metrics diff`) see the old content or the new one, never a half-written file.
Temporary directories of bigger outputs carry the writer's pid in their name (`tmp_prefix`), so
the next writer removes those a killed process left behind (`remove_stale`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path


def write_bytes(path: Path, data: bytes | str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text)


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


STALE_AGE_S = 3600.0
"""A temporary directory without a pid in its name (written before pids were) counts as stale
once it is this old."""


def tmp_prefix(base: str) -> str:
    """`base` + this process's pid + "-": the prefix of a temporary directory, whose writer
    `remove_stale` can tell alive or dead from the name alone."""
    return f"{base}{os.getpid()}-"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _size(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0


def remove_stale(parent: Path, base: str, max_age_s: float = STALE_AGE_S) -> list[str]:
    """Remove what killed writers left in `parent`: entries named `base<pid>-...` whose process no
    longer runs, and entries named `base...` without a pid older than max_age_s. Returns one line
    per removed entry (its name, why, its size) for the caller to print."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    pid_re = re.compile(re.escape(base) + r"(\d+)-")
    said = []
    for p in sorted(parent.iterdir()):
        if not p.name.startswith(base):
            continue
        m = pid_re.match(p.name)
        if m:
            pid = int(m.group(1))
            if _alive(pid):
                continue
            why = f"its writer, process {pid}, no longer runs"
        else:
            try:
                age = time.time() - p.lstat().st_mtime
            except OSError:
                continue
            if age < max_age_s:
                continue
            why = f"left {age / 3600:.1f} h ago by a writer that did not finish"
        size = _size(p)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        if not p.exists():
            said.append(f"removed {p} ({why}; {size / 2**20:,.1f} MiB)")
    return said
