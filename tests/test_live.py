"""measure/live.py: rank 0's per-step dvclive curves (and TensorBoard events), which a resumed run
cuts back to its checkpoint step before appending, so every step appears once."""

import csv
import json

import pytest

from longft.measure import live


def table(path):
    with open(path, newline="") as f:
        return [(int(r["step"]), float(r[path.stem])) for r in csv.DictReader(f, delimiter="\t")]


def run_steps(run_dir, steps, resume_step=0, tensorboard=False):
    lm = live.LiveMetrics(run_dir, resume_step, tensorboard)
    for s in steps:
        lm.log(s, {"loss": 10.0 - s, "lr": 1e-3, "grad_norm": 0.5 * s, "tokens_per_s": 100.0,
                   "epoch": s / 4, "unknown": 1.0})
    lm.close()


def test_each_curve_has_one_row_per_step_and_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    metrics = tmp_path / live.LIVE_DIR / "plots" / "metrics"
    run_steps(tmp_path, range(1, 6))  # the killed run logged steps 1..5
    assert table(metrics / "loss.tsv") == [(s, 10.0 - s) for s in range(1, 6)]
    run_steps(tmp_path, range(4, 7), resume_step=3)  # resumed from the step-3 checkpoint
    assert table(metrics / "loss.tsv") == [(s, 10.0 - s) for s in range(1, 7)]
    assert table(metrics / "grad_norm.tsv") == [(s, 0.5 * s) for s in range(1, 7)]
    assert sorted(p.stem for p in metrics.glob("*.tsv")) == sorted(live.METRICS)
    assert json.loads((tmp_path / live.LIVE_DIR / "metrics.json").read_text())["loss"] == 4.0
    assert not list(tmp_path.rglob("dvc.yaml"))  # dvcyaml=None: no pipeline file of its own
    # a fresh run (resume_step 0) starts the curves over
    run_steps(tmp_path, [1])
    assert table(metrics / "loss.tsv") == [(1, 9.0)]


def test_missing_values_are_left_out_and_other_ranks_write_nothing(tmp_path):
    lm = live.LiveMetrics(tmp_path, 0)
    lm.log(1, {"loss": 2.0, "grad_norm": None, "lr": float("nan")})
    lm.close()
    metrics = tmp_path / live.LIVE_DIR / "plots" / "metrics"
    assert [p.name for p in metrics.glob("*.tsv")] == ["loss.tsv"]
    off = live.LiveMetrics(tmp_path / "r1", 0, tensorboard=True, enabled=False)
    off.log(1, {"loss": 1.0})
    off.close()
    assert not (tmp_path / "r1").exists()


def test_tensorboard_events_and_a_clear_error_without_the_package(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_steps(tmp_path, range(1, 5), tensorboard=True)
    run_steps(tmp_path, range(3, 6), resume_step=2, tensorboard=True)
    acc = EventAccumulator(str(tmp_path / live.TENSORBOARD_DIR))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(s, 10.0 - s) for s in range(1, 6)]  # purge_step dropped the first run's steps 3, 4
    monkeypatch.setattr(live.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(live.LiveError, match="pip install tensorboard.*output.tensorboard: false"):
        live.check_available(True)
    live.check_available(False)


def test_without_dvclive_training_goes_on_and_says_so(tmp_path, monkeypatch, capsys):
    """A bare GPU image (no DVC installed: the H200 machine) trains on without the live curves."""
    import builtins

    real = builtins.__import__

    def no_dvclive(name, *a, **k):
        if name == "dvclive" or name.startswith("dvclive."):
            raise ImportError("No module named 'dvclive'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_dvclive)
    run_steps(tmp_path, range(1, 3))
    assert "dvclive is not installed" in capsys.readouterr().out
    assert not (tmp_path / live.LIVE_DIR).exists()
