"""Run the four stages (prepare -> patch -> train -> metrics) outside DVC, in one work folder.

`dvc repro` is the normal way; this is for machines without DVC (the GPU benchmark machine,
scripts/bench.py, `longft max-context --confirm`) and for tests. Each stage runs as its own
process, exactly the command dvc.yaml gives it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from longft.engine.stop import SignalHandlers

REPO = Path(__file__).resolve().parents[3]


class StageFailed(RuntimeError):
    """A stage exited non-zero. Not a UserError: the stage already printed why (a user error's
    message, or a bug's traceback), and `output` holds it; this only says which stage and its code."""

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


class _SignalsTo(SignalHandlers):
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


@dataclass
class WorkRun:
    """What run_params did in its work folder."""
    work: Path
    seconds: float
    failed: StageFailed | None = None          # the first stage that failed (the rest did not run)
    metrics_failed: StageFailed | None = None  # the metrics stage after train, if it failed

    @property
    def log(self) -> Path:
        return self.work / "log.txt"

    def read_json(self, rel: str) -> dict | None:
        """work/<rel> parsed, or None if that file was not written."""
        f = self.work / rel
        return json.loads(f.read_text()) if f.is_file() else None


def run_params(params: dict, work: Path, source: str = "params.yaml",
               stages=("prepare", "patch", "train"), echo: bool = False) -> WorkRun:
    """Run `stages` on a params mapping in its own work folder, as `dvc repro` would.

    The mapping is validated first (ConfigError, naming `source`, before any work), then written to
    work/params.yaml; every stage's output goes to work/log.txt. The first failing stage ends the
    run: its StageFailed is returned in `failed`, not raised. Once the train stage ran and made a run
    folder, the metrics stage follows (also after a failed run: metrics/train.json is then marked
    incomplete). metrics/ and run/ of an earlier run in the same folder are deleted first, so
    whatever they hold afterwards belongs to this run (these runs never resume).
    """
    import yaml

    from longft.atomic import write_text
    from longft.config.params import from_dict

    from_dict(params, source)
    work.mkdir(parents=True, exist_ok=True)
    # an earlier run's metrics/ and run/ (the train stage clears run/ only once it starts training)
    shutil.rmtree(work / "metrics", ignore_errors=True)
    shutil.rmtree(work / "run", ignore_errors=True)
    p = work / "params.yaml"
    write_text(p, yaml.safe_dump(params, sort_keys=False))
    t = time.time()
    out = WorkRun(work, 0.0)
    cmds = stage_commands(p, work)
    with open(out.log, "w") as log:
        for name in stages:
            try:
                run_stage(name, cmds[name], log=log, echo=echo)
            except StageFailed as e:
                out.failed = e
                break
        reached = out.failed is None or out.failed.name == "train"
        if "train" in stages and reached and (work / "run").is_dir():
            try:
                run_stage("metrics", cmds["metrics"], log=log, echo=echo)
            except StageFailed as e:
                out.metrics_failed = e
    out.seconds = time.time() - t
    return out
