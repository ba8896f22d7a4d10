"""Run the four stages (prepare -> patch -> train -> metrics) outside DVC, in one work folder.

`dvc repro` is the normal way; this is for machines without DVC (the GPU benchmark machine) and for
tests. Each stage runs as its own process, exactly the command dvc.yaml gives it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from .stop import _Handlers

REPO = Path(__file__).resolve().parents[2]


class StageFailed(RuntimeError):
    def __init__(self, name: str, code: int, output: str):
        self.name, self.code, self.output = name, code, output
        super().__init__(f"stage {name} exited {code}:\n" + "\n".join(output.splitlines()[-15:]))


def stage_commands(params: Path, work: Path) -> dict[str, list[str]]:
    s = lambda name: [sys.executable, str(REPO / "stages" / f"{name}.py")]  # noqa: E731
    return {
        "prepare": [*s("prepare"), "--params", str(params), "--out", str(work / "data")],
        "patch": [*s("patch"), "--params", str(params), "--out", str(work / "artifacts")],
        "train": [*s("train"), "--params", str(params), "--plan", str(work / "artifacts/plan.json"),
                  "--ds-config", str(work / "artifacts/ds_config.json"), "--data", str(work / "data"),
                  "--run", str(work / "run"), "--checkpoints", str(work / "checkpoints"),
                  "--export", str(work / "export"), "--metrics", str(work / "metrics")],
        "metrics": [*s("metrics"), "--run", str(work / "run"), "--plan",
                    str(work / "artifacts/plan.json"), "--out", str(work / "metrics")],
    }


class _SignalsTo(_Handlers):
    """While a stage runs, SIGINT and SIGTERM go on to it, and the stage decides: train finishes
    the step, checkpoints and exits 130/143 (stop.py). (A terminal's Ctrl-C reaches the stage
    itself too; the train stage counts the two as one.)"""

    def __init__(self, proc: subprocess.Popen):
        super().__init__()
        self.proc = proc

    def _handle(self, signum, frame) -> None:
        self.proc.send_signal(signum)  # a no-op once it has ended


def run_stage(name: str, cmd: list[str], log: TextIO | None = None, echo: bool = False) -> str:
    t = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with _SignalsTo(p):
        out, _ = p.communicate()
    p = subprocess.CompletedProcess(cmd, p.returncode, out)
    if log is not None:
        log.write(p.stdout)
        log.flush()
    if echo:
        print("\n".join(p.stdout.strip().splitlines()[-20:]), flush=True)
        print(f"[{name}] exit {p.returncode} after {time.time() - t:.0f} s", flush=True)
    if p.returncode:
        raise StageFailed(name, p.returncode, p.stdout)
    return p.stdout


def run_all(params: Path, work: Path, stages=("prepare", "patch", "train", "metrics"),
            log: TextIO | None = None, echo: bool = False) -> dict[str, str]:
    """Run the stages in order; return each one's output; raise StageFailed on the first failure."""
    cmds = stage_commands(params, work)
    return {name: run_stage(name, cmds[name], log, echo) for name in stages}
