"""Nothing lost, with real runs of the train stage (issue 35.1, 35.2):
- a changed configuration keeps the earlier run's checkpoints and measurements (moved to
  checkpoints/other/<fingerprint>/), says so in one line naming the params that differ, and
  setting them back resumes the earlier run on its own loss curve;
- a run the worker refuses before its first step leaves runs/train and checkpoints/ as they were.
"""

import hashlib
import json
import shutil

import pytest
import yaml

from longft.config.params import load
from longft.engine.trajectory import fingerprint
from longft.run.pipeline import StageFailed, run_all, run_stage, stage_commands
from test_resume import losses
from test_resume import setup as make_run  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.slow


def digests(root):
    """sha256 of every file under root (DeepSpeed's zero_to_*.py scripts, the same for every
    checkpoint, stay at the top of checkpoints/)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith("zero_to_")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run: 6 steps, checkpoints step-2 and step-4 (keep_last 2)."""
    work = tmp_path_factory.mktemp("first") / "w"
    run_stage("train", make_run(work))
    return work


def copy_of(finished, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(finished, work)
    return work


def change(work, **sections):
    """params.yaml with the sections' keys changed, and the patch stage run for them."""
    params = yaml.safe_load((work / "params.yaml").read_text())
    for sec, keys in sections.items():
        params[sec].update(keys)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(work / "params.yaml", work, ("patch",))
    return stage_commands(work / "params.yaml", work)["train"]


def test_a_changed_lr_keeps_the_earlier_checkpoints_and_setting_it_back_resumes_them(finished,
                                                                                       tmp_path):
    work = copy_of(finished, tmp_path)
    first_losses = losses(work)
    first_ckpt = digests(work / "checkpoints")
    fp_first = fingerprint(load(work / "params.yaml"), work / "data")

    out = run_stage("train", change(work, optim={"lr": 2e-3}))
    kept = work / "checkpoints" / "other" / fp_first
    line = next(x for x in out.splitlines() if "checkpoints of another configuration" in x)
    assert "(step-4, step-2;" in line and f"kept in {kept}/" in line
    assert "params that differ from this run's: optim.lr 0.001 -> 0.002" in line
    # the first run completed: set back, it resumes its newest periodic checkpoint, not final/
    assert "Its run completed: set back, a run resumes its step-4 and trains the steps after it " \
        "again" in line and f"rm -r {kept}" in line
    assert "starting at step 0: no checkpoint of this configuration" in out
    assert "resumed from" not in out
    # the first run's checkpoints, every file unchanged, and its measurements, beside the new run's
    assert {k: v for k, v in digests(kept).items() if not k.startswith("run/")} == first_ckpt
    assert losses(kept) == first_losses  # kept/run/rank0.jsonl
    assert sorted(losses(work)) == [1, 2, 3, 4, 5, 6] and losses(work) != first_losses
    fp_second = fingerprint(load(work / "params.yaml"), work / "data")
    for s in (2, 4):
        marker = json.loads((work / "checkpoints" / f"step-{s}" / "COMPLETE").read_text())
        assert marker["fingerprint"] == fp_second

    # lr set back: the first run's checkpoints come back and resume at step 4, on its own curve
    shutil.rmtree(work / "checkpoints" / "other" / fp_first / "step-2")  # a user freeing space
    out = run_stage("train", change(work, optim={"lr": 1e-3}))
    assert "brought back from" in out and "(its params were set back; its run completed)" in out
    assert "resuming from" in out and "step-4" in out
    assert "resumed from" in out
    got = losses(work)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for s in range(1, 7):
        assert got[s] == pytest.approx(first_losses[s], rel=1e-6, abs=1e-6), (s, got)
    assert (work / "checkpoints" / "other" / fp_second / "step-4" / "COMPLETE").is_file()


def test_a_run_refused_by_the_ranks_leaves_the_earlier_results_as_they_were(finished, tmp_path):
    """train.epochs 0.1 is one step, not more than warmup_iterations 1: the ranks refuse it
    (trainer.with_steps) after the stage started them."""
    work = copy_of(finished, tmp_path)
    cmd = change(work, train={"iterations": None, "epochs": 0.1})
    before = {d: digests(work / d) for d in ("run", "checkpoints")}
    with pytest.raises(StageFailed) as e:
        run_stage("train", cmd)
    assert e.value.code == 2 and "no step would be timed" in e.value.output
    assert "the run ended before its first step: runs/train and checkpoints/ are as they were" \
        in e.value.output
    assert {d: digests(work / d) for d in ("run", "checkpoints")} == before
