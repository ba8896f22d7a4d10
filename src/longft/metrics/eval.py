"""Quality next to cost: the held-out evals of a run (the "eval" records of runs/train, written by
engine/evaluate.py) -> train.json's eval and retrieval numbers, metrics/eval.csv (the eval curve,
a DVC plot) and metrics/retrieval.png.

train.json gets:
  eval_loss, eval_ppl     the last eval (after the last step): token-weighted cross-entropy over
                          the held-out split's trained tokens, and exp of it;
  eval                    {step, evals, best_loss, best_step, samples, tokens}: best = lowest loss;
  retrieval_accuracy      the last eval's teacher-forced citation accuracy (synthetic task: the
                          share of held-out samples whose "[doc N]" number the model predicts,
                          every token, from the reference answer before it); null without a
                          synthetic held-out split;
  value_accuracy          the same for the asked value's tokens;
  retrieval               {method, scored_samples, chance (mean 1 / documents), by_length and
                          by_position: {bin: {accuracy, samples, chance}}}: context length in
                          power-of-two bins of tokens, and the cited document's relative position
                          among the documents (0 = first, 1 = last) in quarters.
All of them null (or empty) for a run without a held-out split, so `dvc metrics diff` still lines
runs up.
"""

from __future__ import annotations

import csv
import io
import math
from typing import Optional

METHOD = "teacher_forced_citation"
EVAL_COLUMNS = ("step", "eval_loss", "eval_ppl", "retrieval_accuracy", "value_accuracy")
POSITION_BINS = ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0))


def _finite(x) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def eval_records(ranks: dict) -> list[dict]:
    """The evals of the lowest rank that logged any (every rank logs the same all-reduced
    numbers), by step; a step evaluated twice (resume) keeps its last record."""
    for rl in ranks.values():
        evals = getattr(rl, "evals", None)
        if evals:
            return [evals[s] for s in sorted(evals)]
    return []


def length_bin(n: int) -> str:
    """The power-of-two bin of a context length in tokens, "lo-hi" with n in (hi/2, hi]."""
    hi = 1 << max(0, (int(n) - 1).bit_length())
    return "1" if hi == 1 else f"{hi // 2 + 1}-{hi}"


def position_bin(p: float) -> str:
    for lo, hi in POSITION_BINS:
        if p < hi or hi == 1.0:
            return f"{lo:g}-{hi:g}"
    raise AssertionError("unreachable")


def _bins(keys: list[str], correct: list[int], chance: list[float], order: list[str]) -> dict:
    out = {}
    for k in order:
        idx = [i for i, key in enumerate(keys) if key == k]
        if idx:
            out[k] = {"accuracy": round(sum(correct[i] for i in idx) / len(idx), 4),
                      "samples": len(idx),
                      "chance": round(sum(chance[i] for i in idx) / len(idx), 4)}
    return out


def retrieval_bins(rec: dict | None) -> dict:
    """train.json's "retrieval" entry from one eval record (see the module docstring)."""
    r = (rec or {}).get("retrieval") or {}
    correct, lengths = list(r.get("cite_correct") or []), list(r.get("length") or [])
    positions, docs = list(r.get("position") or []), list(r.get("num_docs") or [])
    n = len(correct)
    if not n or not (len(lengths) == len(positions) == len(docs) == n):
        return {"method": METHOD, "scored_samples": 0, "chance": None, "by_length": {},
                "by_position": {}}
    chance = [1 / max(1, d) for d in docs]
    lkeys = [length_bin(x) for x in lengths]
    lorder = sorted(set(lkeys), key=lambda k: int(k.split("-")[-1]))
    pkeys = [position_bin(p) for p in positions]
    porder = [f"{lo:g}-{hi:g}" for lo, hi in POSITION_BINS]
    return {"method": METHOD, "scored_samples": n,
            "chance": round(sum(chance) / n, 4),
            "by_length": _bins(lkeys, correct, chance, lorder),
            "by_position": _bins(pkeys, correct, chance, porder)}


