"""Per-step curves a user can watch while a run goes on: rank 0 logs loss, lr, grad_norm,
tokens/s and epoch after every optimizer step with dvclive into runs/train/live (and, with
output.tensorboard, as TensorBoard events into runs/train/tensorboard).

dvclive is used as a plain logger, with no DVC or git side effects inside a `dvc repro` / `dvc exp
run` stage: `save_dvc_exp=False` (no experiment of its own), `dvcyaml=None` (it writes no dvc.yaml:
the project's dvc.yaml declares runs/train/live/plots/metrics as a top-level plot, so `dvc plots
show` renders it during the run), `report=None`; and its directory lies inside the train stage's
output runs/train, so at the end of a `dvc exp run` its untracked-file check finds nothing to
`git add`. Each metric is a `plots/metrics/<name>.tsv` (step, value) appended per step.

On resume (the run continues after checkpoint step N), rows past step N are cut from every .tsv
(the steps the killed run logged after its checkpoint are re-run) before dvclive appends to them,
and TensorBoard's `purge_step` drops the same steps from its events.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import os
from pathlib import Path

from longft.atomic import write_text
from longft.errors import UserError

LIVE_DIR = "live"
TENSORBOARD_DIR = "tensorboard"
METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "epoch")
"""The per-step series, in runs/train/live/plots/metrics/<name>.tsv and TensorBoard's train/<name>."""


class LiveError(UserError, RuntimeError):
    """The live logging that params ask for cannot run here."""


def check_available(tensorboard: bool) -> None:
    """Before any model work: the packages the live logs need (tensorboard only when asked)."""
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise LiveError("output.tensorboard is true but the tensorboard package is not installed; "
                        "`pip install tensorboard` (or `pip install -e '.[test]'`), or set "
                        "output.tensorboard: false (dvclive's runs/train/live has the same curves)")


def cut_after(metrics_dir: Path, step: int) -> None:
    """Keep only the rows of steps <= `step` in every .tsv under metrics_dir (atomically)."""
    if not metrics_dir.is_dir():
        return
    for path in sorted(metrics_dir.rglob("*.tsv")):
        text = path.read_text()
        rows = list(csv.reader(io.StringIO(text), delimiter="\t"))
        if not rows or "step" not in rows[0]:
            continue
        col = rows[0].index("step")
        kept = [rows[0]] + [r for r in rows[1:] if len(r) > col and r[col].isdigit()
                            and int(r[col]) <= step]
        buf = io.StringIO()
        csv.writer(buf, delimiter="\t", lineterminator=os.linesep).writerows(kept)
        write_text(path, buf.getvalue())


class LiveMetrics:
    """Rank 0's live per-step logs; `log(step, values)` after each step, `close()` at the end.
    On other ranks (enabled=False) every call does nothing."""

    def __init__(self, run_dir: Path, resume_step: int = 0, tensorboard: bool = False,
                 enabled: bool = True):
        self.live = self.tb = None
        if not enabled:
            return
        try:
            from dvclive import Live
        except ImportError:   # a bare GPU image without DVC: train on, without the live plots
            print("longft: dvclive is not installed: no live per-step plots (pip install dvclive)",
                  flush=True)
            return
        live_dir = Path(run_dir) / LIVE_DIR
        if resume_step:
            cut_after(live_dir / "plots" / "metrics", resume_step)
        self.live = Live(dir=str(live_dir), resume=resume_step > 0, report=None,
                         save_dvc_exp=False, dvcyaml=None)
        if tensorboard:
            check_available(True)
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR),
                                    purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, values: dict) -> None:
        """The finite numbers among `values` (names of METRICS) as step `step`."""
        if self.live is None:
            return
        self.live.step = step
        for name in METRICS:
            v = values.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
                self.live.log_metric(name, float(v))
                if self.tb is not None:
                    self.tb.add_scalar(f"train/{name}", float(v), step)
        self.live.make_summary()  # metrics.json: the latest values (and the step), every step
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.live is not None:
            self.live.end()
            self.live = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
