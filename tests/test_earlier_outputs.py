"""Nothing lost (issue 35.1, 35.2), on folders alone: a run of another configuration keeps the
earlier checkpoints and measurements under checkpoints/other/<fingerprint>/ and says which params
differ; setting them back brings them back; a run that makes no step puts everything back.
(tests/test_config_change.py does the same with real runs.)"""

import json
import time

from longft.config.params import from_dict
from longft.engine.trajectory import differences, fingerprint, trajectory
from longft.run.earlier import RECORD, Earlier


def tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def fake_run(root, cfg, steps=(2, 4), when=None):
    """What a finished run of cfg leaves: its measurements and checkpoints."""
    fp = fingerprint(cfg)
    e = Earlier(root / "checkpoints", root / "runs" / "train", fp)
    e.arrange(trajectory(cfg), resume=True)
    with open(root / "runs" / "train" / "rank0.jsonl", "w") as f:
        for s in range(1, max(steps, default=2) + 1):
            f.write(json.dumps({"type": "iter", "step": s, "t": when or time.time(),
                                "lr": cfg.optim.lr}) + "\n")
    for s in steps:
        d = root / "checkpoints" / f"step-{s}"
        d.mkdir(parents=True)
        (d / "model.pt").write_text(f"{fp} {s}")
        (d / "COMPLETE").write_text(json.dumps({"fingerprint": fp, "step": s, "sha256": {}}))
    (root / "checkpoints" / "final").mkdir()
    (root / "checkpoints" / "final" / "COMPLETE").write_text(json.dumps(  # marked after the export
        {"fingerprint": fp, "step": max(steps, default=2), "sha256": {}, "finished": True}))
    (root / "checkpoints" / "latest").write_text("final")
    e.finish(0)
    return fp, e


def test_another_configuration_is_kept_and_brought_back_when_its_params_are_set_back(tmp_path):
    a = from_dict({"optim": {"lr": 1e-3}})
    b = from_dict({"optim": {"lr": 2e-3}})
    fp_a, first = fake_run(tmp_path, a)
    assert "no checkpoint of this configuration" in first.lines[-1]
    before = tree(tmp_path / "checkpoints")

    e = Earlier(tmp_path / "checkpoints", tmp_path / "runs" / "train", fingerprint(b))
    e.arrange(trajectory(b), resume=True)
    kept = tmp_path / "checkpoints" / "other" / fp_a
    assert e.lines[0].startswith(f"train: checkpoints of another configuration (step-4, step-2, "
                                 f"final; 0.00 GiB) kept in {kept}/: params that differ from this "
                                 "run's: optim.lr 0.001 -> 0.002. Its run completed: set back, a "
                                 "run resumes its step-4 and trains the steps after it again; "
                                 f"`rm -r {kept}` deletes them")
    assert "starting at step 0: no checkpoint of this configuration" in e.lines[-1]
    assert not e.resumable
    # every file of the first run is where the line says, unchanged
    assert {k.removeprefix(f"other/{fp_a}/"): v for k, v in tree(tmp_path / "checkpoints").items()
            if k.startswith("other/") and "/run/" not in k} == before
    assert (kept / "run" / "rank0.jsonl").is_file()  # its measurements went with them
    assert not (tmp_path / "runs" / "train" / "rank0.jsonl").exists()
    e.finish(0)

    # the lr set back: the first configuration's checkpoints and measurements come back
    e = Earlier(tmp_path / "checkpoints", tmp_path / "runs" / "train", fp_a)
    e.arrange(trajectory(a), resume=True)
    assert any("brought back" in line and "its run completed" in line for line in e.lines)
    assert e.resumable == 4 and e.lines[-1].startswith(
        f"train: resuming from {tmp_path / 'checkpoints'}/step-4: a checkpoint of this "
        "configuration")
    assert (tmp_path / "runs" / "train" / "rank0.jsonl").is_file()
    assert tree(tmp_path / "checkpoints")["step-4/model.pt"] == f"{fp_a} 4".encode()


def test_a_run_that_makes_no_step_puts_everything_back(tmp_path):
    a = from_dict({"optim": {"lr": 1e-3}})
    fake_run(tmp_path, a, when=time.time() - 60)
    before = tree(tmp_path)
    for cfg in (from_dict({"optim": {"lr": 2e-3}}), a):  # another configuration, and a fresh run
        e = Earlier(tmp_path / "checkpoints", tmp_path / "runs" / "train", fingerprint(cfg))
        e.arrange(trajectory(cfg), resume=cfg is not a)
        (tmp_path / "runs" / "train" / "memory.csv").write_text("t\n")  # what the sampler wrote
        assert e.finish(2).startswith("train: the run ended before its first step")
        assert tree(tmp_path) == before


