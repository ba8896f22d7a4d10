"""`longft report --from-json DIR --grid GRID.yaml`: a sweep grid's rows matched to bench result
files (DIR/<row name>.json), rows not run, results whose params differ from their row, the plot
axes inferred from the rows (or the grid's report: item), the findings table and the PNG.

The fake results are copies of a real one (bench/results/h200-1b-16k-offload.json, Llama-3.2-1B,
16K, micro-batch 20, params and optimizer on the CPU) with the row's params and new numbers."""

import copy
import json
from pathlib import Path

import pytest

from longft.cli import main as cli
from longft.config.grid import GridError, GridMeta, parse_grid_meta, read_grid, read_raw
from longft.metrics import grid_report
from longft.metrics.grid_axes import GridReportError, infer_axes

REPO = Path(__file__).resolve().parents[1]
REAL = json.loads((REPO / "bench" / "results" / "h200-1b-16k-offload.json").read_text())

GRID = """\
- &c
  name: mb1
  zero.offload_param: cpu
  train.micro_batch_size: 1
  train.global_batch_size: 1
  data.num_samples: 4
- {<<: *c, name: mb2, train.micro_batch_size: 2, train.global_batch_size: 2, data.num_samples: 8}
- {<<: *c, name: mb4, train.micro_batch_size: 4, train.global_batch_size: 4, data.num_samples: 16}
- {<<: *c, name: mb8, train.micro_batch_size: 8, train.global_batch_size: 8, data.num_samples: 32}
- {<<: *c, name: gpu-mb1, zero.offload_param: none}
- {<<: *c, name: gpu-mb2, zero.offload_param: none, train.micro_batch_size: 2,
   train.global_batch_size: 2, data.num_samples: 8}
- {<<: *c, name: gpu-mb4, zero.offload_param: none, train.micro_batch_size: 4,
   train.global_batch_size: 4, data.num_samples: 16}
"""
HEAD = ("| Row | train.micro_batch_size | zero.offload_param | train.global_batch_size "
        "| data.num_samples | tok/s | tok/s per GPU | MFU (%) | Peak VRAM alloc (GiB) "
        "| Peak DRAM RSS (GiB) | GPU util (%) | fwd (s) | bwd (s) | opt (s) |")


def result(name, mb, offload="cpu", tps=1000.0, vram=10.0, dram=20.0, util=50.0, **train):
    """A bench result for a row: the real file with this micro-batch (global batch and samples
    to match) and offload, and these numbers."""
    doc = copy.deepcopy(REAL)
    doc["name"] = name
    for tree in (doc["params"], doc["overlay"]):
        tree["train"].update(micro_batch_size=mb, global_batch_size=mb)
        tree["data"]["num_samples"] = 4 * mb
        tree["zero"]["offload_param"] = offload
    doc["env"].update(micro_batch_size=mb, global_batch_size=mb, offload_param=offload)
    t = doc["train"]
    t.update(tokens_per_s=tps, tokens_per_s_per_gpu=tps, gpu_util_mean_pct=util, fwd_s=mb * 0.1,
             bwd_s=mb * 0.2, opt_s=0.05, mfu=0.25, **train)
    t["peak_vram"]["max_allocated_gib"] = vram
    t["peak_dram"]["rss_tree_gib"] = dram
    return doc


@pytest.fixture
def bench(tmp_path):
    """The grid and a results folder: mb8 not run, gpu-mb2 run at micro-batch 4 (the grid was
    edited afterwards), gpu-mb4 killed, plus a result of some other grid."""
    grid = tmp_path / "q1-mb.yaml"
    grid.write_text(GRID)
    res = tmp_path / "results"
    res.mkdir()
    docs = [result("mb1", 1, tps=1000.0, vram=10.0, dram=20.0, util=40.0),
            result("mb2", 2, tps=1800.0, vram=14.0, dram=21.0, util=60.0),
            result("mb4", 4, tps=2500.0, vram=22.0, dram=22.5, util=80.0),
            result("gpu-mb1", 1, "none", tps=3000.0, vram=30.0, dram=5.0, util=90.0),
            result("gpu-mb2", 4, "none", tps=9999.0),
            result("gpu-mb4", 4, "none", status="incomplete"),
            result("other", 1, tps=1234.5)]
    for doc in docs:
        (res / f"{doc['name']}.json").write_text(json.dumps(doc))
    return grid, res


