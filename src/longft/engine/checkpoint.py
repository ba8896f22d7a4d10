"""Periodic DeepSpeed checkpoints that survive a kill, and resuming from the last complete one.

Layout of checkpoints/:  step-<N>/ (DeepSpeed's files + COMPLETE)  and  final/.
- A checkpoint is written under `.tmp-step-<N>`, then rank 0 writes COMPLETE into it and renames it
  to `step-<N>` (a rename is atomic): a kill or a full disk mid-write leaves only a `.tmp-` folder,
  which is never resumed from and is removed by the next save.
- COMPLETE holds the run's fingerprint (a hash of every param that changes the training), so a
  checkpoint of another configuration is never resumed.
- Only the newest `output.keep_last` step checkpoints are kept.
- Resume takes the newest complete checkpoint that loads; one that fails to load (corrupted) is
  reported and the one before it is used.
- A write that fails (disk full: ENOSPC/EDQUOT, or torch's zip writer failing with no space left)
  removes its `.tmp-` folder and raises CheckpointError ("disk full while writing checkpoint
  step-N in DIR: free space or lower output.keep_last"); the complete checkpoints are not touched.
DeepSpeed stores model, optimizer and LR-scheduler state; longft adds the step and the RNG states
(client state). The data position follows from the step: the loader is deterministic per seed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
from pathlib import Path

from longft.config.params import Config, to_dict
from longft.errors import UserError

MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")
# torch.save's zip writer reports a full disk as a RuntimeError, not as OSError(ENOSPC)
_ZIP_WRITE_FAILED = re.compile(r"inline_container|PytorchStreamWriter|file write failed")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written; the message says where and what to do."""


def _disk_full(e: BaseException, where: Path) -> bool:
    """For a write that failed (_write_failed): ENOSPC/EDQUOT, or a disk that is (nearly) full."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        du = shutil.disk_usage(where)
    except OSError:
        return False
    return du.free <= max(64 * 2**20, du.total // 1000)


def _write_failed(e: BaseException) -> bool:
    return isinstance(e, OSError) or bool(_ZIP_WRITE_FAILED.search(str(e)))


def _failed(e: BaseException, ckpt_dir: Path, tmp: Path, step: int, fp: str,
            keep_last: int) -> CheckpointError:
    """The error for a failed write of step-<step>, after looking at the disk and removing tmp."""
    full = _disk_full(e, tmp if tmp.exists() else ckpt_dir)
    shutil.rmtree(tmp, ignore_errors=True)  # never resumed from; free what it took
    done = complete_steps(ckpt_dir, fp)
    kept = (f"the newest complete checkpoint, step-{done[0]}, is intact and a re-run resumes from "
            f"it" if done else "there is no earlier complete checkpoint")
    if full:
        size = ""
        if done:
            mib = sum(f.stat().st_size for f in (ckpt_dir / f"step-{done[0]}").rglob("*")
                      if f.is_file()) / 2**20
            size = f", {mib:,.0f} MiB each"
        what = (f"disk full while writing checkpoint step-{step} in {ckpt_dir}: free space or lower "
                f"output.keep_last (now {keep_last}; a save needs room for keep_last + 1 "
                f"checkpoints{size})")
    else:
        what = f"could not write checkpoint step-{step} in {ckpt_dir}: {type(e).__name__}: {e}"
    return CheckpointError(f"{what}. The half-written {tmp.name} was removed; {kept}.")


def disk_full_message(e: BaseException, dirs: list) -> str | None:
    """For a write that failed on a full disk outside save() (the final checkpoint, the export,
    the run log): one line naming the folder, or None when e is something else."""
    if not _write_failed(e):
        return None
    for d in [Path(x) for x in dirs if x]:
        where = d if d.exists() else d.parent
        if _disk_full(e, where):
            name = getattr(e, "filename", None) or d
            return (f"disk full while writing {name}: free space on {d} and run again (complete "
                    f"periodic checkpoints are kept; a re-run resumes from the newest)")
    return None


def fingerprint(cfg: Config) -> str:
    """Hash of the params that define the training trajectory (not iterations or outputs)."""
    d = to_dict(cfg)
    keep = {k: d[k] for k in ("model", "data", "kernels", "precision", "zero", "lora", "optim")}
    # where gradients are staged on the host changes no result (grad_buffer.py), and checkpoints
    # written before the knob existed must still resume
    keep["zero"] = {k: v for k, v in d["zero"].items() if k != "host_grad_buffer"}
    keep["train"] = {k: v for k, v in d["train"].items() if k not in ("iterations", "log_every",
                                                                       "warmup_iterations")}
    keep["world_size"] = cfg.world_size
    # the LR schedule is torch's LambdaLR over ds_config.lr_factor since this version; DeepSpeed's
    # WarmupCosineLR state of older checkpoints does not load into it
    keep["lr_schedule"] = "lambda-1"
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def complete_steps(ckpt_dir: Path, fp: str) -> list[int]:
    """Steps of complete checkpoints of this configuration, newest first."""
    steps = []
    if not ckpt_dir.is_dir():
        return steps
    for d in ckpt_dir.iterdir():
        m = STEP_DIR.match(d.name)
        if m and (d / MARKER).is_file():
            try:
                if json.loads((d / MARKER).read_text()).get("fingerprint") == fp:
                    steps.append(int(m.group(1)))
            except (OSError, ValueError):
                continue
    return sorted(steps, reverse=True)


def save(engine, ckpt_dir: Path, step: int, fp: str, keep_last: int, client_state: dict) -> None:
    """Write step-<step> atomically on all ranks; prune old ones (rank 0)."""
    import torch.distributed as dist

    tmp_tag = f".tmp-step-{step}"
    tmp = ckpt_dir / tmp_tag
    rank = dist.get_rank()
    if rank == 0 and ckpt_dir.is_dir():
        for d in ckpt_dir.iterdir():  # what killed or failed saves left: free the space first
            if d.name.startswith(".tmp-step-"):
                shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state=client_state,
                               save_latest=False)
    except Exception as e:
        # A rank that fails here exits; the launcher then stops the ranks waiting in the barrier.
        if _write_failed(e):
            raise _failed(e, ckpt_dir, tmp, step, fp, keep_last) from e
        raise
    dist.barrier()
    if rank == 0:
        try:
            (tmp / MARKER).write_text(json.dumps({"fingerprint": fp, "step": step}))
        except OSError as e:
            raise _failed(e, ckpt_dir, tmp, step, fp, keep_last) from e
        final = ckpt_dir / f"step-{step}"
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_steps(ckpt_dir, fp)[keep_last:]:  # newest first
            shutil.rmtree(ckpt_dir / f"step-{old}", ignore_errors=True)
    dist.barrier()


def resume(engine, ckpt_dir: Path, fp: str, log) -> tuple[int, dict]:
    """Load the newest loadable checkpoint of this configuration; (step, client_state) or (0, {})."""
    for step in complete_steps(ckpt_dir, fp):
        try:
            path, client = engine.load_checkpoint(str(ckpt_dir), tag=f"step-{step}")
        except Exception as e:  # a corrupted checkpoint: say so and fall back to the one before
            log(f"checkpoint step-{step} could not be loaded ({type(e).__name__}: {e}); "
                f"trying the previous one")
            continue
        if path is not None:
            return step, client or {}
    return 0, {}


def rng_state() -> dict:
    import random

    import numpy as np
    import torch

    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    import random

    import numpy as np
    import torch

    if not st:
        return
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
