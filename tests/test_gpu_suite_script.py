"""scripts/gpu_suite.sh --grid: a sweep grid's rows in order, each row name once across grids
(GPU_SUITE_DRY lists the rows and runs nothing, so this runs without a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def suite(out, *args):
    env = {**os.environ, "GPU_SUITE_DRY": "1", "OUT": str(out),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "scripts/gpu_suite.sh", "--no-tests", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_grids_expand_to_their_rows_in_order_and_shared_rows_run_once(tmp_path):
    r = suite(tmp_path, "--grid", "bench/grids/q2-ckpt-offload.yaml", "--grid", "bench/grids/q3-lora.yaml",
              "bench/configs/h200-1b-16k-gpu.yaml")
    assert r.returncode == 0, r.stderr
    names = [Path(line.split(" ", 1)[1]).stem for line in r.stdout.splitlines() if line.startswith("row ")]
    assert names == ["1b-16k-gpu-mb4", "q2-1b-16k-ckpt-cpu-prefetch", "q2-1b-16k-ckpt-cpu-noprefetch",
                     "q3-1b-16k-lora8", "q3-1b-16k-lora64", "q3-8b-128k-lora8", "q3-8b-128k-lora64",
                     "h200-8b-128k-ratio",
                     "h200-1b-16k-gpu"]


def test_a_missing_grid_stops_the_suite(tmp_path):
    r = suite(tmp_path, "--grid", "bench/grids/no-such-grid.yaml")
    assert r.returncode == 2
    assert "no-such-grid" in r.stderr


def test_items_run_in_the_order_given_with_their_max_context_arguments(tmp_path):
    r = suite(tmp_path, "--max-context-args", "--host-mem 60 --max-seq 106496",
              "--max-context", "bench/configs/h200-8b-qlora-96k-cap24.yaml", "24",
              "bench/configs/h200-1b-16k-gpu.yaml", "--pytest", "tests/test_gpu_qlora.py -k 'fp16 or 8bit'",
              "--max-context-args", "", "--max-context", "bench/configs/maxctx-1b.yaml", "16",
              "bench/configs/h200-1b-16k-gpu.yaml", "--cmd", "python scripts/qlora_memory_probe.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "max-context bench/configs/h200-8b-qlora-96k-cap24.yaml 24 --host-mem 60 --max-seq 106496",
        "row bench/configs/h200-1b-16k-gpu.yaml",
        "pytest tests/test_gpu_qlora.py -k 'fp16 or 8bit'",
        "max-context bench/configs/maxctx-1b.yaml 16 ",
        "cmd python scripts/qlora_memory_probe.py",
    ]
