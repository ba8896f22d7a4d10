"""A DeepSpeed op build lock (torch's `<op folder>/lock`) left by a killed build no longer hangs the
next run: a lock no process holds is removed with a note; a live one is waited on with a message
and progress, and removed if its process dies meanwhile. Also set-up's op build (opbuild.build_ops)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longft.engine import opbuild

HOLD = """import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)   # what torch's FileBaton.try_acquire does
print("held", flush=True)
time.sleep(float(sys.argv[2]))
if sys.argv[3] == "release":
    os.close(fd); os.remove(sys.argv[1])
"""


def hold(lock: Path, seconds: float, release: bool = True) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(seconds),
                          "release" if release else "keep"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.fixture
def lock(tmp_path):
    (tmp_path / "cpu_adam").mkdir()
    return tmp_path / "cpu_adam" / "lock"


def test_a_lock_left_by_a_killed_build_is_removed_with_a_note(lock, capsys):
    p = hold(lock, 60, release=False)
    assert opbuild.lock_holders(lock) == [p.pid]
    p.kill()
    p.wait()
    assert lock.exists() and opbuild.lock_holders(lock) == []
    assert opbuild.clear_stale_locks(lock.parent.parent) == [lock]
    assert not lock.exists()
    err = capsys.readouterr().err
    assert f"removed a stale build lock {lock}" in err and "`cpu_adam` is built again now" in err


def test_a_live_lock_is_left_alone_and_waited_on_with_progress(lock, capsys):
    p = hold(lock, 2.5)
    assert opbuild.clear_stale_locks(lock.parent.parent) == [] and lock.exists()
    t = time.monotonic()
    opbuild.wait_for_lock(lock, every_s=1.0, poll_s=0.05)
    assert time.monotonic() - t >= 1.0 and not lock.exists()
    p.wait()
    err = capsys.readouterr().err
    assert f"waiting for process {p.pid} to finish building DeepSpeed's `cpu_adam` op" in err
    assert "still waiting for `cpu_adam`: 1 s" in err
    assert "`cpu_adam` built by the other process after" in err


def test_a_holder_that_dies_while_waited_on_leaves_no_hang(lock, capsys):
    p = hold(lock, 60, release=False)
    subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1); os.kill({p.pid}, 9)"])
    t = time.monotonic()
    opbuild.wait_for_lock(lock, every_s=10, poll_s=0.05)
    assert time.monotonic() - t < 30 and not lock.exists()
    p.wait()
    assert "removed a stale build lock" in capsys.readouterr().err


def test_only_rank_0_speaks(lock, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    lock.touch()
    opbuild.clear_stale_locks(lock.parent.parent)
    assert not lock.exists() and capsys.readouterr().err == ""


REPRO = """import os, sys, time
os.environ["DS_ACCELERATOR"] = "cpu"
from longft.engine.opbuild import watch_build_locks
if sys.argv[1] == "watched":
    watch_build_locks()
from torch.utils.file_baton import FileBaton
t = time.time()
b = FileBaton(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "cpu_adam", "lock"))
if not b.try_acquire():   # what torch's JIT load does when another build holds the lock
    b.wait()
print(f"through after {time.time() - t:.1f} s", flush=True)
"""


@pytest.mark.parametrize("watched", [False, True])
def test_the_rank_no_longer_hangs_on_a_stale_lock(tmp_path, watched):
    """The reproduction: torch's own wait on a lock a killed build left spins for ever (here: until
    the timeout); the rank's watch_build_locks (engine/worker.py) removes it first."""
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").touch()  # no process holds it: a killed build's
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    cmd = [sys.executable, "-c", REPRO, "watched" if watched else "torch"]
    if not watched:
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run(cmd, env=env, capture_output=True, timeout=8)
        return
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "through after" in p.stdout and "removed a stale build lock" in p.stderr


def test_the_worker_watches_before_it_trains():
    import inspect

    from longft.engine import worker

    src = inspect.getsource(worker._main)
    assert src.index("watch_build_locks()") < src.index("train(cfg")


def test_set_up_builds_the_ops_of_a_cpu_run_once(tmp_path):
    """build_ops on a folder where they are built (set-up ran: copied from there) says so and
    builds nothing; the ranks and the tests use that folder (extensions_dir). In a process of its
    own: DeepSpeed remembers a loaded op for the rest of the process."""
    import shutil

    from longft.run.launch import environment

    usual = Path(environment("cpu", dict(os.environ))["TORCH_EXTENSIONS_DIR"])
    ops = ("cpu_adam", "fused_adam", "deepspeed_shm_comm")
    if not all((usual / op / f"{op}.so").is_file() for op in ops):
        pytest.skip(f"set-up has not built the ops into {usual} (python -m longft.engine.opbuild)")
    for op in ops:
        shutil.copytree(usual / op, tmp_path / op)
    (tmp_path / "cpu_adam" / "lock").touch()  # and a killed build's lock: no hang
    p = subprocess.run([sys.executable, "-m", "longft.engine.opbuild", "cpu"], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert f"DeepSpeed's `cpu_adam` op already built ({tmp_path})" in p.stderr
    assert f"DeepSpeed's `deepspeed_shm_comm` op already built ({tmp_path})" in p.stderr
    assert f"DeepSpeed's `fused_adam` op already built ({tmp_path})" in p.stderr
    assert "removed a stale build lock" in p.stderr and "building" not in p.stderr


@pytest.mark.parametrize("case", ["new", "unchanged", "inputs changed"])
def test_set_up_says_whether_it_built_loaded_or_rebuilt_an_op(tmp_path, monkeypatch, capsys, case):
    """A .so already there is no proof that nothing compiles: ninja rebuilds it when its inputs
    changed (a venv made anew at the same path). build_ops tells by the .so it finds after load()."""
    import deepspeed.accelerator

    class Builder:
        NAME = "cpu_adam"

        def load(self, verbose=False):
            so = tmp_path / "cpu_adam" / "cpu_adam.so"
            if case != "unchanged":  # what ninja does: (re)write the library
                so.parent.mkdir(exist_ok=True)
                so.write_bytes(b"new")
                os.utime(so, ns=(2_000_000_000_000_000_000,) * 2)

    if case != "new":
        (tmp_path / "cpu_adam").mkdir()
        (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"old")
    monkeypatch.setitem(opbuild.SETUP_OPS, "cpu", ["cpu_adam"])
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator",
                        lambda: type("A", (), {"create_op_builder": lambda self, n: Builder()})())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert opbuild.build_ops("cpu") == 0
    err = capsys.readouterr().err
    said = {"new": "op built in", "unchanged": "op already built",
            "inputs changed": "op rebuilt in"}[case]
    assert f"DeepSpeed's `cpu_adam` {said}" in err, err
    assert ("building DeepSpeed's `cpu_adam` op once" in err) == (case == "new")
