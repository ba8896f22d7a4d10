"""scripts/gpu_suite.sh: a sweep grid's rows in order, each row name once across grids, and the
items in the order given (GPU_SUITE_DRY lists them and runs nothing, so this runs without a GPU);
one --max-context item for real on the CPU (slow)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_max_context_items_bring_back_each_runs_log(tmp_path):
    """A --max-context item for real (the tiny default model on the CPU, one 1,024-token run):
    besides the report, the run's log comes back under $OUT/results/logs, with its step line
    (the 256K confirmation's speed was lost when its log stayed on the GPU machine)."""
    import yaml

    name = f"suite-logs-{os.getpid()}"
    overlay = tmp_path / f"{name}.yaml"
    overlay.write_text(yaml.safe_dump({"bench_note": "test", "data": {"source": "random",
                                                                      "pack": False}}))
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "scripts/gpu_suite.sh", "--no-tests", "--max-context-args",
                        "--max-seq 1024 --iterations 1", "--max-context", str(overlay), "16"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = yaml.safe_load((out / "results" / f"{name}-16gib-maxctx.json").read_text())
    assert report["confirmed_max_seq"] == 1024
    log = (out / "results" / "logs" / f"{name}-16gib-seq-1024.log").read_text()
    assert "step 1/1 loss" in log and "tok/s" in log
