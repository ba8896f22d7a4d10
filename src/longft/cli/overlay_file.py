"""A `longft placement` overlay, printed or written to a file with a header of what it predicts
(`longft placement` and its advice when nothing fits both write them), and the one line that runs
a written one as a DVC experiment (`run_line`) with the experiment's name (`experiment_of`)."""

from __future__ import annotations

import shlex
from pathlib import Path

from longft.estimate.estimator import GIB, describe
from longft.estimate.placement import Candidate, near_budget


def run_line(path: str | Path) -> str:
    """The command that runs an overlay file as a DVC experiment (named after the file and a hash
    of its params, `experiment_of`), merged onto ./params.yaml, in a temporary copy (run/sweep.py:
    `dvc exp run --temp -S ...`)."""
    return f"longft sweep {shlex.quote(str(path))} --temp"


def experiment_of(path: str | Path) -> str:
    """The experiment name `run_line` gives a written overlay file (the name `longft sweep` makes
    of the file's name and params)."""
    from longft.config.grid import parse_grid, read_raw
    from longft.run.sweep_names import overlay_experiment

    rows, _ = parse_grid(read_raw(Path(path)))
    return overlay_experiment(Path(path), rows[0].overrides)


def batch_target(params_batch: int | None, world: int) -> tuple[int | None, str | None]:
    """The global batch the search keeps (None: none, micro-batch x GPUs, as without params) and
    a note where it is not the params' own: their train.global_batch_size, or where that is no
    multiple of the GPUs, the nearest multiple (the smaller on a tie)."""
    if params_batch is None or params_batch % world == 0:
        return params_batch, None
    low = params_batch // world * world
    b = low if low and params_batch - low <= low + world - params_batch else low + world
    return b, (f"global batch changed from {params_batch} to {b}: the params' "
               f"train.global_batch_size {params_batch} is not a multiple of {world} GPU(s), "
               f"{b} is the nearest; set another in the params to compare at it")


def batch_changed(ov: dict, s, params_batch: int | None) -> str | None:
    """"global batch changed from A to B" where the overlay sets another global batch than the
    params' (runs at other global batches differ in more than their placement); None where not.
    `s` is the candidate's Setup: its GPUs over all nodes and its accumulation."""
    t = ov["train"]
    if params_batch is None or t["global_batch_size"] == params_batch:
        return None
    return (f"global batch changed from {params_batch} to {t['global_batch_size']} "
            f"(train.global_batch_size: micro-batch {t['micro_batch_size']} x {s.world_size} GPU(s) x "
            f"{s.grad_accum} accumulation step(s))")


def write_overlay(out: str | None, ov: dict, c: Candidate, *, gpu_mem: float, host_mem: float,
                  title: str = "longft placement", quiet: bool = False,
                  params_batch: int | None = None) -> None:
    """Print the overlay, or write it to `out` with a header of what it predicts, and a note where
    it changes the params' global batch (`params_batch`) (and say so unless `quiet`)."""
    import yaml

    changed = batch_changed(ov, c.setup, params_batch)
    warn = "".join(f"# warning: {w}\n" for w in near_budget(c, gpu_mem, host_mem))
    warn += f"# note: {changed}\n" if changed else ""
    head = (f"# {title}: {describe(c.setup)}\n"
            f"# predicted: VRAM {c.est.gpu_allocated / GIB:.2f} GiB allocated, "
            f"{c.est.gpu_nvml / GIB:.2f} GiB NVML; host {c.est.host_rss / GIB:.2f} GiB; "
            f"~{c.tokens_per_s:,.0f} tok/s\n" + warn)
    text = yaml.safe_dump(ov, sort_keys=False)
    if out:
        from longft.atomic import write_text

        write_text(Path(out), head + text)
        if not quiet:
            print(f"\nwrote {out}; run it as a DVC experiment ({experiment_of(out)}): "
                  f"{run_line(out)}")
    else:
        print("\n" + head + text)
