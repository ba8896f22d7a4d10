"""A graceful stop on SIGINT (Ctrl-C) and SIGTERM (`kill`, schedulers): finish the current step,
write a checkpoint and the end of the measurements, exit non-zero. During an evaluation (periodic
or the final one, evaluate.py) the ranks ask after every held-out micro-batch and end it there;
after the last step the final checkpoint and the export are then skipped (a re-run resumes the
last step's checkpoint and does them). A signal during the final checkpoint or the export lets
them finish, then the run exits 130/143 all the same.

On each rank, `StopRequest` (worker.py) turns the first signal into a flag. After every step the
training loop asks `agreed()`: an all-reduce (MAX) of the signal number, so every rank stops after
the same step even when only one was signalled. It then writes checkpoints/step-<N>, an "end"
record with status "interrupted", and raises `Stopped`. The rank exits with 128 + the signal
number: 130 for SIGINT, 143 for SIGTERM.

A second signal is a force-quit: the default handlers come back and KeyboardInterrupt is raised
(no checkpoint; a third signal kills outright). Signals within `repeat_s` of the first count as the
same request: a launcher or a scheduler passing on a signal the rank already got.

In the train stage's process, `Relay` (launch.launch_ranks) passes the stage's SIGINT/SIGTERM on to the rank
processes only. DeepSpeed's launcher (deepspeed/launcher/launch.py) would SIGTERM every rank and
SIGKILL it 30 s later, too soon for a long step and a checkpoint. So the launcher runs in a session
of its own, where a terminal's Ctrl-C does not reach it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
WORKER = "longft.engine.worker"  # a rank's command line: python -u -m longft.engine.worker ...


def exit_code(signum: int) -> int:
    """The shell convention: 128 + signal number (SIGINT 130, SIGTERM 143)."""
    return 128 + signum


def name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def python_module(argv: list[str]) -> str | None:
    """The module a `python [options] -m MODULE ...` command line runs (None: not one). A rank runs
    longft.engine.worker; the launchers (deepspeed.launcher.runner/launch, torch.distributed.run) only
    have it among their arguments."""
    args = iter(argv[1:])
    for a in args:
        if a == "-m":
            return next(args, None)
        if a in ("-X", "-W"):
            next(args, None)
        elif not a.startswith("-") or a == "-c":
            return None
    return None


class Stopped(Exception):
    """Every rank stopped after `step` on request; the checkpoint and end record are written."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step, self.exit_code = signum, step, exit_code(signum)
        super().__init__(f"stopped by {name(signum)} after step {step}")


class SignalHandlers:
    """Install `_handle` for SIGINT and SIGTERM (main thread only) and restore the old ones."""

    def __init__(self, repeat_s: float = 1.0, clock=time.monotonic):
        self.repeat_s, self._clock = repeat_s, clock
        self.signum = 0
        self._t = 0.0
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _new_request(self, signum: int) -> bool:
        """Record the signal; False for one within `repeat_s` of the last request (the same
        request, passed on by a launcher or a scheduler)."""
        t = self._clock()
        if self.signum and t - self._t < self.repeat_s:
            return False
        self.signum = self.signum or signum
        self._t = t
        return True

    def _handle(self, signum, frame) -> None:
        raise NotImplementedError


class StopRequest(SignalHandlers):
    """On a rank: the first SIGINT/SIGTERM sets `signum`; a second one raises KeyboardInterrupt."""

    def _handle(self, signum, frame) -> None:
        first = not self.signum
        if self._new_request(signum) and not first:
            for s in SIGNALS:
                signal.signal(s, signal.SIG_DFL)
            raise KeyboardInterrupt(f"second {name(signum)}: quitting without a checkpoint")

    def agreed(self, device) -> int:
        """The signal number any rank got (0: none); a collective, so every rank must call it."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([self.signum], dtype=torch.int32, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())


class Relay(SignalHandlers):
    """In the train stage: pass SIGINT/SIGTERM on to the launcher's rank processes.

    `proc` is the launcher, started in a session of its own (so its process group id is its pid).
    First and second signal: sent to every local rank (the ranks stop gracefully, or force-quit on
    the second); to the launcher's whole group when no rank is running yet, or on other nodes only
    (pdsh). A third signal SIGKILLs the launcher's group.
    """

    def __init__(self, proc, repeat_s: float = 1.0, clock=time.monotonic):
        super().__init__(repeat_s, clock)
        self.proc, self.count = proc, 0

    def ranks(self) -> list:
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        out = []
        for p in kids:
            try:
                if python_module(p.cmdline()) == WORKER:
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def _killpg(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except OSError:
            pass

    def _handle(self, signum, frame) -> None:
        if not self._new_request(signum):
            return
        self.count += 1
        if self.count >= 3:
            self._killpg(signal.SIGKILL)
            return
        ranks = self.ranks()
        for p in ranks:
            try:
                p.send_signal(signum)
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
        if not ranks:
            self._killpg(signum)
        msg = (f"longft: {name(signum)}: the ranks finish the current step (or end the "
               "evaluation), write a checkpoint and exit; signal again to quit without a "
               "checkpoint\n" if self.count == 1 else
               f"longft: {name(signum)} again: quitting without a checkpoint\n")
        try:
            sys.stderr.write(msg)
            sys.stderr.flush()
        except (OSError, RuntimeError, ValueError):
            pass
