"""Raw per-rank measurements (runs/train) -> DVC metrics, plots and a short report.

Inputs, written by the train stage:
  rank{r}.jsonl  one JSON object a line: {"type": "iter", ...} per optimizer step, one "end",
                 on rank 0 one "env", an "eval" per held-out evaluation (metrics/eval.py turns
                 them into eval_loss, eval_ppl, retrieval_accuracy, eval.csv and retrieval.png).
                 A line that does not parse (killed mid-write) is skipped (metrics/rank_logs.py).
  memory.csv     the HostSampler timeline of the launcher's process tree.
  monitor.json   HostSampler.summary().

Aggregation (warm-up steps, `timed: false`, and steps run under the profiler, `profiled: true`
(output.profile_steps), are left out of every speed number):
  step latency   max over ranks of time_s (the slowest rank sets the pace); fwd/bwd/opt likewise.
  tokens_per_s   sum over timed steps and ranks of non-padding tokens / sum over timed steps of
                 the step latency. Steps skipped for fp16 overflow still count: they cost time.
  loss           per step, the token-weighted mean over ranks.
  grad_norm      per step, DeepSpeed's global gradient norm before clipping (first, last, max).
  epochs         passes over the prepared rows made by the last step (the "epoch" of its record).
  mfu            tokens_per_s x flops_per_token(model_config, seq_len) / (world_size x dense peak
                 FLOPS of gpu_name at the run's precision); null when the GPU is unknown or CPU.
                 With LoRA the FLOPs are LoRA's own (no gradients of the frozen weights).
  gpu_util_mean_pct  NVML utilisation (memory.csv) averaged over the samples taken during the
                 timed steps and over the GPUs; model load and set-up are left out.
  status         "complete" only when every rank wrote {"type": "end", "status": "complete"}.
                 Otherwise "incomplete" (not a valid result), with the numbers of the steps done;
                 end_status says why: "interrupted" (stop_signal SIGINT/SIGTERM: stopped after a
                 step, checkpoint written, resumable), "failed", or null (killed; no end record).

Outputs: metrics/headline.json is DVC's declared metric: the few numbers runs are compared by
(HEADLINE, short keys so that `dvc exp show` stays narrow); train.json and env.json are the detail
(every number above, the environment), plain outputs, not metrics: nothing run-specific (ports,
times, paths) reaches `dvc metrics diff` or `dvc exp show`.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import statistics
from pathlib import Path
from typing import Any, Optional

from longft.atomic import write_bytes
from longft.config.plan import Plan, PlanFileError
from longft.estimate.flops import flops_per_token, mfu, peak_flops
from longft.measure.monitor import util_over_windows
from longft.metrics.eval import eval_metrics, eval_outputs, eval_records
from longft.metrics.plots import gib_timeline, memory_png, read_timeline, render_report, timeline_peaks
from longft.metrics.predicted import predictions
from longft.metrics.rank_logs import RankLog, read_json, read_ranks

log = logging.getLogger(__name__)
GIB = 1024**3
LOSS_COLUMNS = ("step", "loss", "lr", "tokens_per_s", "iter_latency_s", "grad_norm", "epoch",
                "vram_alloc_gib")
"""metrics/loss.csv, one row per step; vram_alloc_gib: torch max allocated of the busiest rank
(empty on CPU)."""


def _num(x: Any) -> Optional[float]:
    """A finite number, or None (missing, null, NaN, inf, bool, text)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _r(x: Optional[float], nd: int) -> Optional[float]:
    return None if x is None else round(x, nd)


def _gib(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x / GIB, 3)


