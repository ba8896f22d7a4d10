"""Disk full while checkpointing (simulated): the run stops with a clear error, the half-written
checkpoint is removed and never taken as complete, the previous complete checkpoint is intact and a
re-run resumes from it; nothing else is deleted. Disk full during the export (issue 49, R25): one
message, no half-written export folder, and the re-run resumes from the final checkpoint (no step
trained again)."""

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from longft.config.params import Config, load, merge, to_dict
from longft.engine.checkpoint import (
    CheckpointError,
    _failed,
    complete_steps,
    fingerprint,
    mark_finished,
    newest,
)
from longft.run.launch import environment, free_port
from longft.run.pipeline import run_all, run_stage, stage_commands

OVERLAY = {"data": {"num_samples": 6, "max_seq_length": 1024},
           "train": {"iterations": 5, "warmup_iterations": 1},
           "output": {"save_checkpoint": True, "export": True, "checkpoint_every": 2,
                      "keep_last": 2}}

# One rank started the way the launcher starts it, with torch.save failing like a full disk as soon
# as it writes into the step-4 checkpoint (after a few bytes, as a real full disk does).
DRIVER = """
import errno, os, sys, torch
real = torch.save
def save(obj, f, *a, **k):
    if ".tmp-step-4" in str(f):
        with open(f, "wb") as fh:
            fh.write(b"PK\\x03\\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    return real(obj, f, *a, **k)
torch.save = save
from longft.engine.worker import main
sys.exit(main(sys.argv[1:]))
"""
# The export's safetensors writer failing like a full disk (after a few bytes).
EXPORT_FULL = """
import sys
import transformers.modeling_utils as mu
from safetensors import SafetensorError
def save_file(tensors, filename, *a, **k):
    open(filename, "wb").write(b"half")
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')
mu.safe_save_file = save_file
from longft.engine.worker import main
sys.exit(main(sys.argv[1:]))
"""


def digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_disk_full_mid_checkpoint_keeps_the_previous_one_resumable(tmp_path):
    params = merge(to_dict(Config()), OVERLAY)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch"))
    cmd = stage_commands(tmp_path / "params.yaml", tmp_path)["train"]
    worker_args = ["--params", str(tmp_path / "params.yaml"),
                   "--plan", str(tmp_path / "artifacts/plan.json"),
                   "--ds-config", str(tmp_path / "artifacts/ds_config.json"),
                   "--data", str(tmp_path / "data"), "--run", str(tmp_path / "run"),
                   "--checkpoints", str(tmp_path / "checkpoints")]
    data = digest(tmp_path / "data")
    ckpt = tmp_path / "checkpoints"

    env = environment("cpu", dict(os.environ))
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port(29631)))
    p = subprocess.run([sys.executable, "-c", DRIVER, *worker_args], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert (f"longft train: disk full while writing checkpoint step-4 in {ckpt}: free space or "
            "lower output.keep_last (now 2;") in p.stderr
    assert "step-2, is intact and a re-run resumes from it" in p.stderr
    assert "Traceback" not in p.stderr

    # The half-written step-4 is gone and nothing takes it as complete; step-2 is complete.
    assert sorted(d.name for d in ckpt.iterdir() if d.is_dir()) == ["step-2"]
    assert complete_steps(ckpt, fingerprint(load(tmp_path / "params.yaml"), tmp_path / "data")) == [2]
    step2 = digest(ckpt / "step-2")
    rows = [json.loads(x) for x in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()]
    assert rows[-1]["type"] == "end" and rows[-1]["status"] == "failed"
    assert "disk full" in rows[-1]["error"]
    run_stage("metrics", stage_commands(tmp_path / "params.yaml", tmp_path)["metrics"])
    assert json.loads((tmp_path / "metrics" / "train.json").read_text())["status"] == "incomplete"

    # Space freed, then the disk fills up again during the export: resumed from step-2, steps 3-5
    # trained, the final checkpoint written, the export refused in one message, nothing half-written
    p = subprocess.run([sys.executable, "-c", EXPORT_FULL, *worker_args,
                        "--export", str(tmp_path / "export")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"resumed from {ckpt}/step-2" in p.stdout
    assert (f"longft train: cannot write {tmp_path / 'export'}: disk full (no space left on "
            "device)") in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "export").exists() and not list(tmp_path.glob(".export*"))
    assert newest(ckpt, fingerprint(load(tmp_path / "params.yaml"), tmp_path / "data")) == (5, "final")

    # Space freed: the same stage resumes from the final checkpoint, trains no step again, exports.
    out = run_stage("train", cmd)
    assert f"resuming from {ckpt}/final" in out and f"resumed from {ckpt}/final (step 5)" in out
    rows = [json.loads(x) for x in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["type"] == "iter"] == [1, 2, 3, 4, 5]
    assert rows[-1] == {**rows[-1], "type": "end", "status": "complete", "steps": 5}
    assert digest(ckpt / "step-2") == step2  # read, not rewritten
    assert (ckpt / "step-4" / "COMPLETE").is_file()
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert json.loads((ckpt / "final" / "COMPLETE").read_text())["finished"] is True
    assert digest(tmp_path / "data") == data


def test_an_unfinished_runs_final_checkpoint_is_resumed_first_a_finished_ones_is_not(tmp_path):
    for name, step in (("step-6", 6), ("final", 8)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "COMPLETE").write_text(json.dumps({"fingerprint": "fp", "step": step}))
    assert newest(tmp_path, "fp") == (8, "final")
    assert newest(tmp_path, "another") == (0, "")
    mark_finished(tmp_path)  # the export was written: a forced re-run retrains
    assert newest(tmp_path, "fp") == (6, "step-6")


def test_a_failed_write_without_a_full_disk_says_what_failed(tmp_path):
    ckpt = tmp_path / "checkpoints"
    tmp = ckpt / ".tmp-step-6"
    tmp.mkdir(parents=True)
    (tmp / "half.pt").write_bytes(b"x")
    err = _failed(PermissionError(errno.EACCES, "Permission denied"), ckpt, tmp, "step-6", "fp", 3)
    assert isinstance(err, CheckpointError)
    assert str(err).startswith(f"could not write checkpoint step-6 in {ckpt}: permission denied")
    assert "there is no earlier complete checkpoint" in str(err)
    assert not tmp.exists()


@pytest.mark.parametrize("free", [0, 10 * 2**30])
def test_torch_zip_writer_failure_is_disk_full_only_when_the_disk_is(tmp_path, monkeypatch, free):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100 * 2**30, 0, free))
    ckpt = tmp_path / "c"
    (ckpt / ".tmp-step-2").mkdir(parents=True)
    # what torch.save(_use_new_zipfile_serialization=True) raises when the disk fills up
    e = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 640 vs 534")
    msg = str(_failed(e, ckpt, ckpt / ".tmp-step-2", "step-2", "fp", 2))
    assert msg.startswith("disk full while writing" if free == 0 else "could not write checkpoint")


def test_a_full_disk_outside_the_periodic_save_is_named(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from longft.engine.checkpoint import disk_full_message

    enospc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "export" / "x.bin"))
    msg = disk_full_message(enospc, [None, tmp_path / "export"])
    assert msg.startswith(f"disk full while writing {tmp_path / 'export' / 'x.bin'}: free space")
    assert disk_full_message(ZeroDivisionError(), [tmp_path]) is None
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**40, 2**40, 0))
    zip_error = RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed")
    assert disk_full_message(zip_error, [tmp_path / "ckpt"]).startswith(
        f"disk full while writing {tmp_path / 'ckpt'}")
