"""The PNG of one sweep grid (metrics/grid_report.py prepares the data): throughput, peak VRAM,
peak DRAM, GPU utilisation and the step split (fwd/bwd/opt seconds) against the grid's x, one
line per series, the legend in the sixth panel. matplotlib's Figure, no pyplot."""

from __future__ import annotations

import io
from typing import Optional

PANELS = (("tok_s", "throughput (token/s)"), ("vram", "peak VRAM (GiB, torch max allocated)"),
          ("dram", "peak DRAM (GiB, process tree RSS)"),
          ("util", "GPU utilisation, timed steps (%)"))
PHASES = (("fwd", "-", "o"), ("bwd", "--", "s"), ("opt", ":", "^"))
"""Step-split panel: metric key, line style, marker."""
Series = dict[str, list[tuple[float, dict[str, Optional[float]]]]]
"""Label -> (x position, {"tok_s", "vram", "dram", "util", "fwd", "bwd", "opt"}) in x order."""


def _axis(ax, scale: str, ticks: list[tuple[float, str]], xlabel: str) -> None:
    if scale == "log2":
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    if ticks:
        ax.set_xticks([t for t, _ in ticks], [s for _, s in ticks],
                      rotation=30 if scale == "category" and len(ticks) > 4 else 0,
                      ha="right" if scale == "category" and len(ticks) > 4 else "center")
    if scale == "category" and ticks:
        ax.set_xlim(-0.5, len(ticks) - 0.5)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if not ax.lines:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _line(ax, pts, key: str, **style) -> None:
    pts = [(x, m[key]) for x, m in pts if m.get(key) is not None]
    if pts:
        ax.plot([x for x, _ in pts], [y for _, y in pts], lw=1.2, **{"marker": "o", **style})


def png(title: str, xlabel: str, scale: str, ticks: list[tuple[float, str]],
        series: Series) -> bytes:
    """`scale`: "linear", "log2" or "category" (x positions 0, 1, ... labelled by `ticks`)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg for PNG
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(14, 8), dpi=100, layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    colors = {label: f"C{i % 10}" for i, label in enumerate(series)}
    for ax, (key, ylabel) in zip(axes, PANELS):
        for label, pts in series.items():
            _line(ax, pts, key, color=colors[label], label=label)
        ax.set_ylabel(ylabel)
        _axis(ax, scale, ticks, xlabel)
    split = axes[len(PANELS)]
    for label, pts in series.items():
        for key, style, marker in PHASES:
            _line(split, pts, key, color=colors[label], ls=style, marker=marker)
    split.set_ylabel("median step time (s)")
    _axis(split, scale, ticks, xlabel)
    legend = axes[-1]
    legend.axis("off")
    first = {}
    for h in (h for ax in axes[:len(PANELS)] for h in ax.lines):
        first.setdefault(h.get_label(), h)
    if split.lines:  # the step split's styles, in grey
        for key, style, marker in PHASES:
            first[f"step split: {key}"] = Line2D([], [], color="grey", ls=style, marker=marker)
    if first:
        legend.legend(list(first.values()), list(first), loc="center", fontsize=8)
    fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
