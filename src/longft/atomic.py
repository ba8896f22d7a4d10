"""Atomic file writes: a temporary file in the same folder, fsync, then rename over the target.

Readers (and `dvc metrics diff`) see the old content or the new one, never a half-written file.
A write that fails (a full disk, a directory where the file goes, a folder that is not writable)
removes what it had written and raises WriteError, one message naming the path and the cause
(`cause`); `directory` does the same for an output folder (the export) written whole or not at all.
Temporary directories of bigger outputs carry the writer's pid in their name (`tmp_prefix`), so
the next writer removes those a killed process left behind (`remove_stale`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from longft.errors import UserError

_CAUSES = {
    errno.ENOSPC: "disk full (no space left on device)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EISDIR: "it is a directory",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.ENAMETOOLONG: "the name is too long",
}
# Writers that report a failed write in their own exception type, by its message: torch.save's zip
# writer (RuntimeError), safetensors (SafetensorError), both with the OS's words inside.
_FAILED_WRITE = re.compile(r"No space left on device|Disk quota exceeded|inline_container|"
                           r"PytorchStreamWriter|file write failed|Read-only file system|"
                           r"Permission denied", re.I)
_CAUSE_WORDS = (("no space left", errno.ENOSPC), ("quota", errno.EDQUOT),
                ("read-only", errno.EROFS), ("permission denied", errno.EACCES))


class WriteError(UserError, OSError):
    """A file or folder longft writes could not be written; the message names the path and the
    cause, and nothing half-written was left. `errno` is the OS's (ENOSPC for a full disk)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code

    def __str__(self) -> str:
        return str(self.args[0])


def write_failed(e: BaseException) -> bool:
    """Is e a failed write: an OSError, or a writer's own error with the OS's words in it."""
    return isinstance(e, OSError) or bool(_FAILED_WRITE.search(str(e)))


def error_code(e: BaseException) -> int | None:
    """The OS error number of a failed write (read from the message where the writer gave none)."""
    code = getattr(e, "errno", None)
    if isinstance(code, int):
        return code
    text = str(e).lower()
    return next((c for words, c in _CAUSE_WORDS if words in text), None)


def cause(e: BaseException) -> str:
    """What went wrong, in words: "disk full (no space left on device)", "it is a directory", ..."""
    code = error_code(e)
    if code in _CAUSES:
        return _CAUSES[code]
    return f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"


def failure(path: Path, e: BaseException) -> WriteError:
    """The WriteError for a write of `path` that failed with e."""
    fix = " (free space and run again)" if error_code(e) in (errno.ENOSPC, errno.EDQUOT) else ""
    return WriteError(f"cannot write {path}: {cause(e)}{fix}; nothing was written there",
                      error_code(e))


def _check_target(path: Path) -> None:
    """Refuse a directory where a file goes, and a file where one of its folders goes."""
    if path.is_dir():
        raise WriteError(f"cannot write {path}: it is a directory; name a file", errno.EISDIR)
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise WriteError(f"cannot write {path}: {above} is a file, not a directory",
                         errno.ENOTDIR)


def write_bytes(path: Path, data: bytes | str) -> None:
    """Write data to path whole (temporary file, fsync, rename) or not at all (WriteError)."""
    path = Path(path)
    _check_target(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        raise failure(path, e) from e
    finally:
        if tmp is not None and Path(tmp).exists():
            Path(tmp).unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text)


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


@contextmanager
def directory(out_dir: Path):
    """Within: fill the yielded temporary folder (`.<name>.tmp-<pid>-...` beside out_dir); on
    leaving, it replaces out_dir whole. A failure inside removes the temporary folder and leaves
    out_dir as it was; a failed write (`write_failed`) becomes a WriteError naming out_dir and the
    cause. What killed writers left beside out_dir is removed first (`remove_stale`)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise WriteError(f"cannot write {out_dir}: it is a file, not a directory", errno.ENOTDIR)
    _check_target(out_dir / "_")
    base = f".{out_dir.name}.tmp-"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out_dir.parent, base)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(base), dir=out_dir.parent))
        umask = os.umask(0)  # mkdtemp makes the folder private; give it the usual mode
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
    except OSError as e:
        raise failure(out_dir, e) from e
    try:
        yield tmp
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        if out_dir.exists():
            out_dir.rename(old)  # set aside, not deleted, until the new one is in place
        try:
            tmp.rename(out_dir)
        except OSError:
            if old.exists():
                old.rename(out_dir)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, UserError) and write_failed(e):
            raise failure(out_dir, e) from e
        raise


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
