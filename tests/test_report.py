"""`longft report` (table and plots from `dvc exp show --json` and bench result files) and the
`longft` command dispatch.

tests/fixtures/exp_show.json is a real `dvc exp show --json -A` (DVC 3.67) of a copy of this
repository with a tiny CPU pipeline: the workspace, commit `master` (4K tokens) with experiments
`seq2k` (done), `pending1` (queued) and `badwarm` (failed: it still shows master's metrics), and
two older commits carrying one earlier run. `deps`/`outs` are emptied to keep it small. DVC drops
null metrics, so e.g. `peak_vram` and `gpu_name` are absent on CPU.
"""

import copy
import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import pytest

from longft.cli import main as cli
from longft.config.params import Config, to_dict
from longft.metrics import report, run_sources
from longft.metrics.run_sources import Run

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "exp_show.json"
HEADER = ("| Setup | Model | Data | Context Length | Peak VRAM (MiB) | Peak DRAM (GiB) "
          "| Throughput (token/s) | Batch Size | LR | LoRA Rank | Eval Loss | Retrieval (%) |")


@pytest.fixture
def exp_show():
    return json.loads(FIXTURE.read_text())


@pytest.fixture
def params():
    """The shipped params (the dataclass defaults), not the workspace's params.yaml."""
    return to_dict(Config())