def _max(values) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _step_rows(ranks: dict[int, RankLog]) -> list[dict]:
    """One row per step that every rank reported, combined over ranks."""
    if not ranks:
        return []
    logs = list(ranks.values())
    common = set(logs[0].iters).intersection(*(set(r.iters) for r in logs[1:]))
    rows = []
    for s in sorted(common):
        recs = [r.iters[s] for r in logs]
        times = [_num(x.get("time_s")) for x in recs]
        tokens = [_num(x.get("tokens")) or 0.0 for x in recs]
        latency = None if None in times else max(times)
        pairs = [(_num(x.get("loss")), w) for x, w in zip(recs, tokens)]
        pairs = [(v, w) for v, w in pairs if v is not None]
        wsum = sum(w for _, w in pairs)
        loss = (sum(v * w for v, w in pairs) / wsum if wsum > 0
                else statistics.fmean(v for v, _ in pairs) if pairs else None)
        phases = {}
        for k in ("fwd_s", "bwd_s", "opt_s"):
            vals = [_num(x.get(k)) for x in recs]
            phases[k] = None if None in vals else max(vals)
        rows.append({
            "step": s, "loss": loss, "lr": _num(recs[0].get("lr")),
            # the global norm (every rank logs the same), before clipping; passes over the data
            "grad_norm": _num(recs[0].get("grad_norm")), "epoch": _num(recs[0].get("epoch")),
            "tokens_per_s": sum(tokens) / latency if latency else None,
            "iter_latency_s": latency, "tokens": sum(tokens),
            "seq_tokens": sum(_num(x.get("seq_tokens")) or 0.0 for x in recs),
            # sum of L_i^2 over the step's documents (real tokens); None in runs before it was logged
            "doc_sq_tokens": None if any(x.get("doc_sq_tokens") is None for x in recs)
            else sum(_num(x.get("doc_sq_tokens")) or 0.0 for x in recs),
            # warm-up and profiled steps (the profiler's overhead) are not timed
            "timed": all(x.get("timed") is True and x.get("profiled") is not True for x in recs),
            "session": int(_num(recs[0].get("session")) or 0),  # the step a resumed session began after
            "skipped": any(x.get("skipped") is True for x in recs),
            "t": _max(_num(x.get("t")) for x in recs), **phases,
            "vram_alloc_gib": _gib(_max(_num(x.get("max_allocated_bytes")) for x in recs)),
        })
    return rows


def attention_length(timed: list[dict], seq_len) -> Optional[float]:
    """The S of the FLOPs formula (estimate/flops.py) for these steps: causal attention costs
    sum(L_i^2) / 2 pairs per row, so per real token S = sum(L_i^2) / sum(L_i) over the documents
    (the row length for one full document a row; less for packed rows, which are then neither
    flattered nor penalised). Runs that did not log document lengths fall back to seq_len."""
    sq = [r["doc_sq_tokens"] for r in timed]
    tokens = sum(r["tokens"] for r in timed)
    if sq and None not in sq and tokens > 0:
        return sum(sq) / tokens
    return float(seq_len) if seq_len else None


def _peak_step(rows: list[dict], t_peak: Optional[float]) -> Optional[int]:
    """The step during which t_peak fell; 0 = before step 1 (model load, engine setup)."""
    if t_peak is None or not rows or rows[0]["t"] is None or rows[0]["iter_latency_s"] is None:
        return None
    if t_peak < rows[0]["t"] - rows[0]["iter_latency_s"]:
        return 0
    for row in rows:
        if row["t"] is not None and t_peak <= row["t"]:
            return row["step"]
    return None


def _monitor(run_dir: Path) -> dict:
    """monitor.json, or the same peaks recomputed from memory.csv when the launcher died first."""
    mon = read_json(run_dir / "monitor.json")
    return mon if mon else timeline_peaks(*read_timeline(run_dir / "memory.csv"))


