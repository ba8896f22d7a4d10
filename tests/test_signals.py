"""Ctrl-C / SIGTERM: the ranks finish the step, write a checkpoint and the end record, exit 130/143;
the run resumes from that checkpoint with the uninterrupted run's loss curve (stop.py)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from longft.engine.stop import Stopped, StopRequest, exit_code, python_module
from longft.run.pipeline import run_stage, stage_commands
from test_resume import losses
from test_resume import setup as make_run  # tests/ is on sys.path under pytest


def _wait_for(cond, timeout=30.0, proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        if proc is not None and proc.poll() is not None:
            return cond()
        time.sleep(0.05)
    return False


# -- on a rank ---------------------------------------------------------------------------------

def test_first_signal_sets_the_flag_and_a_second_one_force_quits():
    old_int, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopRequest(repeat_s=0) as stop:
        assert stop.signum == 0 and stop.agreed("cpu") == 0
        os.kill(os.getpid(), signal.SIGTERM)  # no exception: only the flag
        assert stop.signum == signal.SIGTERM
        assert stop.agreed("cpu") == signal.SIGTERM  # no process group: this rank's flag
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode; never gets here
        # default behaviour is back: a third signal would kill
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is old_int
    assert signal.getsignal(signal.SIGTERM) is old_term


def test_the_same_signal_passed_on_within_the_window_counts_once():
    t = [0.0]
    with StopRequest(repeat_s=1.0, clock=lambda: t[0]) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        t[0] = 0.5
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. DeepSpeed's launch.py passing one on
        assert stop.signum == signal.SIGINT
        t[0] = 2.0
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)


def _agree(rank, port, q):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    with StopRequest() as stop:
        before = stop.agreed("cpu")
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        q.put((rank, before, stop.agreed("cpu")))
    dist.destroy_process_group()


@pytest.mark.slow  # two rank processes (spawned, each imports torch and joins a process group)
def test_all_ranks_agree_when_only_one_was_signalled():
    import multiprocessing

    from longft.run.launch import free_port

    ctx = multiprocessing.get_context("spawn")
    q, port = ctx.Queue(), free_port(29533)
    procs = [ctx.Process(target=_agree, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [(0, 0, signal.SIGTERM), (1, 0, signal.SIGTERM)]


def test_a_rank_is_told_from_the_launchers_by_the_module_python_runs():
    py = sys.executable
    assert python_module([py, "-u", "-m", "longft.engine.worker", "--params", "p.yaml"]) == "longft.engine.worker"
    assert python_module([py, "-m", "deepspeed.launcher.runner", "--module", "longft.engine.worker"]) \
        == "deepspeed.launcher.runner"
    assert python_module([py, "-u", "-m", "deepspeed.launcher.launch", "--module",
                          "longft.engine.worker"]) == "deepspeed.launcher.launch"
    assert python_module([py, "-m", "torch.distributed.run", "-m", "longft.engine.worker"]) \
        == "torch.distributed.run"
    assert python_module([py, "-X", "faulthandler", "-m", "longft.engine.worker"]) == "longft.engine.worker"
    assert python_module([py, "stages/train.py", "-m", "longft.engine.worker"]) is None
    assert python_module([py, "-c", "pass", "-m", "longft.engine.worker"]) is None


def test_exit_codes():
    assert exit_code(signal.SIGINT) == 130 and exit_code(signal.SIGTERM) == 143
    e = Stopped(signal.SIGTERM, 7)
    assert e.exit_code == 143 and "SIGTERM after step 7" in str(e)


# -- in the train stage: launch.launch_ranks with a stand-in launcher ---------------------------

LAUNCHER = """
import signal, subprocess, sys
from pathlib import Path
d = Path(sys.argv[1])
def die(signum, frame):  # like DeepSpeed's launch.py: kill the ranks at once
    (d / "launcher_signalled").write_text(str(signum))
    child.kill()
    sys.exit(1)
signal.signal(signal.SIGINT, die)
signal.signal(signal.SIGTERM, die)
if "--inner" in sys.argv:  # like deepspeed.launcher.launch, started by the runner
    child = subprocess.Popen([sys.executable, "-u", "-m", "longft.engine.worker", str(d)], cwd=d)
