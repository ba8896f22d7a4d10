"""Nothing lost: kill -9 during training, run the stage again, and the loss curve equals the
uninterrupted run's (model, optimizer, LR schedule, RNG and data position all restored)."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import yaml

from interrupted_run import as_killed_after_last_checkpoint
from longft.config.params import Config, merge, to_dict
from longft.run.pipeline import StageFailed, run_all, run_stage, stage_commands

pytestmark = pytest.mark.slow

OVERLAY = {"data": {"num_samples": 8},
           "train": {"iterations": 6, "warmup_iterations": 1},
           "output": {"save_checkpoint": False, "export": False, "checkpoint_every": 2,
                      "keep_last": 2}}


def losses(work):
    lines = (work / "run" / "rank0.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["type"] == "iter"}


def setup(work, overlay=None):
    work.mkdir(parents=True, exist_ok=True)
    params = merge(merge(to_dict(Config()), OVERLAY), overlay or {})
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(work / "params.yaml", work, ("prepare", "patch"))
    return stage_commands(work / "params.yaml", work)["train"]


def test_kill_and_resume_gives_the_uninterrupted_loss_curve(tmp_path):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    run_stage("train", setup(ref))
    expected = losses(ref)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    cmd = setup(cut)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        f = cut / "run" / "rank0.jsonl"
        if f.is_file() and 3 in losses(cut):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "training ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank, mid-iteration 4
    proc.wait()
    assert (cut / "checkpoints" / "step-2" / "COMPLETE").is_file()
    assert not (cut / "checkpoints" / "step-4").exists()

    out = run_stage("train", cmd)
    assert "resumed from" in out and "step-2" in out
    got = losses(cut)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for s in range(1, 7):
        assert got[s] == pytest.approx(expected[s], rel=1e-6, abs=1e-6), (s, got, expected)
    ends = [json.loads(x) for x in (cut / "run/rank0.jsonl").read_text().splitlines()]
    assert ends[-1]["type"] == "end" and ends[-1]["status"] == "complete"
    # keep_last 2: step-2 and step-4 remain (step 6 is the last step: no periodic checkpoint)
    kept = sorted(p.name for p in (cut / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step-2", "step-4"]


def test_corrupted_checkpoint_is_refused_and_the_previous_one_resumes_once_it_is_deleted(tmp_path):
    work = tmp_path / "w"
    cmd = setup(work)
    run_stage("train", cmd)
    as_killed_after_last_checkpoint(work / "checkpoints")
    newest = work / "checkpoints" / "step-4"
    for f in newest.rglob("*.pt"):
        f.write_bytes(b"not a checkpoint")
    # the files no longer have the digests COMPLETE recorded: refused, never unpickled
    with pytest.raises(StageFailed) as e:
        run_stage("train", cmd)
    assert e.value.code == 2 and "does not have the sha256 longft recorded" in e.value.output
    assert f"delete {newest}" in e.value.output
    shutil.rmtree(newest)  # what the message says
    out = run_stage("train", cmd)
    assert "resumed from" in out and "step-2" in out
