"""One base class for the errors a user can fix (longft.errors.UserError): every such class is one,
and keeps the builtin base it had; the rank worker prints a UserError's message and exits 2, while
any other exception raised inside training (a torch or DeepSpeed ValueError) keeps its traceback.
The worker runs in-process on a real plan, with the trainer's set-up and step replaced (no
DeepSpeed run)."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

from longft.config.grid import GridError
from longft.config.params import ConfigError
from longft.config.typed_yaml import DuplicateKeyError
from longft.data.errors import DataError
from longft.engine.checkpoint import CheckpointError
from longft.engine.export import ExportError
from longft.engine.grad_buffer import GradBufferError
from longft.engine.trainer import TrainingError
from longft.errors import UserError
from longft.hardware.policy import PlanError
from longft.metrics.grid_axes import GridReportError
from longft.model.loading import ModelError
from longft.model.patches import PatchError
from longft.run.launch import LaunchError
from longft.run.preflight import HostMemoryError
from longft.run.sweep import SweepError

SRC = Path(__file__).resolve().parents[1] / "src" / "longft"
USER_ERRORS = {ConfigError: ValueError, PlanError: ValueError, DataError: ValueError,
               ModelError: ValueError, PatchError: ValueError, ExportError: ValueError,
               SweepError: ValueError, GridError: ValueError, GridReportError: ValueError,
               TrainingError: RuntimeError, CheckpointError: RuntimeError,
               GradBufferError: RuntimeError, LaunchError: RuntimeError,
               HostMemoryError: RuntimeError, DuplicateKeyError: ValueError}
NOT_USER_ERRORS = {"UserError", "Stopped", "StageFailed"}
"""Stopped: a signal's exit status (130/143); StageFailed: a stage's exit, which printed why."""


@pytest.mark.parametrize("cls", USER_ERRORS, ids=lambda c: c.__name__)
def test_each_user_error_is_a_user_error_and_keeps_its_builtin_base(cls):
    assert issubclass(cls, UserError)
    assert issubclass(cls, USER_ERRORS[cls])  # `except ValueError` elsewhere still catches it


def _exception_classes():
    """(module, class name) of each class in src/longft with a base named *Error / *Exception."""
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(("longft", *path.relative_to(SRC).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception"))
                    for b in node.bases):
                yield module, node.name


def test_every_other_exception_class_of_longft_is_a_user_error():
    """A new exception class must decide: a UserError, or one of the few that are not."""
    found = {}
    for module, name in _exception_classes():
        found[name] = getattr(importlib.import_module(module), name)
    assert set(found) >= {c.__name__ for c in USER_ERRORS} | NOT_USER_ERRORS
    assert [f"{c.__module__}.{n}" for n, c in found.items()
            if n not in NOT_USER_ERRORS and not issubclass(c, UserError)] == []
    assert not any(issubclass(found[n], UserError) for n in NOT_USER_ERRORS - {"UserError"})


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    """params.yaml (all defaults), artifacts/plan.json and ds_config.json as the patch stage
    writes them for this machine."""
    from longft.config.params import load
    from longft.hardware import detect
    from longft.run.patch_stage import make_plan

    d = tmp_path_factory.mktemp("plan")
    (d / "params.yaml").write_text("{}\n")
    plan, ds = make_plan(load(d / "params.yaml"), detect())
    (d / "plan.json").write_text(json.dumps(plan))
    (d / "ds_config.json").write_text(json.dumps(ds))
    return d


def _run_worker(monkeypatch, plan_files: Path, run_dir: Path, error: BaseException) -> int:
    """The worker's `_main` with a set-up that builds nothing and a first step that raises."""
    import torch

    from longft.engine import train_step, trainer, worker

    session = trainer.Session(engine=object(), model=torch.nn.Linear(1, 1), keep=None,
                              offloader=None, batches=iter(()), pad_id=-1, fingerprint="fp",
                              start=0, rank=0, world=1, cuda=False)
    monkeypatch.setattr(trainer, "setup", lambda *a, **k: session)
    monkeypatch.setattr(trainer, "PreparedDataset", lambda d: [None] * 4)  # 4 rows, none read
    monkeypatch.setattr(trainer, "environment", lambda *a, **k: {})

    def step(*a, **k):
        raise error

    monkeypatch.setattr(train_step, "step", step)
    return worker._main(["--params", str(plan_files / "params.yaml"),
                         "--plan", str(plan_files / "plan.json"),
                         "--ds-config", str(plan_files / "ds_config.json"),
                         "--data", str(run_dir / "no-data"), "--run", str(run_dir)], None)


def _end(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "rank0.jsonl").read_text().splitlines()]
    return rows[-1]


def test_a_value_error_inside_training_keeps_its_traceback(monkeypatch, tmp_path, capsys,
                                                           plan_files):
    with pytest.raises(ValueError, match="boom"):
        _run_worker(monkeypatch, plan_files, tmp_path, ValueError("boom"))
    assert "longft train:" not in capsys.readouterr().err
    end = _end(tmp_path)  # the run log was closed on the way out, with its "end" record
    assert end["type"] == "end" and end["status"] == "failed" and end["error"] == "ValueError: boom"


@pytest.mark.parametrize("error", [
    TrainingError("loss is nan at step 1: lower optim.lr"),
    PatchError("checkpointing.keep_attention is 3 but the model has 2 decoder layers"),
    ModelError("model.name: cannot load a config for 'x'"),
], ids=lambda e: type(e).__name__)
def test_a_user_error_exits_2_with_its_message_only(monkeypatch, tmp_path, capsys, plan_files,
                                                    error):
    assert _run_worker(monkeypatch, plan_files, tmp_path, error) == 2
    err = capsys.readouterr().err
    assert err == f"longft train: {error}\n"
    assert _end(tmp_path)["status"] == "failed"


def test_the_run_log_closes_itself_also_after_an_exception(tmp_path):
    from longft.measure.runlog import RunLog

    with pytest.raises(ZeroDivisionError):
        with RunLog(tmp_path, 0) as log:
            log.write("iter", step=1)
            raise ZeroDivisionError
    assert log._f.closed
    log.close()  # closing again does nothing
    assert [json.loads(x)["step"] for x in (tmp_path / "rank0.jsonl").read_text().splitlines()] == [1]
