"""Metrics stage on a synthetic two-rank run: hand-computed aggregates, partial files, outputs."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longft import atomic
from longft.config.plan import Plan
from longft.estimate.flops import flops_per_token
from longft.metrics.summary import HEADLINE, summarize, write_outputs
from test_plan_file import plan_dict  # tests/ is on sys.path under pytest

GIB = 1024**3
REPO = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000.0
PLAN_DICT = plan_dict(model_config={
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256})
PLAN = Plan.from_dict(PLAN_DICT)
ENV = {"type": "env", "rank": 0, "gpu_name": "NVIDIA A100-SXM4-40GB", "gpu_count": 2,
       "driver": "550.54", "cuda": "12.4", "torch": "2.6.0", "deepspeed": "0.19.8",
       "transformers": "5.17.0", "liger_kernel": "0.8.5", "peft": None, "python": "3.11.2",
       "precision": "bf16", "attention": "flash_attention_2", "checkpointing": "cpu_offload",
       "liger": True, "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "none",
       "world_size": 2, "micro_batch_size": 1, "global_batch_size": 2, "seq_len": 1024,
       "model_name": "tiny-llama", "model_source": "random", "n_params": 123456}

# per step: (rank0 time_s, rank1 time_s); steps 1-2 are warm-up
TIMES = {1: (10.0, 9.0), 2: (3.0, 3.1), 3: (2.0, 2.1), 4: (2.2, 2.0), 5: (2.1, 2.4)}
TOKENS = (1000, 900)
LOSS = {0: [5.0, 4.0, 3.0, 2.5, 2.0], 1: [5.2, 4.2, 3.2, 2.7, 2.2]}
# step end times: the slowest rank's latencies one after the other, after 20 s of setup
ENDS = {}
_t = T0 + 20.0
for _s in range(1, 6):
    _t += max(TIMES[_s])
    ENDS[_s] = _t


def _iter(rank, step):
    time_s = TIMES[step][rank]
    return {"type": "iter", "rank": rank, "step": step, "loss": LOSS[rank][step - 1],
            "lr": 1e-3 * step, "tokens": TOKENS[rank], "seq_tokens": 1024, "time_s": time_s,
            "fwd_s": 0.25 * time_s, "bwd_s": 0.5 * time_s, "opt_s": 0.25 * time_s,
            "timed": step > 2, "max_allocated_bytes": (rank + 1) * step * GIB // 2,
            "max_reserved_bytes": (rank + 1) * step * GIB // 2 + GIB,
            "t": ENDS[step] - (max(TIMES[step]) - time_s), "skipped": step == 2}


def make_run(run_dir: Path, end=(True, True), monitor=True, n_csv=200):
    run_dir.mkdir(parents=True)
    for rank in (0, 1):
        lines = [ENV] if rank == 0 else []
        lines += [_iter(rank, s) for s in TIMES]
        if end[rank]:
            lines.append({"type": "end", "rank": rank, "status": "complete", "steps": 5})
        (run_dir / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    span = ENDS[5] - T0 + 1.0
    i_peak = round(((ENDS[3] + ENDS[4]) / 2 - T0) / span * (n_csv - 1))  # inside step 4
    with open(run_dir / "memory.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", "rss_tree_bytes", "sys_used_bytes", "gpu0_used_bytes", "gpu0_util_pct",
                    "gpu1_used_bytes", "gpu1_util_pct"])
        for i in range(n_csv):
            t = T0 + span * i / (n_csv - 1)
            peak = i == i_peak
            w.writerow([f"{t:.3f}", (5 if peak else 2) * GIB, 10 * GIB + (3 * GIB if peak else 0),
                        (30 if peak else 20) * GIB, 50.0, 25 * GIB, 70.0])
    if monitor:
        t_peak = T0 + span * i_peak / (n_csv - 1)
        (run_dir / "monitor.json").write_text(json.dumps({
            "samples": n_csv, "hz_achieved": 20.0, "t_start": T0, "t_end": T0 + span,
            "rss_tree_peak_bytes": 5 * GIB, "rss_tree_peak_t": t_peak,
            "sys_used_baseline_bytes": 10 * GIB, "sys_used_minus_baseline_peak_bytes": 3 * GIB,
            "sys_used_peak_t": t_peak, "sys_total_bytes": 64 * GIB, "cpu_count": 16,
            "gpu_used_baseline_bytes": [GIB, GIB], "gpu_used_peak_bytes": [30 * GIB, 25 * GIB],
            "gpu_util_mean_pct": [50.0, 70.0],
            "gpus": [{"index": 0, "name": "NVIDIA A100-SXM4-40GB"}]}))
    return run_dir


def test_aggregates_by_hand(tmp_path):
    train, env, rows = summarize(make_run(tmp_path / "run"), PLAN)
    assert train["status"] == "complete"
    assert train["steps"] == 5 and train["timed_steps"] == 3
    # timed steps 3, 4, 5: slowest rank 2.1, 2.2, 2.4 s; 1900 tokens each
    assert train["tokens_per_s"] == pytest.approx(3 * 1900 / (2.1 + 2.2 + 2.4), abs=0.01)
    assert train["tokens_per_s_per_gpu"] == pytest.approx(3 * 1900 / 6.7 / 2, abs=0.01)
    lat = train["iter_latency_s"]
    assert (lat["median"], lat["min"], lat["max"]) == (2.2, 2.1, 2.4)
    assert lat["p90"] == pytest.approx(2.2 + 0.8 * (2.4 - 2.2))
    assert train["fwd_s"] == pytest.approx(0.25 * 2.2)
    assert train["bwd_s"] == pytest.approx(0.5 * 2.2)
    assert train["opt_s"] == pytest.approx(0.25 * 2.2)
    fpt = flops_per_token(PLAN.model_config, 1024)
    assert train["flops_per_token"] == fpt
    assert train["peak_tflops_per_gpu"] == 312.0
    assert train["mfu"] == pytest.approx(3 * 1900 / 6.7 * fpt / (2 * 312e12), abs=1e-4)
    assert 0.05 < train["mfu"] < 0.07
    vram = train["peak_vram"]
    assert vram["max_allocated_gib"] == 5.0  # rank 1, step 5: 2 * 5 / 2
    assert vram["max_reserved_gib"] == 6.0
    assert vram["nvml_used_gib"] == 30.0 and vram["nvml_used_gib_per_gpu"] == [30.0, 25.0]
    assert vram["per_rank"] == [{"rank": 0, "max_allocated_gib": 2.5, "max_reserved_gib": 3.5},
                                {"rank": 1, "max_allocated_gib": 5.0, "max_reserved_gib": 6.0}]
    dram = train["peak_dram"]
    assert dram["rss_tree_gib"] == 5.0 and dram["sys_used_minus_baseline_gib"] == 3.0
    assert dram["rss_tree_peak_step"] == 4
    assert 0 < dram["rss_tree_peak_t"] < ENDS[5] - T0
    assert train["gpu_util_mean_pct"] == 60.0
    # loss: token-weighted mean over ranks
    assert train["loss"]["first"] == pytest.approx((5.0 * 1000 + 5.2 * 900) / 1900, abs=1e-5)
    assert train["loss"]["last"] == pytest.approx((2.0 * 1000 + 2.2 * 900) / 1900, abs=1e-5)
    assert train["loss"]["min"] == train["loss"]["last"]
    assert train["tokens_seen"] == 5 * 1900
    assert train["padding_fraction"] == pytest.approx(1 - 9500 / 10240, abs=1e-4)
    assert train["skipped_steps"] == 1
    assert train["seq_len"] == 1024 and train["world_size"] == 2
    # env: rank 0's line without bookkeeping keys, plus the sampler's view of the host
    assert env["gpu_name"] == "NVIDIA A100-SXM4-40GB" and "type" not in env and "rank" not in env
    assert env["host_memory_total_gib"] == 64.0 and env["host_cpu_count"] == 16
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["iter_latency_s"] == 10.0 and rows[0]["tokens_per_s"] == 190.0
    assert rows[2]["lr"] == pytest.approx(3e-3)


def test_profiled_steps_are_left_out_of_the_speed_numbers_like_warmup(tmp_path):
    run = make_run(tmp_path / "run")
    for rank in (0, 1):  # step 3 ran under torch.profiler (output.profile_steps)
        f = run / f"rank{rank}.jsonl"
        recs = [json.loads(x) for x in f.read_text().splitlines()]
        recs = [{**r, "profiled": True} if r.get("step") == 3 else r for r in recs]
        f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    train, _, rows = summarize(run, PLAN)
    assert train["steps"] == 5 and train["timed_steps"] == 2
    # timed steps 4, 5: slowest rank 2.2, 2.4 s; 1900 tokens each
    assert train["tokens_per_s"] == pytest.approx(2 * 1900 / (2.2 + 2.4), abs=0.01)
    assert train["iter_latency_s"]["median"] == pytest.approx(2.3)
    assert train["fwd_s"] == pytest.approx(0.25 * 2.3)
    assert [r["timed"] for r in rows] == [False, False, False, True, True]


def test_a_resumed_run_is_timed_on_its_last_session_only(tmp_path):
    """Issue 48: steps 1-3 ran in one session, the run resumed after step 3 and ran 4 and 5 (its
    step 4 warming up again, as the trainer marks it): tokens/s is step 5's alone."""
    run = make_run(tmp_path / "run")
    for rank in (0, 1):
        f = run / f"rank{rank}.jsonl"
        recs = [json.loads(x) for x in f.read_text().splitlines()]
        recs = [{**r, "session": 3, "timed": r["step"] > 4} if r.get("step", 0) > 3 else r
                for r in recs]
        f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    train, _, rows = summarize(run, PLAN)
    assert train["steps"] == 5 and train["timed_steps"] == 1 and train["timed_from_step"] == 3
    assert train["tokens_per_s"] == pytest.approx(1900 / 2.4, abs=0.01)   # step 5 alone
    assert [r["session"] for r in rows] == [0, 0, 0, 3, 3]


