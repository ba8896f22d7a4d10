"""HostSampler: process-tree RSS, sampling rate, CSV timeline, GPU columns (faked and real)."""

import csv
import subprocess
import sys
import textwrap
import time
import types

import pytest

from longft.measure import monitor
from longft.measure.monitor import HostSampler, gpu_inventory, rss_tree_bytes

MIB = 1024**2
GIB = 1024**3

# The sampled root is a Python process that runs a child: the child's memory must be found through
# the process tree. The child waits for a line on stdin, allocates and touches 400 MB (bytes * n
# writes every page), says so, and waits for stdin to close.
CHILD = textwrap.dedent("""
    import sys
    print("ready", flush=True)
    sys.stdin.readline()
    buf = b"x" * (400 * 1024 * 1024)
    print("allocated", flush=True)
    sys.stdin.read()
""")
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"


def _spawn(code):
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _finish(proc):
    proc.stdin.close()  # EOF ends the child and so the parent
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def test_child_allocation_raises_tree_peak(tmp_path):
    root = _spawn(PARENT)
    try:
        assert root.stdout.readline().strip() == "ready"
        path = tmp_path / "memory.csv"
        with HostSampler(root_pid=root.pid, csv_path=path, gpus=False) as s:
            time.sleep(0.3)
            before = rss_tree_bytes(root.pid)
            root.stdin.write("go\n")
            root.stdin.flush()
            assert root.stdout.readline().strip() == "allocated"
            t_alloc = time.time()
            time.sleep(0.5)
        summary = s.summary()
    finally:
        _finish(root)
    assert before < 200 * MIB  # two small interpreters
    assert summary["rss_tree_peak_bytes"] - before >= 350e6
    assert summary["rss_tree_peak_t"] <= t_alloc + 0.6
    assert summary["root_pid"] == root.pid
    assert summary["hz_achieved"] >= 10
    # system-wide memory moves with every other process of the host: only its form is checked
    assert isinstance(summary["sys_used_minus_baseline_peak_bytes"], int)
    assert summary["sys_used_baseline_bytes"] > 0
    header, rows = _read_csv(path)
    assert header[:3] == ["t", "rss_tree_bytes", "sys_used_bytes"]
    assert len(rows) == summary["samples"]
    ts = [float(r[0]) for r in rows]
    assert ts == sorted(ts) and (len(ts) - 1) / (ts[-1] - ts[0]) >= 10
    assert max(int(r[1]) for r in rows) == summary["rss_tree_peak_bytes"]


def test_default_root_is_this_process_and_rate():
    with HostSampler(gpus=False) as s:
        time.sleep(1.0)
    summary = s.summary()
    assert summary["root_pid"] == __import__("os").getpid()
    assert summary["rss_tree_peak_bytes"] >= rss_tree_bytes(summary["root_pid"]) * 0.5
    assert 10 <= summary["hz_achieved"] <= 25
    assert 15 <= summary["samples"] <= 30
    assert summary["t_start"] <= summary["rss_tree_peak_t"] <= summary["t_end"]
    # the CPU's model, as /proc/cpuinfo names it (a CPU run's speed depends on it)
    names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    assert summary["cpu_model"] == (names[0] if names else summary["cpu_model"])
    assert summary["cpu_model"]


def test_vanishing_processes_do_not_stop_sampling(tmp_path):
    # the root starts and ends short-lived children, then exits itself while still sampled
    code = ("import subprocess, sys\n"
            "for _ in range(8): subprocess.run([sys.executable, '-c', 'pass'])")
    root = subprocess.Popen([sys.executable, "-c", code])
    with HostSampler(root_pid=root.pid, csv_path=tmp_path / "m.csv", hz=50, gpus=False) as s:
        root.wait(timeout=60)
        n = s.summary()["samples"]
        time.sleep(0.3)
        assert s._thread.is_alive()
        assert s.summary()["samples"] > n
    _, rows = _read_csv(tmp_path / "m.csv")
    assert int(rows[-1][1]) == 0  # root gone: nothing left to count
    assert rss_tree_bytes(root.pid) == 0


def test_no_gpu_path(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor, "_nvml", lambda: None)
    assert gpu_inventory() == []
    for gpus in (True, False):
        path = tmp_path / f"m{gpus}.csv"
        with HostSampler(csv_path=path, gpus=gpus) as s:
            time.sleep(0.2)
        summary = s.summary()
        assert summary["gpu_used_peak_bytes"] == []
        assert summary["gpu_util_mean_pct"] == []
        assert summary["gpus"] == []
        header, rows = _read_csv(path)
        assert header == ["t", "rss_tree_bytes", "sys_used_bytes"]
        assert rows and all(len(r) == 3 for r in rows)


