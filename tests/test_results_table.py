"""BENCHMARKS.md opens with the table that `longft report --benchmarks bench/results` generates now
(metrics/results_table.py), so the table cannot go stale."""

from __future__ import annotations

from pathlib import Path

from longft.cli import main as cli
from longft.metrics import results_table

ROOT = Path(__file__).resolve().parents[1]


def test_benchmarks_md_holds_the_table_the_command_generates_now():
    text = (ROOT / "BENCHMARKS.md").read_text()
    block = results_table.block_in(text)
    assert block is not None, f"BENCHMARKS.md has no {results_table.MARKERS} block"
    want = results_table.render(ROOT / "bench" / "results")
    assert block == want, ("BENCHMARKS.md's results table is stale: run `longft report --benchmarks "
                           "bench/results` and paste its output over the block")


def test_the_table_comes_first_in_benchmarks_md():
    text = (ROOT / "BENCHMARKS.md").read_text()
    first_section = text.find("\n## ")
    assert 0 <= text.find(results_table.MARKERS[0]) < first_section


def test_every_listed_row_is_a_complete_result_and_references_exist():
    for cur in results_table.CURRENT:
        assert (ROOT / "bench" / "results" / f"{cur.stem}.json").is_file(), cur.stem
        assert cur.reference is None or cur.reference in results_table.REFERENCES


def test_report_benchmarks_flag_prints_the_block(capsys):
    assert cli.main(["report", "--benchmarks", str(ROOT / "bench" / "results")]) == 0
    assert capsys.readouterr().out == results_table.render(ROOT / "bench" / "results")


def test_a_missing_result_is_an_error_not_a_blank_row(tmp_path, capsys):
    assert cli.main(["report", "--benchmarks", str(tmp_path)]) == 1
    assert "not readable" in capsys.readouterr().err


def test_the_setup_cell_says_where_each_state_lives():
    """The NVMe row's setup says its optimizer states are on the disk, not on the CPU; the model
    has its published name."""
    doc = results_table._read(ROOT / "bench" / "results", "h200-3b-32k-nvme-cap24-host32")
    assert doc["params"]["zero"]["offload_optimizer"] == "nvme"
    setup = results_table._setup(doc)
    assert "optimizer on NVMe" in setup and "on the CPU" not in setup
    assert results_table._model(doc["params"]) == "Llama-3.2-3B, 32,768"
    doc = results_table._read(ROOT / "bench" / "results", "h200-8b-lora-32k-cap24-mb2-ka9")
    assert "optimizer + params on the CPU" in results_table._setup(doc)