def gpu_run(params, name="8b-128k-8gpu", gpus=8, seq=128000, **train_extra):
    """A complete 8-GPU run as train.json / env.json would record it."""
    p = copy.deepcopy(params)
    p["model"]["name"] = "llama3.1-8b"
    p["data"].update(source="random", max_seq_length=seq)
    p["hardware"]["num_gpus"] = gpus
    p["train"].update(micro_batch_size=1, global_batch_size=gpus)
    p["zero"].update(stage=3, offload_optimizer="cpu", offload_param="cpu")
    train = {"status": "complete", "tokens_per_s": 19876.4, "seq_len": seq, "world_size": gpus,
             "peak_vram": {"max_allocated_gib": 53.0}, "peak_dram": {"rss_tree_gib": 180.26},
             **train_extra}
    env = {"gpu_name": "NVIDIA H200", "model_name": "llama3.1-8b", "n_params": 8.03e9,
           "world_size": gpus, "micro_batch_size": 1, "global_batch_size": gpus, "seq_len": seq,
           "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "lora_rank": 0}
    return Run(name, p, train, env)


# -- dvc exp show ------------------------------------------------------------------------------

def test_exp_show_fixture_rows_and_notes(exp_show):
    runs, notes = run_sources.runs_from_exp_show(exp_show)
    # the workspace equals master, and the two older commits carry one run: each listed once
    assert [r.name for r in runs] == ["master (0058e7b)", "seq2k (02dbff0)", "7355f0c"]
    assert notes == ["pending1 (2d94476): queued", "badwarm (a64985a): failed"]
    rows, more = report.build_rows(runs)
    assert more == []
    text = report.render_table(rows, notes + more, "dvc exp show")
    lines = text.splitlines()
    assert lines[0] == HEADER
    cpu = "| 1xCPU ZeRO-3 offload opt | tiny-llama | synthetic |"
    assert lines[1] == "|---|---|---|" + "---:|" * 9
    quality = "| 0.001 | 0 | n/a | n/a |"  # a run from before held-out evals
    assert lines[2] == f"{cpu} 2048 | n/a | 4.8 | 851 | 2 (1/GPU x 2 accum) {quality}"
    assert lines[3] == f"{cpu} 4096 | n/a | 3.7 | 679 | 2 (1/GPU x 2 accum) {quality}"
    assert "- left out: pending1 (2d94476): queued" in lines
    assert "- left out: badwarm (a64985a): failed" in lines
    assert "Source: dvc exp show." in text


def test_exp_show_without_experiments_or_metrics(exp_show):
    base = copy.deepcopy(exp_show[1])
    base["experiments"] = None
    base["data"]["metrics"] = {}
    runs, notes = run_sources.runs_from_exp_show([base])
    assert runs == [] and notes == ["master (0058e7b): no metrics/train.json (not run)"]


def test_gpu_run_from_synthetic_exp_show(exp_show, params):
    run = gpu_run(params)
    rec = copy.deepcopy(exp_show[1])
    rec["experiments"] = None
    rec["data"]["params"]["params.yaml"]["data"] = run.params
    rec["data"]["metrics"] = {"metrics/train.json": {"data": run.train},
                              "metrics/env.json": {"data": run.env}}
    runs, _ = run_sources.runs_from_exp_show([rec])
    rows, _ = report.build_rows(runs)
    line = report.render_table(rows, []).splitlines()[2]
    assert line == ("| 8xH200 ZeRO-3 offload opt+param | llama3.1-8b | random | 128000 | 54,272 | 180.3 "
                    "| 19,876 | 8 (1/GPU) | 0.001 | 0 | n/a | n/a |")
    named = report.render_table(rows, [], names=True).splitlines()
    assert named[0].startswith("| Run | Setup |")
    assert named[2].startswith("| master (0058e7b) | 8xH200")
    # issue 48: two rows that read alike (experiments of one setup) are told apart by name
    assert report.render_table(rows, [], names=None).splitlines()[0].startswith("| Setup |")
    twin = dataclasses.replace(rows[0], name="lr-3e-4 (ae30811)", lr=3e-4)
    both = report.render_table(rows + [twin], [], names=None).splitlines()
    assert both[0].startswith("| Run | Setup |") and both[3].startswith("| lr-3e-4 (ae30811) |")


def test_rows_left_out_with_reason(params):
    stale = gpu_run(params, name="stale")
    stale.params["data"]["max_seq_length"] = 65536  # params changed, metrics not re-run
    incomplete = gpu_run(params, name="killed", status="incomplete")
    bad = gpu_run(params, name="bad")
    bad.params["train"]["global_batch_size"] = 3
    rows, notes = report.build_rows([stale, incomplete, bad, gpu_run(params)])
    assert [r.name for r in rows] == ["8b-128k-8gpu"]
    assert notes[0] == ("stale: metrics are from other params"
                        " (seq_len 128000 in metrics, 65536 in params)")
    assert notes[1] == "killed: incomplete run (status incomplete)"
    assert notes[2].startswith(
        "bad: params do not validate (1 problem(s), first: train.global_batch_size")


def test_metrics_of_other_training_params_are_left_out_by_their_sections(params):
    """Walkthrough (2026-12-05): train.iterations edited after the baseline ran, not re-run: its
    metrics belong to other params although no placement knob changed. Each section's digest,
    recorded at the run, says which; a default written out changes none."""
    from longft.config.params import from_dict, section_digests

    run = gpu_run(params)
    run.env["params_digests"] = section_digests(from_dict(run.params))
    explicit = copy.deepcopy(run)
    explicit.params["optim"]["lr"] = Config().optim.lr   # the default, written out
    edited = gpu_run(params, name="edited")
    edited.env["params_digests"] = run.env["params_digests"]
    edited.params["train"]["iterations"] = 6
    edited.params["optim"]["lr"] = 3e-4
    rows, notes = report.build_rows([run, explicit, edited, gpu_run(params, name="older")])
    assert [r.name for r in rows] == ["8b-128k-8gpu", "8b-128k-8gpu", "older"]  # older: no digests
    assert notes == ["edited: metrics are from other params (params section(s) train, optim changed "
                     "since these metrics were measured (`dvc repro` measures them))"]


def test_rows_sorted_and_setup_strings(params):
    small = gpu_run(params, name="a", gpus=1)
    small.params["model"]["name"] = small.env["model_name"] = "llama3.2-1b"
    small.env["n_params"] = 1.2e9
    lora = gpu_run(params, name="lora", gpus=2)
    lora.params["lora"]["rank"] = lora.env["lora_rank"] = 16
    lora.params["zero"]["offload_param"] = lora.env["offload_param"] = "none"
    rows, notes = report.build_rows([gpu_run(params), lora, small])
    assert notes == []
    assert [(r.name, r.setup) for r in rows] == [
        ("a", "1xH200 ZeRO-3 offload opt+param"),
        ("lora", "2xH200 ZeRO-3 offload opt LoRA r16"),
        ("8b-128k-8gpu", "8xH200 ZeRO-3 offload opt+param")]


def test_setup_names_the_quantized_base_and_block_sparse(params):
    # the walkthrough's QLoRA row read "1xCPU ZeRO-2 offload opt LoRA r16": no nf4
    qlora = gpu_run(params, name="qlora", gpus=1)
    qlora.params["lora"].update(rank=16, quantize="nf4")
    qlora.params["zero"].update(stage=2, offload_param="none")
    qlora.env.update(lora_rank=16, zero_stage=2, offload_param="none")
    sparse = gpu_run(params, name="sparse", gpus=1)
    sparse.params["sparse"].update(blocks=46, block_size=64)
    sparse.params["lora"]["quantize"] = "int8"
    sparse.params["zero"].update(stage=2, offload_param="none")
    sparse.env.update(zero_stage=2, offload_param="none")
    rows, notes = report.build_rows([qlora, sparse])
    assert notes == []
    assert {r.name: r.setup for r in rows} == {
        "qlora": "1xH200 ZeRO-2 offload opt LoRA r16 on nf4",
        "sparse": "1xH200 ZeRO-2 offload opt block-sparse 46x64^2 on int8"}


def test_rows_on_different_data_say_which(params):
    synthetic = gpu_run(params, name="synthetic", gpus=1)
    synthetic.params["data"]["source"] = "synthetic"
    mine = gpu_run(params, name="mine", gpus=1)
    mine.params["data"].update(source="jsonl", path="mydata/train.jsonl", num_samples=None)
    deep = gpu_run(params, name="deep", gpus=1)
    deep.params["data"].update(source="parquet", path="/data/projects/2026/customer-reports/all.parquet",
                               num_samples=None)
    hub = gpu_run(params, name="hub", gpus=1)
    hub.params["data"].update(source="hf", path="THUDM/LongCite-45k", split="test", num_samples=None)
    rows, notes = report.build_rows([synthetic, mine, deep, hub])
    assert notes == []
    assert {r.name: r.data for r in rows} == {
        "synthetic": "synthetic", "mine": "mydata/train.jsonl", "deep": ".../all.parquet",
        "hub": "hf THUDM/LongCite-45k:test"}
    text = report.render_table(rows, [])
    assert "| 1xH200 ZeRO-3 offload opt+param | llama3.1-8b | mydata/train.jsonl | 128000 |" in text
    # the same setup, model and context on two data sets: rows of their own, no Run column needed
    assert text.splitlines()[0] == HEADER


# -- bench result files ------------------------------------------------------------------------

def test_bench_results_table(tmp_path, params):
    run = gpu_run(params, gpus=1)
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "8b-128k.json").write_text(json.dumps(
        {"name": "8b-128k", "status": "ok", "params": run.params, "train": run.train,
         "env": run.env}))
    (tmp_path / "oom.json").write_text(json.dumps(
        {"name": "oom", "status": "failed: stage train exited 1", "params": run.params}))
    (tmp_path / "broken.json").write_text("{")
    runs, notes = run_sources.runs_from_bench(tmp_path)
    assert [r.name for r in runs] == ["h200/8b-128k"]
    assert notes[0].startswith("broken: not readable JSON")
    assert notes[1] == "oom: no train metrics (status: failed: stage train exited 1)"
    rows, _ = report.build_rows(runs)
    assert report.render_table(rows, notes).splitlines()[2] == (
        "| 1xH200 ZeRO-3 offload opt+param | llama3.1-8b | random | 128000 | 54,272 | 180.3 | 19,876 | 1 "
        "| 0.001 | 0 | n/a | n/a |")