def test_without_nvml_library_gpu_lists_are_empty():
    # on this CPU machine the real _nvml() finds no library; on a GPU machine this is skipped
    if monitor._nvml() is not None:
        pytest.skip("NVML present")
    with HostSampler() as s:
        time.sleep(0.1)
    assert s.summary()["gpu_used_peak_bytes"] == [] and gpu_inventory() == []


class _NVMLError(Exception):
    pass


def _fake_nvml(used_by_index, util=40):
    """A pynvml stand-in with len(used_by_index) GPUs; used memory grows by 1 MiB a call."""
    calls = {"init": 0, "shutdown": 0}
    state = {i: u for i, u in enumerate(used_by_index)}

    def mem(h):
        state[h] += MIB
        return types.SimpleNamespace(used=state[h], total=80 * GIB)

    nv = types.SimpleNamespace(
        NVMLError=_NVMLError,
        nvmlInit=lambda: calls.__setitem__("init", calls["init"] + 1),
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: len(used_by_index),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetHandleByUUID=lambda u: (_ for _ in ()).throw(_NVMLError("no such uuid")),
        nvmlDeviceGetMemoryInfo=mem,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=util),
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlSystemGetDriverVersion=lambda: b"580.1",
    )
    return nv, calls


def test_gpu_columns_with_fake_nvml(tmp_path, monkeypatch):
    nv, calls = _fake_nvml([1 * GIB, 2 * GIB])
    monkeypatch.setattr(monitor, "_nvml", lambda: (nv.nvmlInit(), nv)[1])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_inventory() == [
        {"index": 0, "name": "NVIDIA H200", "memory_total_bytes": 80 * GIB, "driver": "580.1"},
        {"index": 1, "name": "NVIDIA H200", "memory_total_bytes": 80 * GIB, "driver": "580.1"}]
    path = tmp_path / "m.csv"
    with HostSampler(csv_path=path) as s:
        time.sleep(0.3)
    summary = s.summary()
    header, rows = _read_csv(path)
    assert header == ["t", "rss_tree_bytes", "sys_used_bytes", "gpu0_used_bytes", "gpu0_util_pct",
                      "gpu1_used_bytes", "gpu1_util_pct"]
    n = summary["samples"]
    first, last = rows[0], rows[-1]
    assert summary["gpu_used_baseline_bytes"] == [int(first[3]), int(first[5])]
    assert summary["gpu_used_peak_bytes"] == [int(last[3]), int(last[5])]  # grows each call
    assert [int(last[3]) - int(first[3]), int(last[5]) - int(first[5])] == [(n - 1) * MIB] * 2
    assert 1 * GIB < int(first[3]) < 1 * GIB + 10 * MIB
    assert summary["gpu_util_mean_pct"] == [40.0, 40.0]
    assert len(summary["gpus"]) == 2
    assert rows[-1][4] == "40.0"
    assert calls["init"] == calls["shutdown"]  # every init released


def test_cuda_visible_devices_selects_gpus(monkeypatch):
    nv, _ = _fake_nvml([1 * GIB, 2 * GIB, 3 * GIB])
    monkeypatch.setattr(monitor, "_nvml", lambda: nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert monitor._visible_handles(nv) == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,0")  # CUDA stops at the first bad entry
    assert monitor._visible_handles(nv) == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert monitor._visible_handles(nv) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-deadbeef")
    assert monitor._visible_handles(nv) == []


def test_api_misuse():
    with pytest.raises(ValueError):
        HostSampler(hz=0)
    s = HostSampler(gpus=False).start()
    with pytest.raises(RuntimeError):
        s.start()
    first = s.stop()
    assert s.stop()["samples"] == first["samples"]  # stopping twice is harmless


@pytest.mark.gpu
def test_gpu_two_gib_seen_by_torch_and_nvml():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)  # CUDA context first, so that it is part of the NVML baseline
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    alloc0 = torch.cuda.max_memory_allocated(dev)
    with HostSampler(hz=20) as s:
        time.sleep(0.3)
        x = torch.empty(2 * GIB, dtype=torch.uint8, device=dev)
        x.fill_(1)
        torch.cuda.synchronize(dev)
        time.sleep(0.5)
    summary = s.summary()
    grew_torch = torch.cuda.max_memory_allocated(dev) - alloc0
    del x
    torch.cuda.empty_cache()
    assert abs(grew_torch - 2 * GIB) <= 0.05 * 2 * GIB
    grew_nvml = summary["gpu_used_peak_bytes"][0] - summary["gpu_used_baseline_bytes"][0]
    assert abs(grew_nvml - 2 * GIB) <= 0.05 * 2 * GIB, (grew_nvml / GIB)
    assert summary["gpus"][0]["name"] == torch.cuda.get_device_name(dev)
    assert summary["gpu_util_mean_pct"][0] is not None
