"""The master port taken between the train stage's check and the ranks' bind (a second run on the
machine): with hardware.master_port auto the launch is retried on a fresh port, a pinned port
gets a message (issue 20). A stand-in launcher binds torch's real TCPStore on --master_port."""

import socket
import sys

import pytest

from longft.run.launch import free_port, launch_ranks

LAUNCHER = """
import sys
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
port = int(sys.argv[sys.argv.index("--master_port") + 1])
with open(Path(sys.argv[1]) / "attempts", "a") as f:
    f.write(f"{port}\\n")
# what rank 0 does first: listen on MASTER_PORT (raises EADDRINUSE when another process holds it)
store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=5))
print("rank 0 trained", file=sys.stderr)
"""


@pytest.fixture
def taken():
    """A port some other process (here: this test) listens on."""
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def launch(tmp_path, port, auto_port):
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "run").mkdir(exist_ok=True)
    cmd = [sys.executable, str(tmp_path / "launcher.py"), str(tmp_path), "--master_port", str(port)]
    return launch_ranks(cmd, {**__import__("os").environ}, tmp_path / "run", auto_port=auto_port)


def test_auto_port_taken_meanwhile_is_retried_on_a_fresh_one(tmp_path, taken, capfd):
    assert launch(tmp_path, taken, auto_port=True) == 0
    attempts = [int(x) for x in (tmp_path / "attempts").read_text().split()]
    assert attempts[0] == taken and len(attempts) == 2 and attempts[1] != taken
    out, err = capfd.readouterr()
    assert f"master port {taken} was taken before the ranks bound it" in out
    assert f"launching again on port {attempts[1]}" in out
    assert "EADDRINUSE" in err or "address already in use" in err.lower()  # passed through
    assert "rank 0 trained" in err
    assert (tmp_path / "run" / "monitor.json").is_file()


def test_a_pinned_port_taken_meanwhile_says_what_to_do(tmp_path, taken, capfd):
    assert launch(tmp_path, taken, auto_port=False) == 2
    assert (tmp_path / "attempts").read_text().split() == [str(taken)]
    err = capfd.readouterr().err
    assert f"longft train: the ranks could not bind master port {taken}: another process took it" in err
    assert "hardware.master_port: auto" in err


def test_a_free_port_runs_once(tmp_path, capfd):
    port = free_port(0)
    assert launch(tmp_path, port, auto_port=True) == 0
    assert (tmp_path / "attempts").read_text().split() == [str(port)]
    assert "rank 0 trained" in capfd.readouterr().err


@pytest.mark.slow
def test_a_pinned_port_taken_before_the_ranks_bind_shows_only_longfts_message(tmp_path, taken):
    """Issue 35.6: the real train stage and deepspeed launcher; the port is free at the stage's
    check (patched here) and taken when rank 0 binds it: exit 2, longft's message, no traceback."""
    import subprocess

    import yaml

    from test_resume import setup as make_run  # tests/ is on sys.path under pytest

    work = tmp_path / "w"
    cmd = make_run(work)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["hardware"]["master_port"] = taken
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    race = ("import runpy, sys; import longft.run.launch as launch; "
            "launch.port_free = lambda port: True; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", race, *cmd[1:]], capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"the ranks could not bind master port {taken}: another process took it" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert "DistNetworkError" not in p.stderr + p.stdout