def test_quality_columns_next_to_cost(params):
    """Eval loss, retrieval, lr and LoRA rank of each run beside its speed and memory (issue 36)."""
    lora = gpu_run(params, name="lora", eval_loss=1.23456, retrieval_accuracy=0.875)
    lora.params["lora"]["rank"] = lora.env["lora_rank"] = 16
    lora.params["optim"]["lr"] = 2e-4
    rows, notes = report.build_rows([lora])
    assert notes == []
    assert report.render_table(rows, []).splitlines()[2].endswith(
        "| 19,876 | 8 (1/GPU) | 0.0002 | 16 | 1.2346 | 87.5 |")


def test_exp_show_with_headline_metric_reads_detail_at_revision(exp_show, params):
    """Since metrics/headline.json is the declared metric, exp show has no train.json: the detail
    files are read at the revision (git show REV:metrics/train.json; the workspace's own files)."""
    run = gpu_run(params, eval_loss=2.5)
    rec = copy.deepcopy(exp_show[1])
    rec["experiments"] = None
    rec["data"]["params"]["params.yaml"]["data"] = run.params
    rec["data"]["metrics"] = {"metrics/headline.json": {"data": {"status": "complete"}}}
    asked = []

    def detail(rev, path):
        asked.append((rev, path))
        return {"metrics/train.json": run.train, "metrics/env.json": run.env}[path]

    runs, notes = run_sources.runs_from_exp_show([rec], detail=detail)
    assert notes == [] and asked == [(rec["rev"], "metrics/train.json"),
                                     (rec["rev"], "metrics/env.json")]
    rows, _ = report.build_rows(runs)
    assert rows[0].eval_loss == 2.5 and rows[0].device == "H200"
    runs, notes = run_sources.runs_from_exp_show([rec], detail=lambda rev, path: {})
    assert runs == [] and notes == ["master (0058e7b): no metrics/train.json (not run)"]


