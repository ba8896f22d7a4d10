"""The end of a run that a signal stopped (engine/stop.py turns SIGINT/SIGTERM into an agreed stop
request), and the step checkpoints it and the loop write: checkpoints/step-<N> with the RNG state
a resumed run restores."""

from __future__ import annotations

from pathlib import Path

from longft.config.params import Config
from longft.engine import checkpoint, stop
from longft.measure.runlog import RunLog


def save_step(engine, cfg: Config, ckpt_dir: Path, step: int, fp: str) -> None:
    """checkpoints/step-<step>, with the RNG state the resumed run restores."""
    checkpoint.save(engine, ckpt_dir, step, fp, cfg.output.keep_last,
                    {"rng": checkpoint.rng_state(), "step": step})


def stop_after(engine, cfg: Config, *, ckpt_dir: Path | None, step: int, fp: str, saved: bool,
               signum: int, log: RunLog, rank: int):
    """Every rank, after `step`, on a SIGINT/SIGTERM to any rank: checkpoint (unless this step's
    periodic one was just written), "end" record "interrupted", a message on rank 0, exit 128+sig.
    After the last step (a signal during the final evaluation) the final evaluation, checkpoint
    and export are skipped, and said: a re-run resumes this checkpoint and does them."""
    import torch.distributed as dist

    where = None
    if ckpt_dir is not None:
        if not saved:
            save_step(engine, cfg, ckpt_dir, step, fp)
        where = ckpt_dir / f"step-{step}"
    log.write("end", status="interrupted", steps=step, signal=stop.name(signum),
              checkpoint=str(where) if where else None)
    log.close()  # now, not at the end of `with RunLog`: synced before the barrier below
    if rank == 0:
        then = ("run `dvc repro` (or the same command) again to resume" if where and cfg.output.resume
                else "output.resume is false: the next run starts over" if where
                else "checkpoints are off (output.checkpoint_every, output.save_checkpoint): the "
                     "next run starts over")
        last = ("; the final evaluation, the final checkpoint and the export were skipped"
                if step >= cfg.train.iterations else "")
        print(f"longft: stopped by {stop.name(signum)} after step {step}{last}; checkpoint at "
              f"{where or '-'}; {then}", flush=True)
    dist.barrier()  # every rank has written everything before any exits (launchers kill the rest)
    raise stop.Stopped(signum, step)
