"""With real `dvc exp run` (issue 36.1): an experiment never resumes a checkpoint made under other
training params, the step count included (the cosine schedule spans the total steps); one line
says which checkpoint was used and why, or why none; setting the params back resumes the kept one.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from checkout_copy import copy_checkout
from longft.config.params import Config, merge, to_dict
from venv_shell import run

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# 4 samples of up to 1024 tokens: a few rows; a global batch of 2 -> about 2 steps an epoch
PARAMS = {"data": {"num_samples": 4, "max_seq_length": 1024, "eval_samples": 2},
          "train": {"iterations": None, "epochs": 3, "warmup_iterations": 1},
          "output": {"save_checkpoint": False, "export": False, "checkpoint_every": 1,
                     "keep_last": 2}}


def records(root, kind="iter"):
    f = root / "runs" / "train" / "rank0.jsonl"
    if not f.is_file():
        return []
    return [r for r in map(json.loads, f.read_text().splitlines()) if r["type"] == kind]


def repo(tmp_path):
    root = tmp_path / "repo"
    copy_checkout(root)
    params = merge(to_dict(Config()), PARAMS)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git = ("git", "-c", "user.email=t@t", "-c", "user.name=t")
    run("git", "init", "-q", cwd=root)
    run("git", "add", "-A", cwd=root)
    run(*git, "commit", "-qm", "pipeline", cwd=root)
    return root


def test_an_experiment_with_another_step_count_does_not_resume_and_setting_it_back_does(tmp_path):
    root = repo(tmp_path)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    # 1. train.epochs 3, interrupted (Ctrl-C) after a few steps
    proc = subprocess.Popen(["dvc", "exp", "run"], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None and len(records(root)) < 2:
        time.sleep(0.2)
    assert proc.poll() is None, "the first experiment ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=600)
    while time.time() < deadline and not records(root, "end"):  # the stage may outlive dvc
        time.sleep(0.2)
    end = records(root, "end")[-1]
    assert end["status"] == "interrupted", out
    k = end["steps"]
    assert (root / "checkpoints" / f"step-{k}" / "COMPLETE").is_file()
    first = {r["step"]: r["lr"] for r in records(root)}

    # 2. train.epochs 1 (and TensorBoard, which changes no step): a fresh run on its own schedule
    p = run("dvc", "exp", "run", "-S", "train.epochs=1", "-S", "output.tensorboard=true",
            cwd=root)
    out = p.stdout + p.stderr
    assert "resuming from" not in out and "resumed from" not in out
    line = next(x for x in out.splitlines() if "checkpoints of another configuration" in x)
    assert f"step-{k}" in line and "train.total_steps" in line and "kept in" in line
    assert "starting at step 0: no checkpoint of this configuration" in out
    lrs = [r["lr"] for r in records(root)]
    steps = [r["step"] for r in records(root)]
    assert steps == list(range(1, len(steps) + 1))
    total = 3 * len(steps)  # the steps of 3 epochs
    assert k < total
    assert lrs[-1] == pytest.approx(1e-3 * 0.1)  # its cosine reached min_lr_ratio at its last step

    # 3. train.epochs 3 again: the interrupted run's checkpoints come back and resume
    p = run("dvc", "exp", "run", "-S", "train.epochs=3", cwd=root)
    out = p.stdout + p.stderr
    assert "brought back from" in out and f"resuming from checkpoints/step-{k}" in out
    got = {r["step"]: r["lr"] for r in records(root)}
    assert sorted(got) == list(range(1, total + 1))
    for s in range(1, k + 1):
        assert got[s] == pytest.approx(first[s])
    assert got[total] == pytest.approx(1e-3 * 0.1)
    assert records(root, "end")[-1]["status"] == "complete"