def _peak_vram(ranks: dict[int, RankLog], mon: dict) -> dict:
    """torch peaks per rank (null on CPU) and the NVML device-used peak per GPU."""
    per_rank = []
    for r, rl in ranks.items():
        alloc = _max(_num(x.get("max_allocated_bytes")) for x in rl.iters.values())
        reserved = _max(_num(x.get("max_reserved_bytes")) for x in rl.iters.values())
        per_rank.append({"rank": r, "max_allocated_gib": _gib(alloc),
                         "max_reserved_gib": _gib(reserved)})
    nvml = [_num(x) for x in mon.get("gpu_used_peak_bytes") or []]
    return {"max_allocated_gib": _max(p["max_allocated_gib"] for p in per_rank),
            "max_reserved_gib": _max(p["max_reserved_gib"] for p in per_rank),
            "nvml_used_gib": _gib(_max(nvml)),
            "nvml_used_gib_per_gpu": [_gib(x) for x in nvml],
            "per_rank": per_rank}


def _peak_dram(mon: dict, rows: list[dict]) -> dict:
    """Process-tree RSS peak (when: seconds since sampler start, and step) and system used."""
    t0, rss_t = _num(mon.get("t_start")), _num(mon.get("rss_tree_peak_t"))
    return {"rss_tree_gib": _gib(_num(mon.get("rss_tree_peak_bytes"))),
            "rss_tree_peak_t": None if rss_t is None or t0 is None else _r(rss_t - t0, 2),
            "rss_tree_peak_step": _peak_step(rows, rss_t),
            "sys_used_minus_baseline_gib":
                _gib(_num(mon.get("sys_used_minus_baseline_peak_bytes")))}


def _timed_util(run_dir: Path, timed: list[dict]) -> list[Optional[float]]:
    """Per GPU, the mean NVML utilisation of the samples taken during the timed steps (from a step's
    end minus its latency to its end), not of the whole run (model load, set-up, checkpoint)."""
    windows = [(r["t"] - r["iter_latency_s"], r["t"]) for r in timed if r["t"] is not None]
    if not windows:
        return []
    header, rows = read_timeline(run_dir / "memory.csv")
    return util_over_windows(header, rows, windows)


