"""Periodic DeepSpeed checkpoints that survive a kill, and resuming from the last complete one.

Layout of checkpoints/:  step-<N>/ (DeepSpeed's files + COMPLETE)  and  final/ (the same, after
the last step).
- A checkpoint is written under `.tmp-step-<N>` (`.tmp-final`), then rank 0 writes COMPLETE into it
  and renames it to `step-<N>` (`final`; a rename is atomic): a kill or a full disk mid-write
  leaves only a `.tmp-` folder, which is never resumed from and is removed by the next save.
- COMPLETE holds the run's fingerprint (a hash of every param that changes the training
  trajectory, trajectory.py), so a checkpoint of another configuration is never resumed, and
  the sha256 of every file of the checkpoint (hashed when it is completed, each rank a share).
- Resuming loads only what longft wrote: every file's sha256 must match COMPLETE and no file may
  have been added, else the run stops (CheckpointError naming the file: delete the checkpoint or
  set output.resume: false); and DeepSpeed's files are unpickled with torch.load(weights_only=True)
  (tensors, containers and an allow-list of DeepSpeed's own state classes, `safe_globals()`), never
  with full pickle (DeepSpeed 0.19.8 itself passes weights_only=False), so a forged checkpoint
  whose COMPLETE was rewritten to match still runs no code.
- Only the newest `output.keep_last` step checkpoints of this configuration are kept; those of
  other configurations are moved to other/<fingerprint>/ by the train stage before it starts
  (run/configurations.py) and left alone.
- Resume takes the newest complete checkpoint that loads, final/ first when it is of this
  configuration and its run did not finish (a run whose export failed after the last step resumes
  there, not at the last periodic checkpoint, and trains no step again; COMPLETE says "finished"
  once the export is written, and a forced re-run of a finished run retrains); one that fails to load (corrupted) is
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
from contextlib import contextmanager
from pathlib import Path

from longft import atomic
from longft.engine.trajectory import fingerprint  # noqa: F401 - where callers find it
from longft.errors import UserError
from longft.model.quantize import has_quantized_layers

MARKER = "COMPLETE"
OTHER = "other"  # checkpoints/other/<fingerprint>/: other configurations' checkpoints, kept
FINAL = "final"
STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written; the message says where and what to do."""