def test_total_steps_and_the_prepared_data_are_in_the_fingerprint_what_is_printed_is_not(tmp_path):
    base = from_dict({})
    for change in ({"train": {"iterations": 6}}, {"train": {"iterations": None, "epochs": 1.0}},
                   {"optim": {"lr": 5e-4}}, {"lora": {"rank": 8}}, {"train": {"seed": 1}},
                   {"hardware": {"sequence_parallel": 2, "num_gpus": 2}}):
        assert fingerprint(from_dict(change)) != fingerprint(base), change
    for same in ({"output": {"tensorboard": True, "keep_last": 5}}, {"train": {"log_every": 5}},
                 {"train": {"eval_every": 3}}, {"train": {"warmup_iterations": 1}},
                 {"hardware": {"master_port": 29555}}, {"checkpointing": {"mode": "none"}}):
        assert fingerprint(from_dict(same)) == fingerprint(base), same
    # epochs count as the steps they make: 2 epochs of 6 rows at a global batch of 2 = 6 steps
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"num_rows": 6}))
    (data / "stats.json").write_text(json.dumps({"rows": 6, "tokens": 100, "trainable_tokens": 9}))
    epochs = from_dict({"train": {"iterations": None, "epochs": 2.0}})
    assert fingerprint(epochs, data) == fingerprint(from_dict({"train": {"iterations": 6}}), data)
    assert differences(trajectory(epochs, data),
                       trajectory(from_dict({"train": {"iterations": None, "epochs": 1.0}}), data)
                       ) == ["train.total_steps 6 -> 3"]
    (data / "stats.json").write_text(json.dumps({"rows": 6, "tokens": 101, "trainable_tokens": 9}))
    assert fingerprint(epochs, data) != fingerprint(from_dict({"train": {"iterations": 6}}),
                                                    tmp_path)  # another data file's tokens
    assert RECORD == "TRAJECTORY.json"


def test_a_forced_re_run_of_a_completed_run_retrains_from_step_0(tmp_path):
    """Issue 48: `dvc repro -f` after a completed run with periodic checkpoints resumed its last
    step-N and trained the last steps, its throughput mixed from two sessions. A completed run's
    checkpoints are not resumed: the re-run starts at 0 with fresh measurements; they wait aside
    until it completes, and a re-run that makes no step leaves them as they were."""
    a = from_dict({"optim": {"lr": 1e-3}})
    fp, _ = fake_run(tmp_path, a, when=time.time() - 60)
    ckpt = tmp_path / "checkpoints"
    before = tree(tmp_path)
    e = Earlier(ckpt, tmp_path / "runs" / "train", fp)
    e.arrange(trajectory(a), resume=True)
    assert e.resumable == 0 and e.lines[-1].startswith(
        f"train: starting at step 0: the run of this configuration in {ckpt} completed, step-4 "
        "its newest checkpoint; a re-run (dvc repro -f) retrains")
    assert not list(ckpt.glob("step-*")) and not (ckpt / "final").exists()
    assert not (tmp_path / "runs" / "train" / "rank0.jsonl").exists()   # its own measurements
    assert e.finish(2).startswith("train: the run ended before its first step")
    assert tree(tmp_path) == before                                     # a refusal changes nothing
    e = Earlier(ckpt, tmp_path / "runs" / "train", fp)
    e.arrange(trajectory(a), resume=True)
    assert e.resumable == 0                                             # still not resumed
    (tmp_path / "runs" / "train" / "rank0.jsonl").write_text(json.dumps(
        {"type": "iter", "step": 1, "t": time.time() + 1}) + "\n")
    (ckpt / "final").mkdir()
    assert e.finish(0) is None
    assert not (ckpt / "other").exists() and json.loads((ckpt / RECORD).read_text())["complete"]


def test_a_completed_run_with_only_final_brought_back_says_it_retrains(tmp_path):
    """Walk finding 10: lr edited, run, set back, run: "brought back ... (its params were set
    back)" then "starting at step 0: no checkpoint of this configuration". What came back was a
    completed run's final/, which is not resumed: the lines say so, and the parking line does not
    promise a resume."""
    a = from_dict({"optim": {"lr": 1e-3}})
    b = from_dict({"optim": {"lr": 2e-3}})
    fp_a, _ = fake_run(tmp_path, a, steps=())
    _, e = fake_run(tmp_path, b, steps=())   # the lr edited: a run that completes
    kept = tmp_path / "checkpoints" / "other" / fp_a
    assert e.lines[0].startswith(f"train: checkpoints of another configuration (final; 0.00 GiB) "
                                 f"kept in {kept}/: params that differ from this run's: optim.lr "
                                 "0.001 -> 0.002. Its run completed: set back, a run retrains it "
                                 "from step 0 (a completed run's final/ is not resumed); ")

    e = Earlier(tmp_path / "checkpoints", tmp_path / "runs" / "train", fp_a)
    e.arrange(trajectory(a), resume=True)
    assert e.resumable == 0
    assert e.lines == [
        f"train: checkpoints of another configuration (final; 0.00 GiB) kept in "
        f"{tmp_path / 'checkpoints' / 'other' / fingerprint(b)}/: params that differ from this run's: "
        "optim.lr 0.002 -> 0.001. Its run completed: set back, a run retrains it from step 0 (a "
        "completed run's final/ is not resumed); "
        f"`rm -r {tmp_path / 'checkpoints' / 'other' / fingerprint(b)}` deletes them",
        f"train: checkpoints of this configuration brought back from {kept}/ (its params were set "
        "back; its run completed)",
        f"train: starting at step 0: the run of this configuration brought back from {kept}/ "
        "completed (a completed run's final/ is not resumed); this run retrains and measures itself"]