def summarize(run_dir: Path, plan: Plan | None) -> tuple[dict, dict, list[dict]]:
    """(train metrics, environment, per-step loss rows) of a run directory; never raises on
    partial or missing files: what is unknown is null and status is "incomplete" (no plan: no
    FLOPs per token, MFU or memory prediction)."""
    run_dir = Path(run_dir)
    ranks = read_ranks(run_dir)
    env_rec = next((r.env for r in ranks.values() if r.env), None) or {}
    mon = _monitor(run_dir)
    world_size = int(_num(env_rec.get("world_size")) or len(ranks)) or None
    complete = bool(ranks) and world_size is not None and all(
        r in ranks and ranks[r].end is not None and ranks[r].end.get("status") == "complete"
        for r in range(world_size))

    rows = _step_rows(ranks)
    # timing from the last session only: a resumed run never mixes two sessions' throughput
    last = max((r["session"] for r in rows), default=0)
    timed = [r for r in rows if r["timed"] and r["session"] == last
             and r["iter_latency_s"] is not None]
    lat = [r["iter_latency_s"] for r in timed]
    time_sum = sum(lat)
    tokens_per_s = sum(r["tokens"] for r in timed) / time_sum if time_sum > 0 else None

    def median_of(key):
        vals = [r[key] for r in timed if r[key] is not None]
        return _r(statistics.median(vals), 4) if vals else None

    seq_len = env_rec.get("seq_len")
    attn_len = attention_length(timed, seq_len)
    fpt = None
    if plan is not None and attn_len:
        try:
            lora = plan.model.n_trainable if env_rec.get("lora_rank") else None
            fpt = flops_per_token(plan.model_config, attn_len, lora_params=lora)
        except (TypeError, ValueError) as e:
            log.warning("no FLOPs per token: %s", e)
    peak = peak_flops(env_rec.get("gpu_name"), env_rec.get("precision") or "")
    n_gpus = world_size if env_rec.get("gpu_name") else None
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    norms = [r["grad_norm"] for r in rows if r["grad_norm"] is not None]
    util = [u for u in _timed_util(run_dir, timed) if u is not None]
    all_tokens = sum(_num(x.get("tokens")) or 0.0
                     for rl in ranks.values() for x in rl.iters.values())
    all_seq = sum(r["seq_tokens"] for r in rows)

    ends = [r.end for r in ranks.values() if r.end is not None]
    # Why it is incomplete: "interrupted" (SIGINT/SIGTERM, checkpoint written), "failed", or null
    # (no end record: killed, or still running).
    end_status = "complete" if complete else next(
        (e.get("status") for s in ("interrupted", "failed") for e in ends if e.get("status") == s),
        None)
    train = {
        "status": "complete" if complete else "incomplete",
        "end_status": end_status,
        "stop_signal": next((e.get("signal") for e in ends if e.get("status") == "interrupted"),
                            None),
        "steps": len(rows),
        "timed_steps": len(timed),
        "timed_from_step": last,  # > 0: a resumed run, timed on the steps after it resumed
        "tokens_per_s": _r(tokens_per_s, 2),
        "tokens_per_s_per_gpu": _r(tokens_per_s / world_size, 2)
        if tokens_per_s is not None and world_size else None,
        "iter_latency_s": {
            "median": _r(statistics.median(lat), 4) if lat else None,
            "min": _r(min(lat), 4) if lat else None,
            "max": _r(max(lat), 4) if lat else None,
            "p90": _r(_percentile(lat, 90), 4) if lat else None},
        "fwd_s": median_of("fwd_s"), "bwd_s": median_of("bwd_s"), "opt_s": median_of("opt_s"),
        "mfu": _r(mfu(tokens_per_s, fpt, n_gpus or 0, peak), 4),
        "flops_per_token": fpt,
        "attention_length": _r(attn_len, 1),
        "peak_tflops_per_gpu": _r(peak / 1e12, 2) if peak else None,
        "peak_vram": _peak_vram(ranks, mon),
        "peak_dram": _peak_dram(mon, rows),
        "gpu_util_mean_pct": _r(statistics.fmean(util), 1) if util else None,
        "loss": {"first": _r(losses[0], 5) if losses else None,
                 "last": _r(losses[-1], 5) if losses else None,
                 "min": _r(min(losses), 5) if losses else None},
        "grad_norm": {"first": _r(norms[0], 5) if norms else None,
                      "last": _r(norms[-1], 5) if norms else None,
                      "max": _r(max(norms), 5) if norms else None},
        # passes over the prepared rows after the last step (fractional; null before it was logged)
        "epochs": _r(rows[-1]["epoch"], 4) if rows and rows[-1]["epoch"] is not None else None,
        "tokens_seen": int(all_tokens),
        "padding_fraction": _r(1 - sum(r["tokens"] for r in rows) / all_seq, 4)
        if all_seq > 0 else None,
        "skipped_steps": sum(r["skipped"] for r in rows),
        "seq_len": seq_len,
        "world_size": world_size,
    }
    env = {k: v for k, v in env_rec.items() if k not in ("type", "rank")}
    if mon:
        env["gpus"] = mon.get("gpus", [])
        env["host_memory_total_gib"] = _gib(_num(mon.get("sys_total_bytes")))
        env["host_cpu_count"] = mon.get("cpu_count")
        env["host_cpu"] = mon.get("cpu_model")  # a CPU run's speed depends on it
    train.update(eval_metrics(eval_records(ranks)))  # held-out quality next to the cost
    train.update(predictions(plan, env_rec.get("gpu_name"), train, mon))  # memory, speed, disk
    return train, env, rows


# -- outputs -----------------------------------------------------------------------------------

HEADLINE = {
    "status": "complete | incomplete",
    "tok_s": "tokens/s, non-padding, all GPUs, warm-up excluded (train.json tokens_per_s)",
    "mfu": "model FLOPs utilisation, 0..1 (null on CPU or an unknown GPU)",
    "vram_gib": "peak VRAM, torch max allocated on the busiest GPU (null on CPU)",
    "ram_gib": "peak host RAM, RSS of the run's process tree",
    "loss": "training loss of the last step",
    "eval_loss": "held-out eval loss after the last step",
    "retrieval": "held-out retrieval score (synthetic task, teacher-forced citation), 0..1",
    "epochs": "passes over the prepared rows",
}
"""metrics/headline.json: key -> meaning. DVC drops null values, so a column a run cannot measure
(VRAM on CPU) is absent rather than "-"."""


