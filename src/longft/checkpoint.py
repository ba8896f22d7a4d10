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
DeepSpeed stores model, optimizer and LR-scheduler state; longft adds the step and the RNG states
(client state). The data position follows from the step: the loader is deterministic per seed.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from .config import Config, to_dict

MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")


def fingerprint(cfg: Config) -> str:
    """Hash of the params that define the training trajectory (not iterations or outputs)."""
    d = to_dict(cfg)
    keep = {k: d[k] for k in ("model", "data", "kernels", "precision", "zero", "lora", "optim")}
    keep["train"] = {k: v for k, v in d["train"].items() if k not in ("iterations", "log_every",
                                                                       "warmup_iterations")}
    keep["world_size"] = cfg.world_size
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
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(ckpt_dir / tmp_tag, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state=client_state, save_latest=False)
    dist.barrier()
    if rank == 0:
        (ckpt_dir / tmp_tag / MARKER).write_text(json.dumps({"fingerprint": fp, "step": step}))
        final = ckpt_dir / f"step-{step}"
        shutil.rmtree(final, ignore_errors=True)
        (ckpt_dir / tmp_tag).rename(final)
        for d in ckpt_dir.iterdir():
            if d.name.startswith(".tmp-step-") and d.name != tmp_tag:
                shutil.rmtree(d, ignore_errors=True)
        for old in sorted(complete_steps(ckpt_dir, fp), reverse=True)[keep_last:]:
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
