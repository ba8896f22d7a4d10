"""Commands as a user's shell runs them, with this test venv's `python` and `dvc` first on PATH
(the real-DVC tests run `dvc repro` in a copy of the repository)."""

import os
import subprocess
import sys
from pathlib import Path


def run(*cmd, cwd, check=True, timeout=900) -> subprocess.CompletedProcess:
    """Run cmd in cwd; with check, a non-zero exit fails the test with the output's tail."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python` = this venv
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p