def _disk_full(e: BaseException, where: Path) -> bool:
    """For a write that failed (_write_failed): ENOSPC/EDQUOT, or a disk that is (nearly) full."""
    if atomic.error_code(e) in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        du = shutil.disk_usage(where)
    except OSError:
        return False
    return du.free <= max(64 * 2**20, du.total // 1000)


_write_failed = atomic.write_failed  # torch's zip writer and safetensors say it in their own errors


def _failed(e: BaseException, ckpt_dir: Path, tmp: Path, name: str, fp: str,
            keep_last: int) -> CheckpointError:
    """The error for a failed write of checkpoint `name`, after looking at the disk and removing
    tmp."""
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
        other = ckpt_dir / OTHER
        if other.is_dir() and any(other.iterdir()):
            size += (f"; {other} holds other configurations' checkpoints: delete those you "
                     f"will not resume")
        what = (f"disk full while writing checkpoint {name} in {ckpt_dir}: free space or lower "
                f"output.keep_last (now {keep_last}; a save needs room for keep_last + 1 "
                f"checkpoints{size})")
    else:
        what = f"could not write checkpoint {name} in {ckpt_dir}: {atomic.cause(e)}"
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


def _files(d: Path) -> list[str]:
    """The files of checkpoint folder d (relative, sorted), its own COMPLETE left out (a file of
    that name deeper down is hashed like any other)."""
    return sorted(str(f.relative_to(d)) for f in d.rglob("*")
                  if f.is_file() and f.relative_to(d) != Path(MARKER))


def _sha256(f: Path) -> str:
    with open(f, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _shared_digests(d: Path, names: list[str]) -> dict[str, str]:
    """sha256 of every file in `names`, each rank hashing its share (all ranks get all)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {n: _sha256(d / n) for n in names}
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {n: _sha256(d / n) for i, n in enumerate(names) if i % world == rank}
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def verify(d: Path) -> None:
    """Refuse (CheckpointError) a checkpoint folder whose files are not the ones longft completed:
    a digest that differs, a file that is missing or added, or a COMPLETE without digests."""
    fix = (f"delete {d} (or the whole checkpoints folder) to start afresh from the previous "
           "checkpoint, or set output.resume: false")
    try:
        digests = json.loads((d / MARKER).read_text()).get("sha256")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {d}: unreadable {MARKER} ({e}); {fix}") from None
    if not isinstance(digests, dict) or not digests:
        raise CheckpointError(f"checkpoint {d} has no file digests in {MARKER} (written by an older "
                              f"longft, or not by longft): it cannot be verified; {fix}")
    names = _files(d)
    added = sorted(set(names) - set(digests))
    missing = sorted(set(digests) - set(names))
    if added or missing:
        what = (f"{d / added[0]} is not one of the files longft wrote" if added
                else f"{d / missing[0]} is missing")
        raise CheckpointError(f"checkpoint {d} was changed after it was completed: {what}; {fix}")
    got = _shared_digests(d, names)
    bad = [n for n in names if got[n] != digests[n]]
    if bad:
        raise CheckpointError(
            f"checkpoint {d} was changed after it was completed: {d / bad[0]} does not have the "
            f"sha256 longft recorded{f' (and {len(bad) - 1} more file(s))' if len(bad) > 1 else ''}"
            f"; it is not loaded (a file written by someone else could run code when unpickled); "
            f"{fix}")


def safe_globals() -> list:
    """What DeepSpeed's checkpoint files hold besides tensors and containers, allowed to
    torch.load(weights_only=True): its loss scalers, the ZeRO stage enum, ZeRO-2's fragment
    addresses, and numpy arrays (the RNG state longft stores)."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    dtypes = {type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.bool_)}
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, _reconstruct,
            np.ndarray, np.dtype, *sorted(dtypes, key=str)]


@contextmanager
def weights_only(engine):
    """Within: the engine's checkpoint loads unpickle with weights_only=True (`safe_globals()`)."""
    import pickle

    import torch

    ce = engine.checkpoint_engine
    allowed = safe_globals()

    def load(path, map_location=None):
        with torch.serialization.safe_globals(allowed):
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError as e:
                why = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), None)
                if why is None:
                    raise  # not a refused object: a damaged file (resume tries the one before)
                raise CheckpointError(
                    f"checkpoint file {path} holds a Python object longft does not load (only "
                    f"tensors and DeepSpeed's own state are unpickled; {why}); it was not "
                    "unpickled. Delete the checkpoint or set output.resume: false") from None

    had = "load" in vars(ce)
    old = vars(ce).get("load")
    ce.load = load
    try:
        yield
    finally:
        if had:
            ce.load = old
        else:
            del ce.load


def save(engine, ckpt_dir: Path, step: int, fp: str, keep_last: int, client_state: dict, *,
         name: str | None = None) -> None:
    """Write step-<step> (or `name`: final) atomically on all ranks; prune old steps (rank 0)."""
    import torch.distributed as dist

    name = name or f"step-{step}"
    tmp_tag = f".tmp-{name}"
    tmp = ckpt_dir / tmp_tag
    rank = dist.get_rank()
    if rank == 0 and ckpt_dir.is_dir():
        for d in ckpt_dir.iterdir():  # what killed or failed saves left: free the space first
            if d.name.startswith(".tmp-"):
                shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    try:
        # QLoRA: the frozen 4/8-bit base is rebuilt from the model on resume, not saved each time
        engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state=client_state,
                               save_latest=False,
                               exclude_frozen_parameters=has_quantized_layers(engine.module))
    except Exception as e:
        # A rank that fails here exits; the launcher then stops the ranks waiting in the barrier.
        if _write_failed(e):
            raise _failed(e, ckpt_dir, tmp, name, fp, keep_last) from e
        raise
    dist.barrier()
    names = _files(tmp) if rank == 0 else None
    box = [names]
    dist.broadcast_object_list(box, src=0)  # every rank hashes a share of the same list
    digests = _shared_digests(tmp, box[0])
    if rank == 0:
        try:
            atomic.write_json(tmp / MARKER, {"fingerprint": fp, "step": step, "sha256": digests})
        except OSError as e:
            raise _failed(e, ckpt_dir, tmp, name, fp, keep_last) from e
        final = ckpt_dir / name
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_steps(ckpt_dir, fp)[keep_last:]:  # newest first
            shutil.rmtree(ckpt_dir / f"step-{old}", ignore_errors=True)
    dist.barrier()


