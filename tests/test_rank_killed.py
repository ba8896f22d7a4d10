"""One rank of two SIGKILLed mid-training (CPU, hardware.num_gpus: 2): the launcher stops the other
rank and exits non-zero within seconds (no hang), the run is incomplete in the metrics, the last
complete checkpoint is intact, and running the stage again resumes from it."""

import json
import os
import signal
import socket
import subprocess
import time

import psutil
import pytest
import yaml

from longft.config.params import Config, load, merge, to_dict
from longft.engine.checkpoint import complete_steps, fingerprint
from longft.run.pipeline import run_all, run_stage, stage_commands

pytestmark = pytest.mark.slow


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logged(work, rank):
    f = work / "run" / f"rank{rank}.jsonl"
    rows = []
    for line in (f.read_text().splitlines() if f.is_file() else []):
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by the kill
    return rows


def workers(root: int, tag: str) -> list[psutil.Process]:
    """The training ranks under process `root` (their command line names this run's params)."""
    try:
        kids = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in kids:
        try:
            cmd = p.cmdline()
            module = cmd[cmd.index("-m") + 1] if "-m" in cmd else None
            if module == "longft.engine.worker" and tag in " ".join(cmd):  # not the launcher's own
                out.append(p)
        except psutil.Error:
            continue
    return out


def test_a_killed_rank_stops_the_run_promptly_and_the_rerun_resumes(tmp_path):
    params = merge(to_dict(Config()), {
        "hardware": {"num_gpus": 2, "master_port": unused_port()},
        "data": {"num_samples": 8, "max_seq_length": 1024},
        "train": {"iterations": 6, "warmup_iterations": 1, "global_batch_size": 2},
        "output": {"save_checkpoint": False, "export": False, "checkpoint_every": 2,
                   "keep_last": 2}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch"))
    cmds = stage_commands(tmp_path / "params.yaml", tmp_path)
    ckpt = tmp_path / "checkpoints"
    fp = fingerprint(load(tmp_path / "params.yaml"), tmp_path / "data")

    proc = subprocess.Popen(cmds["train"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 400
        # step 3 logged by rank 1: the step-2 checkpoint is complete, step 4 is running
        while proc.poll() is None and time.time() < deadline:
            if any(r.get("step") == 3 for r in logged(tmp_path, 1)):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "training ended before a rank could be killed"
        ranks = {p.environ().get("RANK"): p for p in workers(proc.pid, str(tmp_path))}
        assert set(ranks) == {"0", "1"}, ranks
        ranks["1"].send_signal(signal.SIGKILL)
        killed = time.time()
        out, _ = proc.communicate(timeout=120)  # DeepSpeed's launcher: SIGTERM, then SIGKILL at 30 s
        took = time.time() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    assert proc.returncode != 0, out[-3000:]
    assert took < 60, f"the stage needed {took:.0f} s to end after a rank died"
    left = [p for p in psutil.process_iter(["cmdline"])
            if str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.pid != proc.pid]
    assert not left, f"processes of the run still alive: {left}"

    # Neither rank finished; the metrics say incomplete.
    assert not any(r["type"] == "end" for r in logged(tmp_path, 1))
    assert not any(r.get("status") == "complete" for r in logged(tmp_path, 0))
    run_stage("metrics", cmds["metrics"])
    metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert metrics["status"] == "incomplete"

    # The last complete checkpoint is intact; the re-run resumes from it and finishes. (The kill
    # lands in step 4; on a loaded machine the poll can see rank 1's step 3 only after step 4's
    # checkpoint is written: then that one is the last, and nothing of step 6 is there.)
    done = complete_steps(ckpt, fp)
    assert done in ([2], [4, 2]), done
    last = done[0]
    assert not any(d.name.startswith((f"step-{last + 2}", f".tmp-step-{last + 2}"))
                   for d in ckpt.iterdir())
    again = run_stage("train", cmds["train"])
    assert f"resumed from {ckpt}/step-{last}" in again
    for rank in (0, 1):
        rows = logged(tmp_path, rank)
        assert [r["step"] for r in rows if r["type"] == "iter"] == [1, 2, 3, 4, 5, 6]
        assert rows[-1] == {**rows[-1], "type": "end", "status": "complete", "steps": 6}
    assert complete_steps(ckpt, fp) == [4, 2]
