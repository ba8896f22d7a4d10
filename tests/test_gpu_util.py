"""GPU utilisation is reported over the timed steps, not diluted by model load and set-up, and
drawn on the memory timeline (issue 20). Fake sampler rows and rank logs: no GPU needed."""

import csv
import json

import pytest

from longft.measure.monitor import util_over_windows
from longft.metrics.plots import gib_timeline, read_timeline
from longft.metrics.summary import summarize, write_outputs

T0 = 1_700_000_000.0
HEADER = ["t", "rss_tree_bytes", "sys_used_bytes", "gpu0_used_bytes", "gpu0_util_pct",
          "gpu1_used_bytes", "gpu1_util_pct"]


def test_util_over_windows_keeps_only_the_samples_inside():
    rows = [[T0 + i, 1.0, 2.0, 3.0, float(u0), 4.0, u1]
            for i, (u0, u1) in enumerate([(0, 0), (0, None), (90, 80), (70, 60), (0, 0), (50, 40)])]
    assert util_over_windows(HEADER, rows, [(T0 + 2, T0 + 3), (T0 + 5, T0 + 5)]) == \
        [pytest.approx(70.0), pytest.approx(60.0)]
    assert util_over_windows(HEADER, rows, [(T0 + 0.5, T0 + 0.9)]) == [None, None]
    assert util_over_windows(HEADER[:3], [r[:3] for r in rows], [(T0, T0 + 9)]) == []


def fake_run(run_dir, setup_s=60.0, steps=4, step_s=2.0, hz=10):
    """One rank: `setup_s` of model load at 0 % utilisation, then steps at 95 % (step 1 warm-up),
    then 5 s of final checkpoint at 0 %."""
    run_dir.mkdir()
    ends = [T0 + setup_s + step_s * s for s in range(1, steps + 1)]
    recs = [{"type": "env", "rank": 0, "world_size": 1, "seq_len": 128, "gpu_name": "NVIDIA H200",
             "precision": "bf16"}]
    recs += [{"type": "iter", "rank": 0, "step": s, "loss": 1.0, "tokens": 128, "seq_tokens": 128,
              "time_s": step_s, "timed": s > 1, "t": ends[s - 1]} for s in range(1, steps + 1)]
    recs.append({"type": "end", "rank": 0, "status": "complete", "steps": steps})
    (run_dir / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    total = setup_s + steps * step_s + 5.0
    with open(run_dir / "memory.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER[:5])
        for i in range(int(total * hz)):
            t = T0 + i / hz
            busy = T0 + setup_s < t <= ends[-1]
            w.writerow([f"{t:.3f}", 2**30, 2**31, 2**33, 95.0 if busy else 0.0])
    return run_dir


def test_the_summary_reports_utilisation_over_the_timed_steps(tmp_path):
    train, _, _ = summarize(fake_run(tmp_path / "run"), None)
    # whole-run mean would be 95 * 8 / 73 = 10.4 %; over the timed steps it is what the GPU did
    assert train["timed_steps"] == 3
    assert train["gpu_util_mean_pct"] == pytest.approx(95.0, abs=3)  # a boundary sample or two


def test_utilisation_is_on_the_memory_timeline_csv_and_png(tmp_path):
    run = fake_run(tmp_path / "run")
    header, rows = read_timeline(run / "memory.csv")
    out_header, out = gib_timeline(header, rows, T0, None, max_rows=50)
    assert out_header == ["t_rel_s", "rss_tree_gib", "sys_used_minus_baseline_gib",
                          "gpu0_used_gib", "gpu0_util_pct"]
    util = [r[4] for r in out]
    assert util[0] == 0.0 and max(util) == pytest.approx(95.0)
    # resampled bins average a rate (a bin half busy is about half), memory keeps its peak
    assert any(0 < u < 95 for u in util) or len(rows) <= 50
    train, env, loss_rows = summarize(run, None)
    write_outputs(tmp_path / "m", train, env, loss_rows, run)
    with open(tmp_path / "m" / "memory.csv", newline="") as f:
        assert "gpu0_util_pct" in next(csv.reader(f))
    png = (tmp_path / "m" / "memory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
