"""`longft report`: the reference study's results table (Setup | Model | Context Length | Peak VRAM
(MiB) | Peak DRAM (GiB) | Throughput (token/s) | Batch Size), with the data a run trained on (Data)
and the run's quality beside its cost (LR | LoRA Rank | Eval Loss | Retrieval (%)), over many runs,
plus PNG plots of throughput and peak memory against context length and against GPU count.

    longft report                                    # workspace, HEAD and its experiments
    longft report -A --out results.md --plots plots  # every commit and its experiments
    longft report --names                            # plus a Run column (experiment name)
    longft report --exp-json exp.json                # a saved `dvc exp show --json`
    longft report --from-json bench/results          # scripts/bench.py results (no DVC there)
    longft report --benchmarks bench/results         # BENCHMARKS.md's current results table
    longft report --from-json bench/results --grid bench/grids/q1.yaml --plots plots
                                                     # one grid's findings (metrics/grid_report.py)

Runs come from `dvc exp show --json` (params.yaml of each revision; its detail files
metrics/train.json and metrics/env.json, outputs committed with the run, read from git at that
revision, or from the exp-show metrics of runs made before metrics/headline.json was the declared
metric) or from bench result files ({"params", "train", "env"}). A run
is left out, with a note line under the table, when it is queued, running or failed, has no
metrics, did not complete, or has metrics that belong to other params (a stale workspace, say).
DVC drops null metrics (peak VRAM on CPU, say), so a missing value reads as unknown.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from longft.atomic import write_text
from longft.config.params import Config, ConfigError, from_dict, sections_changed
from longft.config.sections import GENERATED_SOURCES
from longft.metrics.run_sources import Run, exp_show, runs_from_bench, runs_from_exp_show

COLUMNS = ("Setup", "Model", "Data", "Context Length", "Peak VRAM (MiB)", "Peak DRAM (GiB)",
           "Throughput (token/s)", "Batch Size", "LR", "LoRA Rank", "Eval Loss", "Retrieval (%)")
NUMERIC = 9
"""The last NUMERIC columns (Context Length on) are right-aligned."""
DEFINITIONS = ("Data: data.source, or the file or dataset of data.path (eval losses on different "
               "data do not compare). Peak VRAM: torch max allocated on the busiest GPU. Peak "
               "DRAM: RSS of the whole "
               "process tree (launcher and ranks). Throughput: non-padding tokens per second over "
               "all GPUs, warm-up steps excluded. Batch Size: sequences per optimizer step. "
               "LR: optim.lr; LoRA Rank: 0 = full-parameter. Eval Loss: held-out loss after the "
               "last step. Retrieval: held-out citation accuracy on the synthetic task.")
PLOT_FILES = ("by_context_length.png", "by_gpu_count.png")


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    n_params: Optional[float]
    device: str
    """GPU name without the vendor ("H200"), or "CPU"."""
    gpus: int
    """World size: processes over all nodes."""
    mode: str
    """ZeRO stage, offload, LoRA or block-sparse and a quantized base, e.g. "ZeRO-3 offload
    opt+param", "ZeRO-2 offload opt LoRA r16 on nf4"."""
    seq_len: int
    vram_gib: Optional[float]
    dram_gib: Optional[float]
    tokens_per_s: Optional[float]
    global_batch: int
    micro_batch: int
    accum: int
    lr: Optional[float] = None
    lora_rank: int = 0
    eval_loss: Optional[float] = None
    retrieval: Optional[float] = None
    """Held-out citation accuracy, 0..1 (None: no synthetic held-out split)."""
    data: str = ""
    """What it trained on, in short (`data_label`): "synthetic", "mydata/train.jsonl"."""

    @property
    def setup(self) -> str:
        return f"{self.gpus}x{self.device} {self.mode}"


# -- runs -> rows ------------------------------------------------------------------------------

def _num(x: Any) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _device(gpu_name: Any) -> str:
    if not isinstance(gpu_name, str) or not gpu_name:
        return "CPU"
    for prefix in ("NVIDIA ", "Tesla "):
        gpu_name = gpu_name.removeprefix(prefix)
    return gpu_name


def _mode(cfg: Config) -> str:
    z = cfg.zero
    offload = [k for k, v in (("opt", z.offload_optimizer), ("param", z.offload_param))
               if v != "none"]
    out = f"ZeRO-{z.stage} " + (f"offload {'+'.join(offload)}" if offload else "no offload")
    if cfg.lora.rank > 0:
        out += f" LoRA r{cfg.lora.rank}"
    elif cfg.sparse.blocks:
        out += f" block-sparse {cfg.sparse.blocks}x{cfg.sparse.block_size}^2"
    else:
        return out
    q = cfg.lora.quantize  # the frozen base of the adapters or blocks (QLoRA: nf4)
    return out + (f" on {q}" if q != "none" else "")


DATA_LABEL_CHARS = 32
"""A data.path longer than this is shown by its last part alone."""


