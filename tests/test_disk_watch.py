"""The disk a run with offload_optimizer nvme uses: the train stage's sampler watches the swap
directory (HostSampler disk_dir, measure/disk.py), train.json reports it beside the estimator's disk
item (metrics/peak_disk.py), and the stage finds the directory in the DeepSpeed config it launches."""

import json
import os
import time
from pathlib import Path

from longft.config.params import from_dict
from longft.engine import ds_config
from longft.measure.disk import free_bytes, tree_bytes
from longft.measure.monitor import HostSampler
from longft.metrics.peak_disk import peak_disk
from longft.metrics.summary import summarize

MIB = 1024**2


def _wait_for(sampler, key, value, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if sampler.summary()[key] == value:
            return
        time.sleep(0.05)
    raise AssertionError(f"{key} never reached {value}: {sampler.summary()[key]}")


def test_sampler_records_the_swap_files_peak_above_what_was_there(tmp_path):
    root = tmp_path / "longft-optimizer"
    (root / "run-1").mkdir(parents=True)
    (root / "run-1" / "stale.swp").write_bytes(b"s" * MIB)           # a killed run's files stay out
    with HostSampler(csv_path=tmp_path / "memory.csv", gpus=False, disk_dir=root) as s:
        run = root / "run-2" / "zero_stage_3" / "optimizer"
        run.mkdir(parents=True)
        for i in range(3):                                           # the swapper writes its files
            (run / f"{i}.tensor.swp").write_bytes(b"x" * MIB)
        _wait_for(s, "disk_swap_peak_bytes", 3 * MIB)
        for f in run.iterdir():                                      # the run removes its own
            f.unlink()
    out = s.summary()
    assert out["disk_swap_peak_bytes"] == 3 * MIB and out["disk_swap_baseline_bytes"] == MIB
    assert out["disk_path"] == str(root) and out["disk_swap_peak_t"] >= out["t_start"]
    assert out["disk_free_min_bytes"] <= out["disk_free_start_bytes"]
    assert out["disk_free_end_bytes"] is not None
    assert "disk_swap_peak_bytes" not in HostSampler(gpus=False).summary()  # no NVMe, no disk keys
    header = (tmp_path / "memory.csv").read_text().splitlines()[0]
    assert "disk" not in header                                       # the timeline is unchanged


def test_tree_bytes_counts_files_not_links_and_free_bytes_looks_up(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "f").write_bytes(b"1" * 100)
    (tmp_path / "a" / "b" / "g").write_bytes(b"2" * 23)
    big = tmp_path / "outside"
    big.write_bytes(b"3" * 1000)
    os.symlink(big, tmp_path / "a" / "link")
    os.symlink(tmp_path, tmp_path / "a" / "b" / "loop")              # a cycle is not walked
    assert tree_bytes(tmp_path / "a") == 123
    assert tree_bytes(tmp_path / "missing") == 0
    assert free_bytes(tmp_path / "not" / "yet") == free_bytes(tmp_path) > 0


def test_train_json_compares_the_swap_peak_with_the_disk_item(tmp_path):
    GIB = 1024**3
    mon = {"t_start": 100.0, "disk_swap_peak_bytes": 50 * GIB, "disk_swap_peak_t": 130.5,
           "disk_free_start_bytes": 60 * GIB, "disk_free_min_bytes": 10 * GIB,
           "disk_free_end_bytes": 60 * GIB}
    got = peak_disk(mon, {"estimate": {"disk": {"bytes": 48 * GIB}}})["peak_disk"]
    assert got["swap_gib"] == 50.0 and got["predicted_gib"] == 48.0 and got["rel_error"] == -0.04
    assert got["swap_peak_t"] == 30.5 and got["free_min_gib"] == 10.0 and got["free_end_gib"] == 60.0
    assert peak_disk(mon, None)["peak_disk"]["rel_error"] is None    # no plan: no prediction
    assert peak_disk({"t_start": 1.0}, None) == {}                   # no NVMe: no key
    (tmp_path / "monitor.json").write_text(json.dumps(mon))
    train, _, _ = summarize(tmp_path, None)                          # the metrics stage's path
    assert train["peak_disk"]["swap_peak_bytes"] == 50 * GIB


def test_the_train_stage_watches_the_directory_the_ranks_swap_under(tmp_path):
    ds = ds_config.build(from_dict({"zero": {"offload_optimizer": "nvme", "nvme_path": str(tmp_path)}}),
                         "bf16", 64)
    root = ds_config.nvme_swap_root(ds)
    run = ds_config.nvme_run_dir(json.loads(json.dumps(ds)), "29500")
    assert Path(run).parent == Path(root) and root.startswith(str(tmp_path))
    assert ds_config.nvme_swap_root(ds_config.build(from_dict({}), "bf16", 64)) is None


def test_a_launch_watches_its_own_swap_directory_not_another_runs(tmp_path):
    """launch_ranks watches run-<its master port> below the swap root: another run's files there
    stay out, and a killed run's directory on the same port is removed first (DeepSpeed would
    write over its files in place, and the peak would read as 0)."""
    import sys

    from longft.run.launch import launch_ranks

    root = tmp_path / "longft-optimizer"
    (root / "run-4321").mkdir(parents=True)
    (root / "run-4321" / "0.tensor.swp").write_bytes(b"k" * 3 * MIB)     # a killed run's, this port
    (root / "run-999").mkdir()
    ranks = (f"import pathlib, time\n"
             f"r = pathlib.Path({str(root)!r})\n"
             f"(r / 'run-999' / 'other.swp').write_bytes(b'o' * {4 * MIB})\n"  # another live run
             f"(r / 'run-4321').mkdir(parents=True, exist_ok=True)\n"
             f"(r / 'run-4321' / '0.tensor.swp').write_bytes(b'x' * {2 * MIB})\n"
             f"time.sleep(0.7)\n")
    cmd = [sys.executable, "-c", ranks, "--master_port", "4321"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert launch_ranks(cmd, dict(os.environ), run_dir, swap_root=root) == 0
    mon = json.loads((run_dir / "monitor.json").read_text())
    assert mon["disk_path"] == str(root / "run-4321")
    assert mon["disk_swap_baseline_bytes"] == 0 and mon["disk_swap_peak_bytes"] == 2 * MIB
