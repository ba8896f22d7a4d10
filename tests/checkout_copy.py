"""A copy of this checkout's tracked files, for the tests that run real DVC in a repository of their
own: what a user's clone holds, less the results DVC would make again (dvc.lock, metrics/, bench/)."""

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def copy_checkout(root: Path, with_tests: bool = True) -> Path:
    """Copy every file git tracks here into root (tests/ too, unless with_tests is false); root."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    skip = ("metrics/", "bench/") + (() if with_tests else ("tests/",))
    for f in files:
        if f == "dvc.lock" or f.startswith(skip) or not (REPO / f).is_file():
            continue
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, root / f)
    return root