def data_label(cfg: Config) -> str:
    """The data of a run in a few characters: data.source for generated data, else data.path as
    written (its last part when long; an HF dataset's non-train split after a colon)."""
    d = cfg.data
    if d.source in GENERATED_SOURCES:
        return d.source
    path = str(d.path)
    if len(path) > DATA_LABEL_CHARS:
        path = ".../" + Path(path.rstrip("/")).name
    if d.source == "hf":
        return f"hf {path}" + (f":{d.split}" if d.split != "train" else "")
    return path


def _stale(cfg: Config, train: dict, env: dict) -> list[str]:
    """Where the metrics disagree with the params (metrics left from another configuration)."""
    expect = [(train, "seq_len", cfg.data.max_seq_length), (train, "world_size", cfg.world_size),
              (env, "micro_batch_size", cfg.train.micro_batch_size),
              (env, "global_batch_size", cfg.train.global_batch_size),
              (env, "model_name", cfg.model.name), (env, "zero_stage", cfg.zero.stage),
              (env, "offload_optimizer", cfg.zero.offload_optimizer),
              (env, "offload_param", cfg.zero.offload_param), (env, "lora_rank", cfg.lora.rank)]
    out = [f"{key} {src[key]} in metrics, {want} in params" for src, key, want in expect
           if key in src and src[key] != want]
    changed = sections_changed(env.get("params_digests"), cfg)
    if changed and not out:   # the knobs above name what; otherwise which sections
        out.append(f"params section(s) {', '.join(changed)} changed since these metrics were "
                   f"measured (`dvc repro` measures them)")
    return out


def to_row(run: Run) -> Row | str:
    """The table row of a run, or why it is left out."""
    if run.train.get("status") != "complete":
        return f"incomplete run (status {run.train.get('status', 'unknown')})"
    try:
        cfg = from_dict(run.params)
    except ConfigError as e:
        return f"params do not validate ({len(e.problems)} problem(s), first: {e.problems[0]})"
    stale = _stale(cfg, run.train, run.env)
    if stale:
        return "metrics are from other params (" + "; ".join(stale) + ")"
    return Row(name=run.name, model=cfg.model.name, n_params=_num(run.env.get("n_params")),
               device=_device(run.env.get("gpu_name")), gpus=cfg.world_size, mode=_mode(cfg),
               seq_len=cfg.data.max_seq_length, data=data_label(cfg),
               vram_gib=_num((run.train.get("peak_vram") or {}).get("max_allocated_gib")),
               dram_gib=_num((run.train.get("peak_dram") or {}).get("rss_tree_gib")),
               tokens_per_s=_num(run.train.get("tokens_per_s")),
               global_batch=cfg.train.global_batch_size, micro_batch=cfg.train.micro_batch_size,
               accum=cfg.grad_accum_steps, lr=cfg.optim.lr, lora_rank=cfg.lora.rank,
               eval_loss=_num(run.train.get("eval_loss")),
               retrieval=_num(run.train.get("retrieval_accuracy")))


def build_rows(runs: list[Run]) -> tuple[list[Row], list[str]]:
    """Rows sorted by model size, setup, GPU count and context length; notes for the rest."""
    rows, notes = [], []
    for run in runs:
        got = to_row(run)
        if isinstance(got, Row):
            rows.append(got)
        else:
            notes.append(f"{run.name}: {got}")
    rows.sort(key=lambda r: (r.n_params or 0, r.model, r.device, r.mode, r.gpus, r.seq_len, r.data))
    return rows, notes


# -- outputs -----------------------------------------------------------------------------------