def test_shipped_bench_results_render():
    rows, notes = report.build_rows(run_sources.runs_from_bench(REPO / "bench" / "results")[0])
    assert rows and all(r.device == "H200" for r in rows)
    # the shipped rows that did not complete are the out-of-memory ones: the expected one under a
    # 16 GiB cap, 8B QLoRA at 128K and 8B LoRA at micro-batch 2 under a 24 GiB cap (bench/LOG.md)
    assert notes == ["h200-1b-16k-cap16-oom: incomplete run (status incomplete)",
                     "h200-8b-lora-32k-cap24-mb2: incomplete run (status incomplete)",
                     "h200-8b-qlora-128k-cap24: incomplete run (status incomplete)"]


# -- plots -------------------------------------------------------------------------------------

def test_plots_written(tmp_path, params):
    rows, _ = report.build_rows([gpu_run(params, name=f"g{g}", gpus=g) for g in (1, 2, 4, 7, 8)]
                                + [gpu_run(params, name=f"s{s}", gpus=1, seq=s)
                                   for s in (16384, 65536)])
    paths = report.write_plots(rows, tmp_path / "plots")
    assert [p.name for p in paths] == list(report.PLOT_FILES)
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    empty = report.write_plots([], tmp_path / "empty")  # still a PNG that says "no data"
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in empty)


# -- command line ------------------------------------------------------------------------------

def test_cli_report_from_saved_exp_json(tmp_path, capsys):
    out = tmp_path / "results.md"
    rc = cli.main(["report", "--exp-json", str(FIXTURE), "--out", str(out),
                   "--plots", str(tmp_path / "plots")])
    assert rc == 0
    text = out.read_text()
    # two of its rows read the same setup, model and context: the Run column tells them apart
    assert text.splitlines()[0] == "| Run " + HEADER and "| 2048 |" in text
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(report.PLOT_FILES)
    assert "3 row(s)" in capsys.readouterr().err


def test_cli_report_from_json_to_stdout(tmp_path, capsys, params):
    run = gpu_run(params, gpus=2)
    (tmp_path / "r.json").write_text(json.dumps({"params": run.params, "train": run.train,
                                                 "env": run.env}))
    assert cli.main(["report", "--from-json", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 2xH200 ZeRO-3 offload opt+param | llama3.1-8b | random | 128000 |" in out
    assert cli.main(["report", "--from-json", str(tmp_path / "missing")]) == 2


def test_cli_estimate_dispatch(monkeypatch):
    seen = []
    fake = types.ModuleType("longft.cli.estimate")
    fake.main = lambda command, argv: seen.append((command, argv)) or 1
    monkeypatch.setitem(sys.modules, "longft.cli.estimate", fake)
    assert cli.main(["max-context", "--gpu-mem", "80"]) == 1
    assert seen == [("max-context", ["--gpu-mem", "80"])]


def test_cli_plan_is_an_alias_of_placement(monkeypatch, capsys):
    """`longft plan` (its old name) says in one line what it is now and runs `longft placement`."""
    seen = []
    fake = types.ModuleType("longft.cli.estimate")
    fake.main = lambda command, argv: seen.append((command, argv)) or 1
    monkeypatch.setitem(sys.modules, "longft.cli.estimate", fake)
    assert cli.main(["plan", "--gpu-mem", "24", "--seq", "4096"]) == 1
    assert seen == [("placement", ["--gpu-mem", "24", "--seq", "4096"])]
    assert capsys.readouterr().err == "longft plan is now longft placement\n"


def test_cli_estimate_not_available(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "longft.cli.estimate", None)  # import raises ImportError
    assert cli.main(["placement", "--gpus", "1"]) == 2
    assert "longft placement: not available" in capsys.readouterr().err


# -- offline `dvc plots show` ------------------------------------------------------------------

def test_dvc_plots_page_needs_no_network(tmp_path):
    """`.dvc/config` points DVC at a page with Vega inlined; DVC's CDN script tags never land."""
    dvc_render = pytest.importorskip("dvc_render")
    assert "html_template = plots/offline.html" in (REPO / ".dvc" / "config").read_text()
    template = REPO / ".dvc" / "plots" / "offline.html"
    page = template.read_text()
    assert "{plot_divs}" in page and "{scripts}" not in page
    assert all(f"/* {lib}" in page for lib in ("vega 5", "vega-lite 5", "vega-embed 6"))
    renderer = dvc_render.VegaRenderer(
        [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], "metrics/loss.csv",
        x="step", y="loss")
    out = tmp_path / "index.html"
    dvc_render.render_html([renderer], out, html_template=template)
    html = out.read_text()
    assert "vegaEmbed(" in html and '"loss": 1.5' in html
    assert not re.search(r"<script[^>]*\bsrc\s*=", html) and "cdn.jsdelivr" not in html
    dvc_render.render_html([renderer], tmp_path / "default.html")  # DVC's own page: CDN scripts
    assert re.search(r"<script[^>]*\bsrc\s*=", (tmp_path / "default.html").read_text())