def headline(train: dict) -> dict:
    """The declared DVC metrics of a run (HEADLINE) from its train.json."""
    return {"status": train.get("status"),
            "tok_s": _r(train.get("tokens_per_s"), 1),
            "mfu": train.get("mfu"),
            "vram_gib": (train.get("peak_vram") or {}).get("max_allocated_gib"),
            "ram_gib": (train.get("peak_dram") or {}).get("rss_tree_gib"),
            "loss": (train.get("loss") or {}).get("last"),
            "eval_loss": train.get("eval_loss"),
            "retrieval": train.get("retrieval_accuracy"),
            "epochs": train.get("epochs")}


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _csv_text(header, rows) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    for row in rows:
        w.writerow(["" if v is None else round(v, 6) if isinstance(v, float) else v for v in row])
    return buf.getvalue()


def write_outputs(metrics_dir: Path, train: dict, env: dict, loss_rows: list[dict],
                  run_dir: Path) -> list[Path]:
    """Write headline.json, train.json, env.json, loss.csv, memory.csv, memory.png and report.md
    (each atomically; all of them always, so DVC finds every declared output)."""
    metrics_dir, run_dir = Path(metrics_dir), Path(run_dir)
    mon = _monitor(run_dir)
    header, raw = read_timeline(run_dir / "memory.csv")
    mem_header, mem_rows = gib_timeline(header, raw, _num(mon.get("t_start")),
                                        _num(mon.get("sys_used_baseline_bytes")))
    if not mem_header:
        mem_header = ["t_rel_s", "rss_tree_gib", "sys_used_minus_baseline_gib"]
    t0 = _num(mon.get("t_start")) or (raw[0][0] if raw else None)
    marks = [(r["t"] - t0, r["timed"]) for r in loss_rows if r["t"] is not None and t0 is not None]
    title = f"{env.get('model_name', '?')}  seq {train.get('seq_len')}  x{train.get('world_size')}"
    if env.get("gpu_name"):
        title += f"  {env['gpu_name']}"

    out = {
        "headline.json": json.dumps(_json_safe(headline(train)), indent=2, allow_nan=False) + "\n",
        "train.json": json.dumps(_json_safe(train), indent=2, allow_nan=False) + "\n",
        "env.json": json.dumps(_json_safe(env), indent=2, allow_nan=False, default=str) + "\n",
        "loss.csv": _csv_text(LOSS_COLUMNS, [[r.get(c) for c in LOSS_COLUMNS] for r in loss_rows]),
        "memory.csv": _csv_text(mem_header, mem_rows),
        "memory.png": memory_png(mem_header, mem_rows, marks, title),
        "report.md": render_report(train, env),
    }
    paths = []
    for name, data in out.items():
        write_bytes(metrics_dir / name, data)
        paths.append(metrics_dir / name)
    return paths


def load_plan(path: Path) -> tuple[Plan | None, str | None]:
    """artifacts/plan.json (FLOPs per token, the memory prediction); (None, why) when unusable."""
    try:
        return Plan.read(path), None
    except PlanFileError as e:
        return None, "; ".join(e.problems)


def write_run_metrics(run_dir: Path, plan: Plan | None, out: Path) -> dict:
    """Summarize the ranks' logs in run_dir and write the metrics outputs to out; returns train."""
    train, env, rows = summarize(run_dir, plan)
    write_outputs(out, train, env, rows, run_dir)
    # eval.csv and retrieval.png: written also for a run without evals (declared DVC outputs)
    for name, data in eval_outputs(eval_records(read_ranks(Path(run_dir))), train, env).items():
        write_bytes(Path(out) / name, data)
    return train