def eval_metrics(evals: list[dict]) -> dict:
    """The keys train.json gets from a run's eval records (null when there are none)."""
    last = evals[-1] if evals else {}
    scored = [(e["step"], _finite(e.get("loss"))) for e in evals]
    scored = [(s, v) for s, v in scored if v is not None]
    best = min(scored, key=lambda sv: sv[1]) if scored else (None, None)
    loss = _finite(last.get("loss"))
    return {
        "eval_loss": None if loss is None else round(loss, 5),
        "eval_ppl": None if _finite(last.get("ppl")) is None else round(last["ppl"], 4),
        "eval": {"step": last.get("step"), "evals": len(evals),
                 "best_loss": None if best[1] is None else round(best[1], 5),
                 "best_step": best[0], "samples": last.get("samples"),
                 "tokens": last.get("tokens")},
        "retrieval_accuracy": None if _finite(last.get("retrieval_accuracy")) is None
        else round(last["retrieval_accuracy"], 4),
        "value_accuracy": None if _finite(last.get("value_accuracy")) is None
        else round(last["value_accuracy"], 4),
        "retrieval": retrieval_bins(last),
    }


def eval_csv_rows(evals: list[dict]) -> list[list]:
    """metrics/eval.csv rows (EVAL_COLUMNS), one per eval."""
    return [[e.get("step"), _finite(e.get("loss")), _finite(e.get("ppl")),
             _finite(e.get("retrieval_accuracy")), _finite(e.get("value_accuracy"))]
            for e in evals]


def _bar_panel(ax, bins: dict, xlabel: str) -> None:
    keys = list(bins)
    xs = range(len(keys))
    acc = [bins[k]["accuracy"] for k in keys]
    ax.bar(xs, acc, color="tab:blue", alpha=0.8, label="cited the right document")
    ax.step([x - 0.5 for x in xs] + [len(keys) - 0.5], [bins[k]["chance"] for k in keys]
            + [bins[keys[-1]]["chance"]], where="post", color="tab:red", lw=1.2,
            label="chance (1 / documents)")
    for x, k in zip(xs, keys):
        ax.text(x, acc[x] + 0.02, f"n={bins[k]['samples']}", ha="center", fontsize=8)
    ax.set_xticks(list(xs), keys, fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3, axis="y")


def retrieval_png(metrics: dict, title: str = "") -> bytes:
    """Accuracy against context length (left) and the cited document's position (right), with
    chance and the samples per bar; a PNG that says so when there is no retrieval score."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    r = metrics.get("retrieval") or {}
    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2)
    if r.get("scored_samples"):
        _bar_panel(axes[0], r["by_length"], "context length (tokens)")
        _bar_panel(axes[1], r["by_position"], "cited document's position (0 = first, 1 = last)")
        axes[0].legend(loc="upper left", fontsize=8)
        head = (f"retrieval (teacher-forced citation) {metrics['retrieval_accuracy']:.1%} of "
                f"{r['scored_samples']} held-out samples at step {metrics['eval']['step']}; "
                f"chance {r['chance']:.1%}")
    else:
        for ax in axes:
            ax.set_axis_off()
        axes[0].text(0.5, 0.5, "no retrieval score (no synthetic held-out split)",
                     ha="center", va="center", transform=axes[0].transAxes)
        head = ""
    fig.suptitle("  ".join(x for x in (title, head) if x), fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def eval_outputs(evals: list[dict], train: dict, env: dict) -> dict[str, str | bytes]:
    """{file name: content} of metrics/eval.csv and metrics/retrieval.png."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(EVAL_COLUMNS)
    for row in eval_csv_rows(evals):
        w.writerow(["" if v is None else round(v, 6) if isinstance(v, float) else v for v in row])
    title = f"{env.get('model_name', '?')}  seq {train.get('seq_len')}"
    return {"eval.csv": buf.getvalue(), "retrieval.png": retrieval_png(train, title)}
