"""bench/nvme/disk_bandwidth.py, the disk's read and write bandwidth beside the NVMe row: where
DeepSpeed's async_io cannot be built it falls back to its own O_DIRECT measurement, says why, and
leaves nothing on the disk."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "nvme" / "disk_bandwidth.py"


def _module():
    spec = importlib.util.spec_from_file_location("disk_bandwidth", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_falls_back_to_direct_io_without_async_io_and_cleans_up(tmp_path, monkeypatch):
    bw = _module()
    monkeypatch.setattr(bw, "aio_buildable", lambda: (False, "libaio not found by DeepSpeed's check"))
    out = bw.measure(tmp_path, 4 * bw.BLOCK, "auto", 1)
    assert out["engine"] == "direct" and out["ds_io_error"] == "libaio not found by DeepSpeed's check"
    assert out["write_gib_s"] > 0 and out["read_gib_s"] > 0 and out["size_gib"] == round(4 / 1024, 3)
    assert out["filesystem"]["fstype"] and out["filesystem"]["free_gib"] > 0
    assert list(tmp_path.iterdir()) == []                     # its files are gone


def test_command_line_writes_the_json(tmp_path):
    out = tmp_path / "bw.json"
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--size-gib", "0.004", "--loops", "1",
                    "--engine", "direct", "--out", str(out)], check=True, capture_output=True)
    got = json.loads(out.read_text())
    assert got["engine"] == "direct" and got["loops"] == 1 and got["queue_depth"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["bw.json"]


def test_each_engine_reports_the_median_and_spread_of_its_loops(tmp_path):
    bw = _module()
    assert bw.spread([3.0, 1.0, 2.0], "read") == {"read_gib_s": 2.0, "read_gib_s_min": 1.0,
                                                  "read_gib_s_max": 3.0}
    assert bw.spread([4.0, 1.0], "write")["write_gib_s"] == 2.5
    out = bw.direct(tmp_path, 4 * bw.BLOCK, 3)
    for op in ("write", "read"):
        assert 0 < out[f"{op}_gib_s_min"] <= out[f"{op}_gib_s"] <= out[f"{op}_gib_s_max"]