def _fmt(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _batch(r: Row) -> str:
    if r.gpus == 1 and r.accum == 1:
        return str(r.global_batch)
    return f"{r.global_batch} ({r.micro_batch}/GPU" + (f" x {r.accum} accum)" if r.accum > 1
                                                      else ")")


def render_table(rows: list[Row], notes: list[str], source: str = "",
                 names: bool | None = False) -> str:
    """Markdown: the table (with a leading Run column when `names`; None: when two rows would
    otherwise read the same setup, model, data and context), what the columns mean, and one line
    per run left out."""
    if names is None:
        names = len({(r.setup, r.model, r.data, r.seq_len) for r in rows}) < len(rows)
    head = (("Run",) if names else ()) + COLUMNS
    lines = ["| " + " | ".join(head) + " |",
             "|" + "---|" * (len(head) - NUMERIC) + "---:|" * NUMERIC]
    for r in rows:
        cells = ((r.name,) if names else ()) + (
            r.setup, r.model, r.data, str(r.seq_len),
            _fmt(None if r.vram_gib is None else r.vram_gib * 1024, ",.0f"),
            _fmt(r.dram_gib, ".1f"), _fmt(r.tokens_per_s, ",.0f"), _batch(r),
            _fmt(r.lr, "g"), str(r.lora_rank), _fmt(r.eval_loss, ".4f"),
            _fmt(None if r.retrieval is None else 100 * r.retrieval, ".1f"))
        lines.append("| " + " | ".join(cells) + " |")
    if not rows:
        lines.append("| no complete runs |" + " |" * (len(head) - 1))
    lines += ["", DEFINITIONS + (f" Source: {source}." if source else "")]
    if notes:
        lines += [""] + [f"- left out: {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _series(rows: list[Row], key, x) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return {k: sorted(v, key=x) for k, v in groups.items()}


def _figure(rows: list[Row], key, x, xlabel: str, log2_x: bool) -> bytes:
    """Throughput, peak VRAM and peak DRAM (three panels) against x, one line per series."""
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg for PNG

    fig = Figure(figsize=(13, 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    panels = (("throughput (token/s)", lambda r: r.tokens_per_s),
              ("peak VRAM (GiB, torch max allocated)", lambda r: r.vram_gib),
              ("peak DRAM (GiB, process tree RSS)", lambda r: r.dram_gib))
    groups = _series(rows, key, x)
    for ax, (ylabel, y) in zip(axes, panels):
        for label, pts in groups.items():
            pts = [p for p in pts if y(p) is not None]
            if pts:
                ax.plot([x(p) for p in pts], [y(p) for p in pts], marker="o", lw=1.2, label=label)
        xs = sorted({x(r) for r in rows})
        if log2_x and xs:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{v // 1024}K" if v % 1024 == 0 else str(v) for v in xs])
            ax.minorticks_off()
        elif xs:
            ax.set_xticks(xs)
        ax.set_ylim(bottom=0)
        if not ax.lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if any(ax.lines for ax in axes):
        handles, labels = next(ax for ax in axes if ax.lines).get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", fontsize=8,
                   ncols=min(3, len(labels)))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_plots(rows: list[Row], out_dir: Path) -> list[Path]:
    """by_context_length.png (one line per model and setup) and by_gpu_count.png (one line per
    model, context length and setup without the GPU count)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figs = {
        PLOT_FILES[0]: _figure(rows, lambda r: f"{r.model} {r.setup}", lambda r: r.seq_len,
                               "context length (tokens)", log2_x=True),
        PLOT_FILES[1]: _figure(rows, lambda r: f"{r.model} {r.seq_len} {r.device} {r.mode}",
                               lambda r: r.gpus, "GPUs", log2_x=False),
    }
    paths = []
    for name, data in figs.items():
        (out_dir / name).write_bytes(data)
        paths.append(out_dir / name)
    return paths


# -- command line ------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from-json", metavar="DIR", type=Path,
                     help="read bench result files DIR/*.json instead of DVC experiments")
    src.add_argument("--exp-json", metavar="FILE", type=Path,
                     help="read a saved `dvc exp show --json` output instead of running it")
    src.add_argument("--benchmarks", metavar="DIR", type=Path,
                     help="BENCHMARKS.md's current results table from the bench results in DIR"
                          " (metrics/results_table.py)")
    p.add_argument("-A", "--all-commits", action="store_true",
                   help="every commit and its experiments (dvc exp show -A)")
    p.add_argument("--names", action="store_true", help="add a Run column (experiment name); added anyway when two "
                   "rows share setup, model, data and context")
    p.add_argument("--out", metavar="FILE", type=Path, help="write the markdown here, not stdout")
    p.add_argument("--plots", metavar="DIR", type=Path,
                   help="write " + " and ".join(PLOT_FILES) + " here (with --grid: GRID_STEM.png)")
    p.add_argument("--grid", metavar="GRID", type=Path, action="append",
                   help="with --from-json: the findings table (and plot) of this sweep grid's rows,"
                        " DIR/<row name>.json; repeat for several grids (metrics/grid_report.py)")


def main(args: argparse.Namespace) -> int:
    """The runs table (and plots); `longft report` hands --benchmarks and --grid to
    metrics/results_table.py and metrics/grid_report.py instead (cli/main.py)."""
    try:
        if args.from_json:
            if not args.from_json.is_dir():
                print(f"longft report: {args.from_json} is not a folder", file=sys.stderr)
                return 2
            runs, notes = runs_from_bench(args.from_json)
            source = f"bench results in {args.from_json}"
        else:
            records = (json.loads(args.exp_json.read_text()) if args.exp_json
                       else exp_show(args.all_commits))
            runs, notes = runs_from_exp_show(records)
            source = f"{args.exp_json}" if args.exp_json else "dvc exp show"
    except (OSError, RuntimeError, json.JSONDecodeError) as e:
        print(f"longft report: {e}", file=sys.stderr)
        return 1
    rows, more = build_rows(runs)
    text = render_table(rows, notes + more, source, names=args.names or None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text(args.out, text)  # a reader never sees half a table
        print(f"longft report: {len(rows)} row(s) -> {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.plots:
        for path in write_plots(rows, args.plots):
            print(f"longft report: {path}", file=sys.stderr)
    return 0