def collect(grid, res):
    rows, meta = read_grid(grid)
    return grid_report.collect(grid, rows, meta, res)


def test_rows_matched_to_results(bench):
    got = collect(*bench)
    stem = {r.number: r.stem for r in got.rows}
    assert sorted(stem[n] for n in got.points) == ["gpu-mb1", "mb1", "mb2", "mb4"]
    assert {stem[n]: s for n, s in got.status.items()} == {
        "mb8": "not run", "gpu-mb2": "params differ", "gpu-mb4": "failed"}
    assert got.notes[0] == "not run (1 of 7, no <name>.json in {}): mb8".format(bench[1])
    differ = [n for n in got.notes if n.startswith("PARAMS DIFFER")]
    assert differ == ["PARAMS DIFFER (not used): gpu-mb2: train.micro_batch_size 2 in the grid, 4 in "
                      "the result; train.global_batch_size 2 in the grid, 4 in the result; "
                      "data.num_samples 8 in the grid, 16 in the result (re-run the row, or "
                      "restore the grid)"]
    assert "failed: gpu-mb4: incomplete run (status incomplete)" in got.notes
    assert got.points[2].result.tokens_per_s == 1800.0  # mb2's own file, not another's


def test_axes_inferred_from_the_rows(bench):
    axes = collect(*bench).axes
    # micro-batch over global batch (a follower) and num_samples (bookkeeping); offload as lines
    assert (axes.x, axes.series, axes.inferred) == (
        "train.micro_batch_size", ("zero.offload_param",), True)
    assert axes.varying == ("zero.offload_param", "train.micro_batch_size",
                            "train.global_batch_size", "data.num_samples")


def test_reference_grid_axes():
    rows, meta = read_grid(REPO / "bench" / "grids" / "reference.yaml")
    axes = infer_axes(rows, meta)
    assert (axes.x, axes.series) == ("hardware.num_gpus", ("model.name",))


def test_report_item_overrides_the_axes(bench):
    grid, _ = bench
    rows, meta, problems = parse_grid_meta(
        [{"report": {"x": "zero.offload_param"}}] + read_raw(grid))
    assert problems == [] and meta == GridMeta("zero.offload_param", None)
    axes = infer_axes(rows, meta)
    assert (axes.x, axes.series, axes.inferred) == (
        "zero.offload_param", ("train.micro_batch_size",), False)
    axes = infer_axes(rows, GridMeta("name"))
    assert (axes.x, axes.series) == ("name", ())
    with pytest.raises(GridError, match="report: optim.lr does not vary between the rows"):
        infer_axes(rows, GridMeta("optim.lr"))


def test_table(bench):
    text = grid_report.render(collect(*bench), "bench results in R")
    lines = text.splitlines()
    assert lines[0] == f"### q1-mb ({bench[0]})"
    assert lines[2] == ("x: train.micro_batch_size; series: zero.offload_param (inferred). "
                        "4 of 7 rows measured.")
    assert lines[4] == HEAD
    assert lines[6] == ("| mb1 | 1 | cpu | 1 | 4 | 1,000 | 1,000 | 25.0 | 10.0 | 20.0 | 40 | 0.10 "
                        "| 0.20 | 0.05 |")
    assert lines[9] == "| mb8 | 8 | cpu | 8 | 32 | not run |" + "  |" * 8
    assert lines[11] == "| gpu-mb2 | 2 | none | 2 | 8 | params differ |" + "  |" * 8
    assert lines[12] == "| gpu-mb4 | 4 | none | 4 | 16 | failed |" + "  |" * 8
    assert "9,999" not in text and "1,234" not in text  # the flagged result and another grid's
    assert "Source: bench results in R." in text


