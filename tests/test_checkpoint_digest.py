"""Resuming loads only what longft wrote (issue 20): COMPLETE records every checkpoint file's
sha256, a changed, added or missing file is refused with the fix, and DeepSpeed's files are
unpickled weights_only, so a forged pickle runs no code even with a COMPLETE rewritten to match."""

import json
import os
import shutil

import pytest
import torch
import yaml

from interrupted_run import as_killed_after_last_checkpoint
from longft.config.params import Config, merge, to_dict
from longft.engine.checkpoint import MARKER, CheckpointError, _sha256, verify
from longft.run.pipeline import StageFailed, run_all, run_stage, stage_commands

OVERLAY = {"data": {"num_samples": 4, "max_seq_length": 1024},
           "train": {"iterations": 3, "warmup_iterations": 1},
           "output": {"save_checkpoint": False, "export": False, "checkpoint_every": 2}}
MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


class Payload:
    """What a forged checkpoint would run when unpickled with full pickle."""

    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


# ------------------------------------------------------------------ verify() alone


def folder(tmp_path, files):
    d = tmp_path / "step-2"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    digests = {n: _sha256(d / n) for n in files}
    (d / MARKER).write_text(json.dumps({"fingerprint": "x", "step": 2, "sha256": digests}))
    return d


def test_verify_passes_what_was_completed_and_names_what_changed(tmp_path):
    d = folder(tmp_path, {"a.pt": b"A" * 100, "b.pt": b"B" * 100})
    verify(d)
    (d / "b.pt").write_bytes(b"B" * 99 + b"C")
    with pytest.raises(CheckpointError, match=rf"{d / 'b.pt'} does not have the sha256 longft "
                                              rf"recorded.*delete {d}.*output.resume: false"):
        verify(d)
    (d / "b.pt").write_bytes(b"B" * 100)
    (d / "extra.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=rf"{d / 'extra.pt'} is not one of the files longft"):
        verify(d)
    (d / "extra.pt").unlink()
    (d / "a.pt").unlink()
    with pytest.raises(CheckpointError, match=rf"{d / 'a.pt'} is missing"):
        verify(d)
    (d / MARKER).write_text(json.dumps({"fingerprint": "x", "step": 2}))  # an older longft's
    with pytest.raises(CheckpointError, match="has no file digests"):
        verify(d)


# ------------------------------------------------------------------ the train stage


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with a periodic checkpoint step-2 (3 steps, every 2)."""
    work = tmp_path_factory.mktemp("ckpt") / "w"
    work.mkdir()
    (work / "params.yaml").write_text(yaml.safe_dump(merge(to_dict(Config()), OVERLAY)))
    run_all(work / "params.yaml", work, ("prepare", "patch", "train"))
    marker = json.loads((work / "checkpoints" / "step-2" / MARKER).read_text())
    assert MODEL_STATES in marker["sha256"] and len(marker["sha256"]) >= 2
    return work


def copy(trained, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(trained, work)
    as_killed_after_last_checkpoint(work / "checkpoints")  # a completed run in place retrains
    return work, stage_commands(work / "params.yaml", work)["train"]


def forge(work, flag, rewrite_marker: bool):
    """Replace step-2's model states with a pickle that runs `touch flag` (and, with
    rewrite_marker, record the forged file's digest as a forger with write access would)."""
    ckpt = work / "checkpoints" / "step-2"
    f = ckpt / MODEL_STATES
    state = torch.load(f, weights_only=False)  # a real one, trusted here: the test wrote it
    state["forged"] = Payload(flag)
    torch.save(state, f)
    if rewrite_marker:
        marker = json.loads((ckpt / MARKER).read_text())
        marker["sha256"][MODEL_STATES] = _sha256(f)
        (ckpt / MARKER).write_text(json.dumps(marker))
    return f


def test_a_forged_checkpoint_file_is_refused_by_its_digest_and_never_unpickled(trained, tmp_path):
    work, cmd = copy(trained, tmp_path)
    flag = tmp_path / "payload_ran"
    f = forge(work, flag, rewrite_marker=False)
    with pytest.raises(StageFailed) as e:
        run_stage("train", cmd)
    assert e.value.code == 2
    out = e.value.output
    assert f"{f} does not have the sha256 longft recorded" in out
    assert "delete" in out and "output.resume: false" in out
    assert not flag.exists()
    assert "Traceback" not in out


def test_a_forged_file_with_a_matching_complete_still_runs_no_code(trained, tmp_path):
    work, cmd = copy(trained, tmp_path)
    flag = tmp_path / "payload_ran"
    f = forge(work, flag, rewrite_marker=True)
    with pytest.raises(StageFailed) as e:
        run_stage("train", cmd)
    assert e.value.code == 2
    out = e.value.output
    assert f"checkpoint file {f} holds a Python object longft does not load" in out
    assert "GLOBAL posix.system" in out and "output.resume: false" in out
    assert not flag.exists()


def test_an_untouched_checkpoint_resumes_under_weights_only_loading(trained, tmp_path):
    work, cmd = copy(trained, tmp_path)
    # the same params (another step count would be another trajectory: issue 36): step 3 again
    out = run_stage("train", cmd)
    assert "resumed from" in out and "step-2" in out
    steps = [json.loads(x) for x in (work / "run" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["type"] == "iter"] == [1, 2, 3]
    assert steps[-1]["type"] == "end" and steps[-1]["status"] == "complete"
