"""requirements/lock-cpu.txt, the lock of the CPU/dev environment: its pins, its hash, and how the
installed packages differ from it.

`scripts/lock.sh` writes the lock from pyproject.toml's ranges; `scripts/setup.sh` installs exactly
it. The run's environment record (engine/environment.py, metrics/env.json) carries `env_lock` (the
lock's sha256) and `env_lock_differs` (installed packages whose version is not the locked one), so
that `dvc metrics diff` shows an environment change.

The lock checks itself first: scripts/lock.sh seals it with a last line
`# longft-lock-sha256: <sha256 of every line above> pins=<n>` (`seal`), and `problems` refuses a
lock whose lines are not the sealed ones (cut short, edited by hand) or that has a pin without a
hash, so that a truncated lock is never taken for a whole one; then every locked package's
installed version is compared with it.

    python -m longft.engine.lockfile                # exit 1, listing them, where this venv differs
    python -m longft.engine.lockfile --check PATH   # the lock's own check only (set-up, before installing)
    python -m longft.engine.lockfile --seal PATH    # scripts/lock.sh, after writing the lock
"""

from __future__ import annotations

import hashlib
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from longft.atomic import write_text

LOCK = Path(__file__).resolve().parents[3] / "requirements" / "lock-cpu.txt"
"""The lock in this checkout (src/longft/engine/ -> the repository root)."""

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
SEAL = "# longft-lock-sha256:"
_SEAL = re.compile(r"^# longft-lock-sha256: ([0-9a-f]{64}) pins=(\d+)$")


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


def _body(text: str) -> tuple[str, str | None]:
    """(the lock's lines above its seal, the seal line or None)."""
    lines = text.splitlines(keepends=True)
    last = lines[-1].strip() if lines else ""
    if last.startswith(SEAL):
        return "".join(lines[:-1]), last
    return text, None


def seal(path: Path) -> str:
    """Append (or renew) the seal: the sha256 of the lock's lines and how many pins they hold."""
    body, _ = _body(path.read_text())
    if body and not body.endswith("\n"):
        body += "\n"
    line = f"{SEAL} {hashlib.sha256(body.encode()).hexdigest()} pins={len(pins(body))}"
    write_text(path, body + line + "\n")  # whole or not at all (atomic)
    return line


def _unhashed(text: str) -> list[str]:
    """Pins without a --hash on their continuation lines (pip --require-hashes refuses them)."""
    lines = text.splitlines()
    out = []
    for i, ln in enumerate(lines):
        m = _PIN.match(ln.strip())
        if not m or ln.startswith((" ", "#")):
            continue
        block = [ln]
        for nxt in lines[i + 1:]:
            if not nxt.startswith(" "):
                break
            block.append(nxt)
        if not any("--hash=sha256:" in b for b in block):
            out.append(m.group(1))
    return out


def problems(path: Path = LOCK) -> list[str]:
    """What is wrong with the lock file itself: missing, no seal, lines that are not the sealed
    ones (a lock cut short or edited), a pin count that differs, a pin without a hash."""
    try:
        text = path.read_text()
    except OSError as e:
        return [f"{path}: cannot be read ({e.strerror or e})"]
    fix = "write it again with `bash scripts/lock.sh` (or restore it from git)"
    body, line = _body(text)
    m = _SEAL.match(line or "")
    if m is None:
        return [f"{path} has no seal line ({SEAL} ...) at its end: it was cut short, or not "
                f"written by scripts/lock.sh; {fix}"]
    out = []
    n = len(pins(body))
    if hashlib.sha256(body.encode()).hexdigest() != m.group(1):
        out.append(f"{path} is not the lock that was sealed: its lines differ from those "
                   f"hashed at lock time ({n} pins now, {m.group(2)} sealed); {fix}")
    elif n != int(m.group(2)):
        out.append(f"{path}: {n} pins, the seal says {m.group(2)}; {fix}")
    bare = _unhashed(body)
    if bare:
        out.append(f"{path}: {len(bare)} pin(s) without a hash ({', '.join(bare[:3])}); {fix}")
    return out


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--seal":
        print(f"sealed {argv[1]}: {seal(Path(argv[1]))}")
        return 0
    if argv and not (len(argv) == 2 and argv[0] == "--check"):
        print(__doc__.split("\n\n")[-1], file=sys.stderr)
        return 2
    lock = Path(argv[1]) if argv else LOCK
    bad = problems(lock)
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 1
    if argv:
        print(f"{lock}: sealed, {len(pins(lock.read_text()))} pins, each with hashes")
        return 0
    diff = differs(lock)
    if diff:
        print(f"this environment ({sys.prefix}) differs from {lock.name} ({digest(lock)}):\n  "
              + "\n  ".join(diff) + "\nRun `bash scripts/setup.sh` to install the lock.",
              file=sys.stderr)
        return 1
    print(f"environment matches {lock.name} ({digest(lock)}, {len(pins(lock.read_text()))} "
          "packages, the lock sealed and whole)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
