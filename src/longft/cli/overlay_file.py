"""A `longft placement` overlay, printed or written to a file with a header of what it predicts
(`longft placement` and its advice when nothing fits both write them), and the one line that runs
a written one as a DVC experiment (`run_line`)."""

from __future__ import annotations

import shlex
from pathlib import Path

from longft.estimate.estimator import GIB, describe
from longft.estimate.placement import Candidate, near_budget


def run_line(path: str | Path) -> str:
    """The command that runs an overlay file as a DVC experiment named after it, merged onto the
    committed ./params.yaml, in a temporary copy (run/sweep.py: `dvc exp run --temp -S ...`)."""
    return f"longft sweep {shlex.quote(str(path))} --temp"


def write_overlay(out: str | None, ov: dict, c: Candidate, *, gpu_mem: float, host_mem: float,
                  title: str = "longft placement", quiet: bool = False) -> None:
    """Print the overlay, or write it to `out` with a header of what it predicts (and say so
    unless `quiet`)."""
    import yaml

    warn = "".join(f"# warning: {w}\n" for w in near_budget(c, gpu_mem, host_mem))
    head = (f"# {title}: {describe(c.setup)}\n"
            f"# predicted: VRAM {c.est.gpu_allocated / GIB:.2f} GiB allocated, "
            f"{c.est.gpu_nvml / GIB:.2f} GiB NVML; host {c.est.host_rss / GIB:.2f} GiB; "
            f"~{c.tokens_per_s:,.0f} tok/s\n" + warn)
    text = yaml.safe_dump(ov, sort_keys=False)
    if out:
        from longft.atomic import write_text

        write_text(Path(out), head + text)
        if not quiet:
            print(f"\nwrote {out}; run it as a DVC experiment: {run_line(out)}")
    else:
        print("\n" + head + text)
