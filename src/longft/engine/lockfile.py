"""requirements/lock-cpu.txt, the lock of the CPU/dev environment: its pins, its hash, and how the
installed packages differ from it.

`scripts/lock.sh` writes the lock from pyproject.toml's ranges; `scripts/setup.sh` installs exactly
it. The run's environment record (engine/environment.py, metrics/env.json) carries `env_lock` (the
lock's sha256) and `env_lock_differs` (installed packages whose version is not the locked one), so
that `dvc metrics diff` shows an environment change.

    python -m longft.engine.lockfile          # exit 1, listing them, where this venv differs
"""

from __future__ import annotations

import hashlib
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

LOCK = Path(__file__).resolve().parents[3] / "requirements" / "lock-cpu.txt"
"""The lock in this checkout (src/longft/engine/ -> the repository root)."""

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def canonical(name: str) -> str:
    """A package name as pip compares it (PEP 503): lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    """{canonical name: version} of every `name==version` line of a requirements file (hash
    continuation lines, comments and options skipped)."""
    out = {}
    for line in text.splitlines():
        m = _PIN.match(line.strip())
        if m:
            out[canonical(m.group(1))] = m.group(2)
    return out


def digest(path: Path = LOCK) -> str | None:
    """"sha256:<first 16 hex digits>" of the lock file's bytes, or None where it is missing (an
    installation without the checkout)."""
    try:
        return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def differs(path: Path = LOCK) -> list[str]:
    """Each locked package whose installed version is not the locked one: "name installed (lock
    locked)", "missing" where it is not installed. Empty when this environment is the lock's."""
    try:
        locked = pins(path.read_text())
    except OSError:
        return []
    out = []
    for name, want in sorted(locked.items()):
        have = _installed(name)
        if have != want:
            out.append(f"{name} {have or 'missing'} (lock {want})")
    return out


def record(path: Path = LOCK, limit: int = 8) -> dict:
    """The environment record's lock fields: env_lock (the lock's digest) and env_lock_differs
    (at most `limit` differences, then how many more)."""
    diff = differs(path)
    more = [f"... and {len(diff) - limit} more"] if len(diff) > limit else []
    return {"env_lock": digest(path), "env_lock_differs": diff[:limit] + more}


def main() -> int:
    diff = differs()
    if not LOCK.is_file():
        print(f"no lock at {LOCK}", file=sys.stderr)
        return 1
    if diff:
        print(f"this environment ({sys.prefix}) differs from {LOCK.name} ({digest()}):\n  "
              + "\n  ".join(diff) + "\nRun `bash scripts/setup.sh` to install the lock.", file=sys.stderr)
        return 1
    print(f"environment matches {LOCK.name} ({digest()}, {len(pins(LOCK.read_text()))} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