def final_step(ckpt_dir: Path, fp: str) -> int | None:
    """The step of checkpoints/final when it is complete, of this configuration and of a run that
    did not finish (its export failed), else None. A finished run's final/ is not resumed: a
    forced re-run retrains."""
    try:
        done = json.loads((Path(ckpt_dir) / FINAL / MARKER).read_text())
        mine = done.get("fingerprint") == fp and not done.get("finished")
        return int(done["step"]) if mine else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def mark_finished(ckpt_dir: Path) -> None:
    """Rank 0, after the export: final/ belongs to a finished run (`final_step`)."""
    marker = Path(ckpt_dir) / FINAL / MARKER
    try:
        done = json.loads(marker.read_text())
    except (OSError, ValueError):
        return
    atomic.write_json(marker, {**done, "finished": True})


def _candidates(ckpt_dir: Path, fp: str) -> list[tuple[int, str]]:
    """(step, folder name) of this configuration's complete checkpoints, newest first; final/
    before a step checkpoint of the same step."""
    out = [(s, f"step-{s}") for s in complete_steps(ckpt_dir, fp)]
    last = final_step(ckpt_dir, fp)
    if last is not None:
        out.append((last, FINAL))
    return sorted(out, key=lambda c: (c[0], c[1] == FINAL), reverse=True)


def newest(ckpt_dir: Path, fp: str) -> tuple[int, str]:
    """(step, folder name) of the checkpoint a resume of this configuration tries first, or
    (0, "")."""
    return (_candidates(ckpt_dir, fp) or [(0, "")])[0]


def resume(engine, ckpt_dir: Path, fp: str, log) -> tuple[int, dict]:
    """Load the newest loadable checkpoint of this configuration; (step, client_state) or (0, {}).
    A checkpoint whose files are not the ones longft completed is refused (`verify`), not
    skipped; every file is unpickled weights_only."""
    for step, tag in _candidates(ckpt_dir, fp):
        verify(ckpt_dir / tag)
        try:
            with weights_only(engine):
                # QLoRA: the frozen base is not in the checkpoint (exclude_frozen_parameters), so
                # torch's strict load cannot take it; load_saved_keys is as strict on what was saved
                quantized = has_quantized_layers(engine.module)
                path, client = engine.load_checkpoint(
                    str(ckpt_dir), tag=tag,
                    custom_load_fn=load_saved_keys if quantized else None)
        except CheckpointError:
            raise
        except Exception as e:  # a corrupted checkpoint: say so and fall back to the one before
            log(f"checkpoint {tag} could not be loaded ({type(e).__name__}: {e}); "
                f"trying the previous one")
            continue
        if path is not None:
            return step, client or {}
    return 0, {}


def load_saved_keys(src: dict, dst) -> None:
    """Load a checkpoint saved with exclude_frozen_parameters (QLoRA) into the model `dst`,
    strictly: its keys must be exactly the model's state-dict keys but the frozen parameters, so
    an adapter renamed, missing or extra (another lora.target_modules, another peft) is refused
    with the keys named instead of being skipped."""
    frozen = {n for n, p in dst.named_parameters() if not p.requires_grad}
    want = set(dst.state_dict()) - frozen
    missing, extra = sorted(want - set(src)), sorted(set(src) - want)
    if missing or extra:
        raise CheckpointError(
            f"the checkpoint's weights do not match the model: {len(missing)} missing "
            f"{missing[:3]}, {len(extra)} unexpected {extra[:3]}; it was written by another "
            "configuration (lora.*, the model or peft's version). Move checkpoints/ aside to "
            "train from the start")
    dst.load_state_dict(src, strict=False)  # (the frozen base stays as loaded)


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
