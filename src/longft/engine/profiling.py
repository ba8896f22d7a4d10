"""output.profile_steps: torch.profiler over the N optimizer steps right after the warm-up
(train.warmup_iterations + 1 .. + N) on every rank, written to the run directory:
  profile/rank{r}.trace.json.gz  the Chrome trace (https://ui.perfetto.dev opens it)
  profile/rank{r}.split.json     the time split per profiled step and summed (measure/time_split.py)
While the steps are profiled, the inner optimizer's step and, where DeepSpeed's ZeRO optimizer has
them, its gradient clipping and its copy of the updated weights run inside ranges of their own
(`longft.update`, `longft.clip`, `longft.copy_back`); the wrappers are removed after the last.
Rank 0 prints the summed split as a table. The profiled steps train as every other step; their
"iter" records carry "profiled": true (the metrics stage leaves them out of its speed numbers).
"""

from __future__ import annotations

import gzip
import json
from contextlib import contextmanager
from pathlib import Path

from longft.atomic import write_json
from longft.config.params import Config
from longft.measure import time_split


def steps(cfg: Config, start: int) -> range:
    """The steps to profile: warmup+1 .. warmup+profile_steps, those after `start` (a resumed run)
    and at most train.iterations (worked out from train.epochs, which the params check cannot
    see; explicit iterations are checked there)."""
    first = cfg.train.warmup_iterations + 1
    last = min(first + cfg.output.profile_steps - 1, cfg.train.iterations)
    return range(max(first, start + 1), last + 1) if cfg.output.profile_steps else range(0)


def update_optimizer(engine):
    """The optimizer whose step is the parameter update: under ZeRO (and DeepSpeed's bf16/fp16
    wrappers) the basic optimizer inside DeepSpeed's (CPU Adam with offload), else DeepSpeed's."""
    return getattr(engine.optimizer, "optimizer", None) or engine.optimizer


class StepProfiler:
    """torch.profiler over `steps` (a range of step numbers; empty: off). The loop runs each step
    inside `around(step)`; the profiler starts with the first and is exported after the last."""

    def __init__(self, run_dir: Path, rank: int, steps: range, cuda: bool, optimizer=None, zero=None):
        self.dir, self.rank, self.steps, self.cuda = Path(run_dir) / "profile", rank, steps, cuda
        self.optimizer, self.zero = optimizer, zero
        self._prof = None
        self._restore = None

    @classmethod
    def of(cls, cfg: Config, run_dir: Path, rank: int, start: int, cuda: bool, engine):
        """The profiler of output.profile_steps for a run that resumed after `start`, timing the
        update of `engine`'s inner optimizer; rank 0 says when fewer steps are profiled."""
        todo = steps(cfg, start)
        if rank == 0:
            _say_fewer(cfg, start, todo)
        if todo:  # an earlier run's files must not pass for this one's
            for old in (Path(run_dir) / "profile").glob(f"rank{rank}.*"):
                old.unlink()
        return cls(run_dir, rank, todo, cuda, update_optimizer(engine) if todo else None,
                   getattr(engine, "optimizer", None) if todo else None)

    def marks(self, step: int) -> dict:
        """What the step's "iter" record carries: {"profiled": True} for a profiled step."""
        return {"profiled": True} if step in self.steps else {}

    @contextmanager
    def around(self, step: int):
        """Runs one step, profiled (inside a `longft.step` range) when it is one of `steps`."""
        if step not in self.steps:
            yield
            return
        from torch.profiler import record_function

        if self._prof is None:
            self._start()
        with record_function(time_split.STEP):
            yield
        if step == self.steps[-1]:
            self._finish()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=acts)
        undo = [_time_method(self.optimizer, "step", "update")] if self.optimizer is not None else []
        if self.zero is not None and self.zero is not self.optimizer:
            undo += [_time_method(self.zero, attr, phase) for attr, phase in ZERO_METHODS
                     if callable(getattr(self.zero, attr, None))]

        def restore():
            for u in reversed(undo):
                u()
        self._restore = restore
        self._prof.start()

    def close(self) -> None:
        """Stops the profiler and unwraps the optimizer (a run that ended before the last
        profiled step writes no profile)."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
        if self._restore is not None:
            self._restore()
            self._restore = None

    def _finish(self) -> None:
        prof = self._prof
        self.close()
        try:
            self._write(prof)
        except Exception as e:  # the profile is a by-product: the run goes on without it
            print(f"longft: rank {self.rank}: the profile could not be written ({type(e).__name__}: "
                  f"{e}); training goes on", flush=True)

    def _write(self, prof) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"rank{self.rank}.trace.json.gz"
        prof.export_chrome_trace(str(trace))  # torch gzips a path ending in .gz
        with gzip.open(trace, "rt") as f:
            events = json.load(f)["traceEvents"]
        name = type(self.optimizer).__name__ if self.optimizer is not None else None
        split = {"rank": self.rank, "optimizer": name, "trace": trace.name,
                 **time_split.split(events, list(self.steps))}
        write_json(self.dir / f"rank{self.rank}.split.json", split)
        if self.rank == 0:
            print(f"longft: {time_split.table(split, name or '-')}\nlongft: profile of rank 0 in "
                  f"{trace} (open it in https://ui.perfetto.dev); split in "
                  f"{self.dir / 'rank0.split.json'}", flush=True)


def _say_fewer(cfg: Config, start: int, todo: range) -> None:
    """A note when the run profiles fewer than output.profile_steps steps, and why."""
    w, n, it = cfg.train.warmup_iterations, cfg.output.profile_steps, cfg.train.iterations
    if n and not todo and start > w:
        print(f"longft: output.profile_steps {n}: no step profiled, the run resumed after step "
              f"{start}, past the profiled steps {w + 1}..{w + n}; set output.resume: false (or "
              f"remove the checkpoints) to profile them", flush=True)
    elif n and not todo:
        print(f"longft: output.profile_steps {n}: no step profiled, the run has {it} steps, all "
              f"within train.warmup_iterations {w}", flush=True)
    elif n and len(todo) < n:
        print(f"longft: output.profile_steps {n}: steps {todo[0]}..{todo[-1]} profiled (the run has "
              f"{it} steps{'' if start <= w else f' and resumed after step {start}'})", flush=True)


ZERO_METHODS = (("unscale_and_clip_grads", "clip"),
                ("_reassign_or_swap_out_partitioned_parameters", "copy_back"))
"""DeepSpeed ZeRO optimizer methods timed in profiled steps, and their phase (measure/time_split.py);
a method the optimizer lacks (ZeRO-2 has no copy back of its own) is left out."""


def _time_method(obj, attr: str, phase: str):
    """Wraps obj.<attr> in the `longft.<phase>` range; returns what undoes it (an attribute of the
    instance itself, such as engine/param_copy_back.py's, is put back; else the class's shows)."""
    from torch.profiler import record_function

    had, inner = attr in vars(obj), getattr(obj, attr)

    def timed(*args, **kwargs):
        with record_function(time_split.RANGE[phase]):
            return inner(*args, **kwargs)

    setattr(obj, attr, timed)

    def restore():
        if had:
            setattr(obj, attr, inner)
        else:
            delattr(obj, attr)
    return restore


OFF = StepProfiler(Path(), 0, range(0), False)
"""Profiles no step (output.profile_steps 0, and a Session before train() sets its own)."""