else:  # like deepspeed.launcher.runner
    child = subprocess.Popen([sys.executable, *sys.argv, "--inner"])
sys.exit(child.wait())
"""

RANK = """
import os, signal, sys, time
from pathlib import Path
d = Path(sys.argv[1])
got = []
signal.signal(signal.SIGINT, lambda s, f: got.append(s))
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
(d / "rank_pid").write_text(str(os.getpid()))
while not got:
    time.sleep(0.02)
time.sleep(1.5)  # finish the step, write the checkpoint
(d / "rank_signalled").write_text(" ".join(map(str, got)))
sys.exit(128 + got[0])
"""


def _stage(tmp_path, parent=False):
    """A stand-in train stage (launch.launch_ranks of LAUNCHER) in a new session; with `parent`, started
    through a parent process that only waits for it (like dvc)."""
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    # a stand-in rank: `python -u -m longft.engine.worker` in tmp_path
    (tmp_path / "longft" / "engine").mkdir(parents=True)
    (tmp_path / "longft" / "__init__.py").write_text("")
    (tmp_path / "longft" / "engine" / "__init__.py").write_text("")
    (tmp_path / "longft" / "engine" / "worker.py").write_text(RANK)
    (tmp_path / "run").mkdir()
    stage = (f"import os, sys\nfrom pathlib import Path\nfrom longft.run.launch import launch_ranks\n"
             f"sys.exit(launch_ranks([sys.executable, {str(tmp_path / 'launcher.py')!r}, "
             f"{str(tmp_path)!r}, '--module', 'longft.engine.worker'], dict(os.environ), "
             f"Path({str(tmp_path / 'run')!r})))")
    cmd = [sys.executable, "-c", stage]
    if parent:
        cmd = [sys.executable, "-c", "import subprocess, sys, time\n"
               f"subprocess.Popen({cmd!r})\ntime.sleep(600)"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    pid_file = tmp_path / "rank_pid"  # created, then written: wait for its digits, not for it
    assert _wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip(), proc=proc), \
        "rank did not start"
    return proc, int(pid_file.read_text())


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_ctrl_c_reaches_the_ranks_once_and_not_the_launcher(tmp_path):
    proc, _ = _stage(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
    assert proc.wait(timeout=30) == 130
    assert (tmp_path / "rank_signalled").read_text() == str(int(signal.SIGINT))
    assert not (tmp_path / "launcher_signalled").exists()
    assert (tmp_path / "run" / "monitor.json").is_file()


def test_kill_of_the_stage_alone_is_passed_on_as_sigterm(tmp_path):
    proc, _ = _stage(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert (tmp_path / "rank_signalled").read_text() == str(int(signal.SIGTERM))


def test_parent_killed_the_stage_stops_the_ranks_gracefully(tmp_path):
    """`kill` of `dvc repro` (which does not pass SIGTERM on): the stage gets SIGTERM itself."""
    proc, rank = _stage(tmp_path, parent=True)
    proc.kill()
    proc.wait()
    assert _wait_for(lambda: (tmp_path / "rank_signalled").is_file(), timeout=30)
    assert (tmp_path / "rank_signalled").read_text() == str(int(signal.SIGTERM))
    assert _wait_for(lambda: _gone(rank), timeout=30)


def test_sigkill_of_the_stage_group_still_takes_every_rank(tmp_path):
    proc, rank = _stage(tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _wait_for(lambda: _gone(rank), timeout=10), "rank survived its stage"
    assert not (tmp_path / "rank_signalled").exists()


def test_the_pipeline_passes_sigterm_on_to_the_stage_and_fails_with_its_code(tmp_path):
    up = tmp_path / "up"
    stage = ("import pathlib, signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))\n"
             f"pathlib.Path({str(up)!r}).write_text('up')\ntime.sleep(60)")
    pipeline = ("import sys\nfrom longft.run.pipeline import StageFailed, run_stage\n"
                f"try:\n    run_stage('train', [sys.executable, '-c', {stage!r}])\n"
                "except StageFailed as e:\n    sys.exit(e.code)")
    proc = subprocess.Popen([sys.executable, "-c", pipeline], start_new_session=True)
    assert _wait_for(up.is_file, proc=proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143


# -- the real pipeline on CPU ------------------------------------------------------------------

def _records(work):
    return [json.loads(x) for x in (work / "run" / "rank0.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_checkpoints_and_resumes_on_the_same_curve(tmp_path):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    run_stage("train", make_run(ref))
    expected = losses(ref)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    cmd = make_run(cut) + ["--metrics", str(cut / "metrics")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert _wait_for(lambda: (cut / "run" / "rank0.jsonl").is_file() and 2 in losses(cut),
                     timeout=600, proc=proc)
    assert proc.poll() is None, "training ended before it could be stopped"
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, out
    assert "Main process received" not in out  # DeepSpeed's launch.py never saw the signal

    end = _records(cut)[-1]
    assert end["type"] == "end" and end["status"] == "interrupted" and end["signal"] == "SIGINT"
    k = end["steps"]
    assert 2 <= k <= 6 and sorted(losses(cut)) == list(range(1, k + 1))
    assert (cut / "checkpoints" / f"step-{k}" / "COMPLETE").is_file()
    assert f"stopped by SIGINT after step {k}" in out and "again to resume" in out
    train = json.loads((cut / "metrics" / "train.json").read_text())
    assert train["status"] == "incomplete" and train["end_status"] == "interrupted"
    assert train["stop_signal"] == "SIGINT" and train["steps"] == k
    assert train["loss"]["last"] == pytest.approx(expected[k], rel=1e-4)

    out = run_stage("train", cmd)
    assert "resumed from" in out and f"step-{k}" in out
    got = losses(cut)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for s in range(1, 7):
        assert got[s] == pytest.approx(expected[s], rel=1e-6, abs=1e-6), (s, got, expected)
    assert _records(cut)[-1]["status"] == "complete"
    metrics = stage_commands(cut / "params.yaml", cut)["metrics"]
    run_stage("metrics", metrics)
    train = json.loads((cut / "metrics" / "train.json").read_text())
    assert train["status"] == "complete" and train["end_status"] == "complete"
    assert train["steps"] == 6


@pytest.mark.slow
def test_ctrl_c_during_the_final_evaluation_ends_it_skips_the_export_and_exits_130(tmp_path):
    """Issue 35.3: the eval, the final checkpoint and the export used to run on, exit 0."""
    import yaml

    work = tmp_path / "w"
    # 256 held-out samples: an evaluation of seconds, not a fraction of one, so that the Ctrl-C
    # below lands inside it on a loaded machine too
    cmd = make_run(work, {"data": {"eval_samples": 256}})
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["output"].update(save_checkpoint=True, export=True)  # output.*: no patch needed
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # the final evaluation has started (its notice): a Ctrl-C before it, right after step 6, would
    # stop the run before the evaluation, which is another test's case
    assert _wait_for(lambda: any("longft: evaluating" in x and "after step 6" in x for x in lines),
                     timeout=600, proc=proc)
    assert proc.poll() is None, "the run ended before it could be stopped"
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
    proc.wait(timeout=600)
    reader.join(timeout=60)
    out = "".join(lines)
    assert proc.returncode == 130, out
    assert "longft: evaluation after step 6 stopped" in out and "eval step 6" not in out
    assert ("stopped by SIGINT after step 6; the final evaluation, the final checkpoint and the "
            "export were skipped") in out
    assert (work / "checkpoints" / "step-6" / "COMPLETE").is_file()
    assert not (work / "checkpoints" / "final").exists()
    assert not any((work / "export").iterdir())
    end = _records(work)[-1]
    assert end["type"] == "end" and end["status"] == "interrupted" and end["steps"] == 6

    out = run_stage("train", cmd)  # resumes after step 6: the evaluation and the export
    assert "resumed from" in out and "step-6" in out and "eval step 6" in out
    assert (work / "export" / "config.json").is_file() and (work / "checkpoints" / "final").is_dir()
    assert _records(work)[-1]["status"] == "complete"