def test_truncated_last_line_is_ignored(tmp_path):
    run = make_run(tmp_path / "run")
    with open(run / "rank1.jsonl", "a") as f:
        f.write('{"type": "iter", "rank": 1, "step": 6, "loss": 1.9, "tok')
    train, _, rows = summarize(run, PLAN)
    assert train["status"] == "complete" and train["steps"] == 5
    assert train["tokens_per_s"] == pytest.approx(5700 / 6.7, abs=0.01)


def test_killed_run_is_incomplete_but_measured(tmp_path):
    run = make_run(tmp_path / "run", end=(True, False), monitor=False)
    lines = (run / "rank1.jsonl").read_text().splitlines()
    (run / "rank1.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])  # step 5 cut
    with open(run / "memory.csv", "a") as f:
        f.write("1700000099.5,123")  # the launcher died mid-row
    train, _, rows = summarize(run, PLAN)
    assert train["status"] == "incomplete"
    assert train["steps"] == 4 and train["timed_steps"] == 2  # step 5 only on rank 0
    assert train["tokens_per_s"] == pytest.approx(2 * 1900 / (2.1 + 2.2), abs=0.01)
    # no monitor.json: the peaks come from memory.csv
    assert train["peak_dram"]["rss_tree_gib"] == 5.0
    assert train["peak_dram"]["sys_used_minus_baseline_gib"] == 3.0
    assert train["peak_vram"]["nvml_used_gib"] == 30.0


def test_missing_rank_file_and_empty_run(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "rank1.jsonl").unlink()
    train, _, _ = summarize(run, PLAN)
    assert train["status"] == "incomplete"  # env says world_size 2, rank 1 never reported
    empty = tmp_path / "empty"
    empty.mkdir()
    train, env, rows = summarize(empty, None)
    assert train["status"] == "incomplete" and train["steps"] == 0 and rows == []
    assert train["tokens_per_s"] is None and train["mfu"] is None
    assert train["iter_latency_s"]["median"] is None and train["loss"]["first"] is None
    paths = write_outputs(tmp_path / "metrics", train, env, rows, empty)
    assert all(p.stat().st_size > 0 for p in paths)


def test_cpu_run_has_no_mfu_or_vram(tmp_path):
    run = make_run(tmp_path / "run")
    for rank in (0, 1):
        p = run / f"rank{rank}.jsonl"
        recs = [json.loads(x) for x in p.read_text().splitlines()]
        for r in recs:
            if r["type"] == "env":
                r.update(gpu_name=None, gpu_count=0, precision="fp32")
            if r["type"] == "iter":
                r.update(max_allocated_bytes=None, max_reserved_bytes=None)
        p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    train, _, _ = summarize(run, PLAN)
    assert train["mfu"] is None and train["peak_tflops_per_gpu"] is None
    assert train["flops_per_token"] is not None
    assert train["peak_vram"]["max_allocated_gib"] is None
    assert train["tokens_per_s"] is not None


def test_outputs(tmp_path):
    run = make_run(tmp_path / "run", n_csv=5000)
    train, env, rows = summarize(run, PLAN)
    out = tmp_path / "metrics"
    paths = write_outputs(out, train, env, rows, run)
    assert sorted(p.name for p in paths) == ["env.json", "headline.json", "loss.csv", "memory.csv",
                                             "memory.png", "report.md", "train.json"]
    assert json.loads((out / "train.json").read_text()) == train
    head = json.loads((out / "headline.json").read_text())
    assert list(head) == list(HEADLINE)  # the declared DVC metrics: few, short, nothing run-specific
    assert head["tok_s"] == round(train["tokens_per_s"], 1) and head["status"] == "complete"
    assert head["loss"] == train["loss"]["last"] and head["mfu"] == train["mfu"]
    assert head["vram_gib"] == train["peak_vram"]["max_allocated_gib"]
    assert head["ram_gib"] == train["peak_dram"]["rss_tree_gib"]
    assert json.loads((out / "env.json").read_text())["precision"] == "bf16"
    with open(out / "loss.csv", newline="") as f:
        loss = list(csv.DictReader(f))
    assert list(loss[0]) == ["step", "loss", "lr", "tokens_per_s", "iter_latency_s", "grad_norm",
                             "epoch", "vram_alloc_gib"]
    assert float(loss[0]["vram_alloc_gib"]) > 0  # torch max allocated per step: the run's own VRAM
    assert [int(r["step"]) for r in loss] == [1, 2, 3, 4, 5]
    assert float(loss[3]["iter_latency_s"]) == 2.2
    with open(out / "memory.csv", newline="") as f:
        mem = list(csv.DictReader(f))
    assert list(mem[0]) == ["t_rel_s", "rss_tree_gib", "sys_used_minus_baseline_gib",
                            "gpu0_used_gib", "gpu1_used_gib", "gpu0_util_pct", "gpu1_util_pct"]
    assert len(mem) == 2000  # resampled from 5000 rows, keeping each bin's maximum
    assert max(float(r["rss_tree_gib"]) for r in mem) == 5.0
    assert max(float(r["sys_used_minus_baseline_gib"]) for r in mem) == 3.0
    assert float(mem[0]["t_rel_s"]) == 0.0
    png = (out / "memory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    report = (out / "report.md").read_text()
    assert "tokens/s" in report and "complete" in report and "NVIDIA A100-SXM4-40GB" in report
    assert not list(out.glob(".*.tmp"))


def test_writes_are_atomic(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run")
    train, env, rows = summarize(run, PLAN)
    out = tmp_path / "metrics"
    write_outputs(out, train, env, rows, run)
    before = (out / "train.json").read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_outputs(out, {**train, "status": "incomplete"}, env, rows, run)
    assert (out / "train.json").read_bytes() == before  # old file intact, not half-written
    assert sorted(os.listdir(out)) == sorted(["env.json", "headline.json", "loss.csv", "memory.csv",
                                              "memory.png", "report.md", "train.json"])  # no temps


def _stage(*args, cwd):
    return subprocess.run([sys.executable, str(REPO / "stages" / "metrics.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_stage_entry_point(tmp_path):
    p = _stage("--run", "nope", cwd=tmp_path)
    assert p.returncode == 2 and "nope" in p.stderr and "Traceback" not in p.stderr
    make_run(tmp_path / "runs" / "train")
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "plan.json").write_text(json.dumps(PLAN_DICT))
    p = _stage(cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "tokens/s" in p.stdout and "loss 5.0947 -> 2.0947" in p.stdout
    assert (tmp_path / "metrics" / "train.json").is_file()
    assert (tmp_path / "metrics" / "memory.png").stat().st_size > 0


def test_a_gpu_run_has_the_speed_heuristics_tokens_per_s_beside_its_own(tmp_path):
    """train.json speed_prediction: the plan's Setup at the run's attention length and padding."""
    import dataclasses

    from longft.config.params import from_dict
    from longft.estimate.estimator import Setup, estimate
    from longft.estimate.format import to_dict
    from longft.estimate.speed import tokens_per_second
    from longft.model.architecture import architecture
    from longft.model.loading import load_model_config

    arch = architecture(load_model_config(from_dict({"model": {"source": "random",
                                                               "name": "llama3.2-1b"}}).model))
    setup = Setup(micro_batch=1, seq_len=1024, world_size=2, ranks_per_node=2,
                  checkpointing="cpu_offload", offload_optimizer=True)
    d = plan_dict(model_config=arch)
    d["memory_estimate"]["estimate"] = json.loads(json.dumps(to_dict(estimate(arch, setup))))
    plan = Plan.from_dict(d)
    run = make_run(tmp_path / "run")

    def edit(**env):
        for rank in (0, 1):
            p = run / f"rank{rank}.jsonl"
            recs = [json.loads(x) for x in p.read_text().splitlines()]
            for r in recs:
                if r["type"] == "env":
                    r.update(env)
                if r["type"] == "iter":  # packed rows: documents of 256 tokens on average
                    r.update(doc_sq_tokens=256 * r["tokens"])
            p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    edit()
    train, _, _ = summarize(run, plan)
    assert train["attention_length"] == 256.0
    speed = train["speed_prediction"]
    want = tokens_per_second(arch, dataclasses.replace(
        setup, attention_length=256.0, padding=train["padding_fraction"]), ENV["gpu_name"])
    assert speed["predicted_tok_s"] == pytest.approx(want, abs=0.1)
    assert speed["measured_tok_s"] == train["tokens_per_s"]
    assert speed["rel_error"] == pytest.approx((want - train["tokens_per_s"]) / train["tokens_per_s"],
                                               abs=1e-4)
    assert speed["predicted_tok_s"] > speed["whole_row_tok_s"]  # attention per document is less
    edit(gpu_name=None, gpu_count=0)  # the same run on the CPU: no GPU to predict for
    assert "speed_prediction" not in summarize(run, plan)[0]
