"""What a person looks at: the memory timeline (CSV for DVC plots, PNG) and report.md.

Input is the HostSampler CSV (t, rss_tree_bytes, sys_used_bytes, gpu{i}_used_bytes,
gpu{i}_util_pct); a row cut short by a killed run, or any row that does not parse, is skipped.
Output rows are (t_rel_s, rss_tree_gib, sys_used_minus_baseline_gib, gpu{i}_used_gib,
gpu{i}_util_pct); the PNG draws each GPU's utilisation on the VRAM panel (right axis, %).
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Optional

GIB = 1024**3
MAX_ROWS = 2000
"""A 10-hour run at 20 Hz is 720k samples; DVC plots and a PNG need ~2000. Each output row keeps
the *maximum* of its bin, so peaks survive resampling."""


def read_timeline(path: Path) -> tuple[list[str], list[list[Optional[float]]]]:
    """Header and rows (floats, None for an empty cell) of a sampler CSV; ([], []) if missing."""
    if not path.is_file():
        return [], []
    with open(path, newline="", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        if not header or header[0] != "t":
            return [], []
        rows = []
        for raw in reader:
            if len(raw) != len(header):
                continue
            try:
                row = [float(x) if x != "" else None for x in raw]
            except ValueError:
                continue
            if row[0] is None or not all(v is None or math.isfinite(v) for v in row):
                continue
            rows.append(row)
    return header, rows


def timeline_peaks(header: list[str], rows: list[list[Optional[float]]]) -> dict:
    """The HostSampler.summary() peaks recomputed from its CSV ({} without rows), for a run whose
    launcher died before it wrote monitor.json."""
    if not rows:
        return {}
    col = {c: i for i, c in enumerate(header)}
    rss_i, sys_i = col["rss_tree_bytes"], col["sys_used_bytes"]
    rss_peak = max(rows, key=lambda r: r[rss_i] or 0)
    sys_peak = max(rows, key=lambda r: r[sys_i] or 0)
    base = rows[0][sys_i]
    gpu_peaks = []
    for c in header:
        if c.startswith("gpu") and c.endswith("_used_bytes"):
            vals = [r[col[c]] for r in rows if r[col[c]] is not None]
            gpu_peaks.append(max(vals) if vals else None)
    return {"t_start": rows[0][0], "samples": len(rows), "sys_used_baseline_bytes": base,
            "rss_tree_peak_bytes": rss_peak[rss_i], "rss_tree_peak_t": rss_peak[0],
            "sys_used_minus_baseline_peak_bytes":
                None if base is None or sys_peak[sys_i] is None else sys_peak[sys_i] - base,
            "sys_used_peak_t": sys_peak[0], "gpu_used_peak_bytes": gpu_peaks}


def gib_timeline(header: list[str], rows: list[list[Optional[float]]], t0: Optional[float],
                 sys_baseline: Optional[float], max_rows: int = MAX_ROWS
                 ) -> tuple[list[str], list[list[Optional[float]]]]:
    """Convert to seconds since t0 and GiB (system used minus baseline), max-resampled."""
    if not rows:
        return [], []
    col = {name: i for i, name in enumerate(header)}
    gpu_cols = [c for c in header if c.startswith("gpu") and c.endswith("_used_bytes")]
    util_cols = [c for c in header if c.startswith("gpu") and c.endswith("_util_pct")]
    t0 = rows[0][0] if t0 is None else t0
    base = rows[0][col["sys_used_bytes"]] if sys_baseline is None else sys_baseline
    out_header = ["t_rel_s", "rss_tree_gib", "sys_used_minus_baseline_gib"]
    out_header += [c.replace("_used_bytes", "_used_gib") for c in gpu_cols]
    out_header += util_cols

    def convert(r):
        sys_used = r[col["sys_used_bytes"]]
        vals = [r[col["rss_tree_bytes"]],
                None if sys_used is None or base is None else sys_used - base]
        vals += [r[col[c]] for c in gpu_cols]
        return ([r[0] - t0] + [None if v is None else v / GIB for v in vals]
                + [r[col[c]] for c in util_cols])

    conv = [convert(r) for r in rows]
    if len(conv) <= max_rows:
        return out_header, conv
    out = []
    for b in range(max_rows):
        lo, hi = b * len(conv) // max_rows, (b + 1) * len(conv) // max_rows
        chunk = conv[lo:hi]
        row = [chunk[0][0]]
        for j in range(1, len(out_header)):
            vals = [r[j] for r in chunk if r[j] is not None]
            if out_header[j].endswith("_util_pct"):  # a rate: the bin's mean, not its peak
                row.append(sum(vals) / len(vals) if vals else None)
            else:
                row.append(max(vals) if vals else None)
        out.append(row)
    return out_header, out


def memory_png(header: list[str], rows: list[list[Optional[float]]],
               iter_marks: list[tuple[float, bool]], title: str = "") -> bytes:
    """PNG of VRAM (top, per GPU) and DRAM (bottom) over time, a vertical line per iteration end
    (solid: timed, dotted: warm-up). Empty data still gives a PNG that says so."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    gpu_cols = [j for j, c in enumerate(header) if c.startswith("gpu") and c.endswith("_used_gib")]
    util_cols = [j for j, c in enumerate(header) if c.startswith("gpu") and c.endswith("_util_pct")]
    fig = Figure(figsize=(10, 6.5 if gpu_cols else 4), dpi=100, layout="constrained")
    axes = fig.subplots(2 if gpu_cols else 1, 1, sharex=True, squeeze=False)[:, 0]
    t = [r[0] for r in rows]

    def series(j):
        return [math.nan if r[j] is None else r[j] for r in rows]

    if gpu_cols:
        ax = axes[0]
        for j in gpu_cols:
            ax.plot(t, series(j), lw=1.2, label=header[j].replace("_used_gib", " used (NVML)"))
        ax.set_ylabel("VRAM (GiB)")
        ax.legend(loc="upper left", fontsize=8)
        if util_cols:  # utilisation beside the memory it works on: set-up shows as idle
            twin = ax.twinx()
            for j in util_cols:
                twin.plot(t, series(j), lw=0.8, ls="--", alpha=0.7,
                          label=header[j].replace("_util_pct", " utilisation (NVML)"))
            twin.set_ylabel("GPU utilisation (%)")
            twin.set_ylim(0, 105)
            twin.legend(loc="upper right", fontsize=8)
    ax = axes[-1]
    if rows:
        ax.plot(t, series(1), lw=1.2, label="RSS of process tree")
        ax.plot(t, series(2), lw=1.2, label="system used - baseline")
        if iter_marks:
            ax.plot([], [], color="0.6", lw=0.6, label="step end (dotted: warm-up)")
        ax.legend(loc="upper left", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no memory timeline recorded", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylabel("DRAM (GiB)")
    ax.set_xlabel("time since sampler start (s)")
    for a in axes:
        for x, timed in iter_marks:
            a.axvline(x, color="0.6", lw=0.6, ls="-" if timed else ":", zorder=0)
        a.grid(alpha=0.3)
    if title:
        axes[0].set_title(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _fmt(x, unit: str = "", nd: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{nd}f}{unit}"


def _eval_row(train: dict) -> str:
    """The report's eval line: loss, perplexity, best step and the retrieval score."""
    ev, r = train.get("eval") or {}, train.get("retrieval") or {}
    if train.get("eval_loss") is None:
        return "n/a (no held-out split: data.eval_samples 0 or data.source random)"
    text = (f"loss {_fmt(train['eval_loss'], '', 4)}, ppl {_fmt(train.get('eval_ppl'), '', 2)} at "
            f"step {ev.get('step')} (best {_fmt(ev.get('best_loss'), '', 4)} at step "
            f"{ev.get('best_step')}; {ev.get('evals')} evals)")
    if train.get("retrieval_accuracy") is not None:
        text += (f"; retrieval (teacher-forced citation) {100 * train['retrieval_accuracy']:.1f} % "
                 f"of {r.get('scored_samples')} (chance {100 * (r.get('chance') or 0):.1f} %; "
                 f"metrics/retrieval.png)")
    return text


def render_report(train: dict, env: dict) -> str:
    """A short markdown summary of one run."""
    lat, vram, dram, loss = (train["iter_latency_s"], train["peak_vram"], train["peak_dram"],
                             train["loss"])
    n_params = env.get("n_params")
    model = f"{env.get('model_name', '?')} ({env.get('model_source', '?')}"
    if isinstance(n_params, (int, float)):
        model += f", {n_params / 1e9:.2f} B params)" if n_params >= 1e8 else \
            f", {n_params / 1e6:.2f} M params)"
    else:
        model += ")"
    device = f"{train.get('world_size')} x {env.get('gpu_name') or 'CPU'}"
    setup = ", ".join(f"{k} {env[k]}" for k in ("precision", "attention", "checkpointing",
                                                  "liger", "zero_stage", "offload_optimizer",
                                                  "offload_param") if k in env)
    if train["mfu"] is not None:
        mfu = f"{100 * train['mfu']:.1f} % of {train['peak_tflops_per_gpu']} TFLOPS per GPU"
    else:
        mfu = "n/a (no dense peak FLOPS known for this device and precision)"
    step = dram.get("rss_tree_peak_step")
    when = ("" if dram.get("rss_tree_peak_t") is None else f" at {dram['rss_tree_peak_t']} s"
            + ("" if step is None else " (setup)" if step == 0 else f" (step {step})"))
    rows = [
        ("status", f"{train['status']}: {train['steps']} steps, {train['timed_steps']} timed"
                   f" (warm-up excluded), {train['skipped_steps']} skipped"),
        ("model", model),
        ("device", device),
        ("setup", setup or "n/a"),
        ("sequence length", str(train.get("seq_len"))),
        ("tokens/s", f"{_fmt(train['tokens_per_s'], nd=1)}"
                     f" ({_fmt(train['tokens_per_s_per_gpu'], nd=1)}"
                     f" per {'GPU' if env.get('gpu_name') else 'rank'}; non-padding)"),
        ("iteration latency", f"median {_fmt(lat['median'], ' s', 3)}"
                              f" (min {_fmt(lat['min'], '', 3)}, p90 {_fmt(lat['p90'], '', 3)},"
                              f" max {_fmt(lat['max'], '', 3)})"),
        ("fwd / bwd / opt (median)", " / ".join(_fmt(train[k], " s", 3)
                                                for k in ("fwd_s", "bwd_s", "opt_s"))),
        ("MFU", mfu),
        ("peak VRAM", f"allocated {_fmt(vram['max_allocated_gib'], ' GiB')}, reserved"
                      f" {_fmt(vram['max_reserved_gib'], ' GiB')}, NVML used"
                      f" {_fmt(vram['nvml_used_gib'], ' GiB')}"),
        ("peak DRAM", f"process tree RSS {_fmt(dram['rss_tree_gib'], ' GiB')}{when}; system used"
                      f" +{_fmt(dram['sys_used_minus_baseline_gib'], ' GiB')} over baseline"),
        ("loss", f"{_fmt(loss['first'], '', 4)} -> {_fmt(loss['last'], '', 4)}"
                 f" (min {_fmt(loss['min'], '', 4)})"),
        ("tokens seen", f"{train['tokens_seen']:,}"),
        ("held-out eval", _eval_row(train)),
    ]
    lines = ["# longft run", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "Numbers: metrics/train.json; environment: metrics/env.json; memory over time:"
                  " metrics/memory.png.", ""]
    return "\n".join(lines)
