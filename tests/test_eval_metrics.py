"""Issue 19 A, the metrics side: eval records in runs/train -> train.json (eval_loss, eval_ppl,
best step, retrieval_accuracy with bins by context length and position), eval.csv, retrieval.png
and the report line; a run without evals still gets every output, with nulls."""

import csv
import json

from longft.measure.runlog import RunLog
from longft.metrics.eval import eval_metrics, length_bin, position_bin, retrieval_bins
from longft.metrics.summary import summarize, write_run_metrics


def eval_rec(step, loss, cite, lengths, positions, docs):
    return {"step": step, "loss": loss, "ppl": 2.718281828 ** loss, "tokens": 100, "samples": 4,
            "rows": 2, "time_s": 0.1, "scored_samples": len(cite),
            "retrieval_accuracy": sum(cite) / len(cite), "value_accuracy": 0.0,
            "retrieval": {"length": lengths, "position": positions, "num_docs": docs,
                          "cite_correct": cite, "value_correct": [0] * len(cite)}}


def write_run(run, evals, ranks=(0, 1)):
    run.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        with RunLog(run, r) as log:
            if r == 0:
                log.write("env", world_size=len(ranks), seq_len=4096, model_name="tiny-llama")
            for s in (1, 2, 3, 4):
                log.write("iter", step=s, loss=5.0 - s / 10, tokens=1000, time_s=1.0, timed=s > 1)
                for e in evals:
                    if e["step"] == s:
                        log.write("eval", **e)
            log.write("end", status="complete", steps=4)
    return run


LENGTHS, POSITIONS, DOCS = [900, 1500, 3000, 4000], [0.0, 0.3, 0.6, 1.0], [4, 8, 16, 20]


def test_train_json_has_quality_next_to_cost(tmp_path):
    evals = [eval_rec(2, 3.0, [0, 0, 1, 0], LENGTHS, POSITIONS, DOCS),
             eval_rec(4, 3.5, [1, 1, 0, 1], LENGTHS, POSITIONS, DOCS)]
    train, _, _ = summarize(write_run(tmp_path / "run", evals), None)
    assert train["status"] == "complete"
    assert train["eval_loss"] == 3.5 and train["eval_ppl"] == round(2.718281828 ** 3.5, 4)
    assert train["eval"] == {"step": 4, "evals": 2, "best_loss": 3.0, "best_step": 2,
                             "samples": 4, "tokens": 100}
    assert train["retrieval_accuracy"] == 0.75 and train["value_accuracy"] == 0.0
    r = train["retrieval"]
    assert r["method"] == "teacher_forced_citation" and r["scored_samples"] == 4
    assert r["chance"] == round((1 / 4 + 1 / 8 + 1 / 16 + 1 / 20) / 4, 4)
    assert r["by_length"] == {
        "513-1024": {"accuracy": 1.0, "samples": 1, "chance": 0.25},
        "1025-2048": {"accuracy": 1.0, "samples": 1, "chance": 0.125},
        "2049-4096": {"accuracy": 0.5, "samples": 2, "chance": round((1 / 16 + 1 / 20) / 2, 4)}}
    assert list(r["by_position"]) == ["0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1"]
    assert r["by_position"]["0.5-0.75"]["accuracy"] == 0.0
    assert r["by_position"]["0.75-1"] == {"accuracy": 1.0, "samples": 1, "chance": 0.05}


def test_outputs_eval_csv_retrieval_png_and_report(tmp_path):
    evals = [eval_rec(2, 3.0, [0, 1], LENGTHS[:2], POSITIONS[:2], DOCS[:2]),
             eval_rec(4, 2.5, [1, 1], LENGTHS[:2], POSITIONS[:2], DOCS[:2])]
    run = write_run(tmp_path / "run", evals)
    out = tmp_path / "metrics"
    train = write_run_metrics(run, None, out)
    assert json.loads((out / "train.json").read_text())["eval_loss"] == train["eval_loss"] == 2.5
    with open(out / "eval.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "eval_loss", "eval_ppl", "retrieval_accuracy", "value_accuracy"]
    assert [(int(r["step"]), float(r["eval_loss"]), float(r["retrieval_accuracy"])) for r in rows] \
        == [(2, 3.0, 0.5), (4, 2.5, 1.0)]
    png = (out / "retrieval.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    report = (out / "report.md").read_text()
    assert "| held-out eval | loss 2.5000" in report and "best 2.5000 at step 4" in report
    assert "retrieval (teacher-forced citation) 100.0 % of 2" in report


def test_a_run_without_evals_gets_nulls_and_every_output(tmp_path):
    out = tmp_path / "metrics"
    train = write_run_metrics(write_run(tmp_path / "run", []), None, out)
    assert train["eval_loss"] is None and train["eval_ppl"] is None
    assert train["retrieval_accuracy"] is None and train["eval"]["best_step"] is None
    assert train["retrieval"]["scored_samples"] == 0 and train["retrieval"]["by_length"] == {}
    assert (out / "eval.csv").read_text() == \
        "step,eval_loss,eval_ppl,retrieval_accuracy,value_accuracy\n"
    assert (out / "retrieval.png").read_bytes()[:4] == b"\x89PNG"
    assert "no held-out split" in (out / "report.md").read_text()


def test_a_resumed_run_keeps_its_earlier_evals(tmp_path):
    run = write_run(tmp_path / "run", [eval_rec(2, 3.0, [1], [900], [0.0], [4]),
                                       eval_rec(4, 2.0, [1], [900], [0.0], [4])], ranks=(0,))
    with RunLog(run, 0, resume_step=3):  # resumed from a step-3 checkpoint
        pass
    kinds = [json.loads(x)["type"] for x in (run / "rank0.jsonl").read_text().splitlines()]
    assert kinds.count("eval") == 1 and kinds.count("iter") == 3  # step 2's eval survives


def test_bins():
    assert [length_bin(n) for n in (1, 1024, 1025, 131072)] == \
        ["1", "513-1024", "1025-2048", "65537-131072"]
    assert [position_bin(p) for p in (0.0, 0.25, 0.74, 1.0)] == \
        ["0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1"]
    assert retrieval_bins(None)["scored_samples"] == 0
    assert eval_metrics([{"step": 1, "loss": float("nan")}])["eval"]["best_step"] is None