def test_plot_data_and_png(bench, tmp_path):
    got = collect(*bench)
    scale, ticks, series = grid_report.plot_data(got)
    assert scale == "log2"
    assert ticks == [(1.0, "1"), (2.0, "2"), (4.0, "4"), (8.0, "8")]  # mb8 keeps its tick
    assert list(series) == ["zero.offload_param=cpu", "zero.offload_param=none"]
    assert [(x, m["tok_s"], m["util"]) for x, m in series["zero.offload_param=cpu"]] == [
        (1.0, 1000.0, 40.0), (2.0, 1800.0, 60.0), (4.0, 2500.0, 80.0)]
    assert [(x, m["vram"], m["dram"], m["bwd"]) for x, m in series["zero.offload_param=none"]] \
        == [(1.0, 30.0, 5.0, 0.2)]

    import matplotlib.image

    path = grid_report.write_plot(got, tmp_path / "plots")
    assert path == tmp_path / "plots" / "q1-mb.png"
    img = matplotlib.image.imread(path)
    assert img.shape[:2] == (800, 1400)
    assert path.stat().st_size > 30_000 and img[..., :3].std() > 0.05  # drawn, not blank


def test_categorical_x_in_grid_order(tmp_path):
    rows, meta, _ = parse_grid_meta([
        {"name": "gpu", "checkpointing.mode": "gpu"},
        {"name": "off", "checkpointing.mode": "cpu_offload"},
        {"name": "none", "checkpointing.mode": "none"},
        {"name": "plain", "train.iterations": 6}])
    axes = infer_axes(rows, meta)
    assert axes.x == "checkpointing.mode"
    res = grid_report.GridResults(tmp_path / "g.yaml", rows, axes, {}, {}, [])
    scale, ticks, _ = grid_report.plot_data(res)
    assert scale == "category"
    assert ticks == [(0.0, "gpu"), (1.0, "cpu_offload"), (2.0, "none"), (3.0, "(default)")]
    assert grid_report.x_scale([1, 2, 3]) == "linear" and grid_report.x_scale([True, False]) == \
        "category"


def test_values_compared_as_recorded():
    assert grid_report.same(1e5, 100000) and grid_report.same([0.9, 0.95], (0.9, 0.95))
    assert not grid_report.same(True, 1) and not grid_report.same("cpu", "none")
    assert not grid_report.same(None, 0)


def test_command_line(bench, tmp_path, capsys):
    grid, res = bench
    other = tmp_path / "q2.yaml"
    other.write_text("- {name: mb1, train.micro_batch_size: 1}\n"
                     "- {name: gpu-mb1, train.micro_batch_size: 1, zero.offload_param: none}\n")
    out = tmp_path / "findings.md"
    assert cli.main(["report", "--from-json", str(res), "--grid", str(grid), "--grid", str(other),
                     "--out", str(out), "--plots", str(tmp_path / "plots")]) == 0
    text = out.read_text()
    assert text.count("\n### ") == 1 and text.startswith("### q1-mb") and "### q2 (" in text
    assert HEAD in text
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["q1-mb.png", "q2.png"]
    err = capsys.readouterr().err
    assert "PARAMS DIFFER (not used): gpu-mb2" in err
    assert cli.main(["report", "--from-json", str(res), "--grid", str(grid)]) == 0
    assert capsys.readouterr().out.splitlines()[4] == HEAD


def test_clear_errors(bench, tmp_path, capsys):
    grid, res = bench

    def fails(*argv):
        assert cli.main(["report", *argv]) == 2
        return capsys.readouterr().err

    assert "no such grid file" in fails("--from-json", str(res), "--grid", str(tmp_path / "x.yaml"))
    assert "give --from-json DIR" in fails("--grid", str(grid))
    same = tmp_path / "same.yaml"
    same.write_text("- {name: a, train.micro_batch_size: 1}\n- {name: b, train.micro_batch_size: 1}\n")
    assert "no key varies between its rows" in fails("--from-json", str(res), "--grid", str(same))
    with pytest.raises(GridReportError):
        infer_axes(*read_grid(same))
    empty = tmp_path / "empty"
    empty.mkdir()
    err = fails("--from-json", str(empty), "--grid", str(grid))
    assert "no results at all" in err and "none of its 7 rows' result files" in err
