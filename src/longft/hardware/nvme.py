"""Checks for `zero.offload_optimizer: nvme` (ZeRO-Infinity), before anything is built.

DeepSpeed swaps the optimizer states to files under the path through its async_io op, which it
compiles on first use against libaio. What goes wrong there goes wrong late (after the model is
built and partitioned) and with a long traceback: a missing or read-only directory, a disk too
small for the states, libaio absent. `problems()` finds each up front and says the fix.
"""

from __future__ import annotations

import os
import shutil
import tempfile

GIB = 2**30


def libaio_problem() -> list[str]:
    """[] when DeepSpeed's async_io op can be built here (its own compatibility check: libaio's
    library and headers), else the fix."""
    try:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("AsyncIOBuilder")
        ok = builder is not None and builder.is_compatible(verbose=False)
    except Exception as e:  # deepspeed missing or its builder broken: say so
        return [f"zero.offload_optimizer: nvme needs DeepSpeed's async_io op, which could not be "
                f"checked ({type(e).__name__}: {e})"]
    if ok:
        return []
    return ["zero.offload_optimizer: nvme needs libaio for DeepSpeed's async_io op, and it was not "
            "found: install the libaio-dev package (`apt-get install libaio-dev`; the CUDA images "
            "have it), or use zero.offload_optimizer: cpu"]


def path_problems(path: str | None, need_bytes: int) -> list[str]:
    """The directory must exist, be a directory we can write in, and have need_bytes free."""
    if not path:
        return ["zero.nvme_path: required with zero.offload_optimizer nvme"]
    if not os.path.exists(path):
        return [f"zero.nvme_path: {path} does not exist; create it (on a fast local disk) or "
                "point nvme_path at an existing directory"]
    if not os.path.isdir(path):
        return [f"zero.nvme_path: {path} is not a directory"]
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".longft-write-test-"):
            pass
    except OSError as e:
        return [f"zero.nvme_path: cannot write in {path} ({e.strerror or e}); choose a directory "
                "this user can write, or fix its permissions"]
    free = shutil.disk_usage(path).free
    if need_bytes > free:
        stale = _stale_swap_bytes(path)
        left = (f" ({stale / GIB:.1f} GiB of it are swap files of earlier longft runs that did not "
                f"finish, under {os.path.join(path, SWAP_DIR)}/run-*: delete those no run uses)"
                if stale else "")
        return [f"zero.nvme_path: the optimizer states need {need_bytes / GIB:.1f} GiB and {path} has "
                f"{free / GIB:.1f} GiB free{left}; free space, choose a larger disk, or halve them "
                "with zero.optimizer_states: bf16"]
    return []


SWAP_DIR = "longft-optimizer"
"""The directory below zero.nvme_path that longft's runs swap into, one run-<port> each
(engine/ds_config.py: nvme_dir, nvme_run_dir); a finished run removes its own."""


def _stale_swap_bytes(path: str) -> int:
    """Bytes of the run-* swap directories left under path (killed runs)."""
    root = os.path.join(path, SWAP_DIR)
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def problems(path: str | None, need_bytes: int) -> list[str]:
    """Everything that would stop the NVMe offload: the path first, then libaio."""
    return path_problems(path, need_bytes) + libaio_problem()


def bandwidth(path: str) -> tuple[float, float]:
    """(read, write) bytes a second of a disk, from the JSON that bench/nvme/disk_bandwidth.py
    writes (`read_gib_s`, `write_gib_s`: GiB a second, 2^30 bytes). ValueError names what is wrong."""
    import json

    how = "measure the disk with `python bench/nvme/disk_bandwidth.py DIR --out disk.json`"
    try:
        doc = json.loads(open(path).read())
    except OSError as e:
        raise ValueError(f"--disk-bandwidth {path}: cannot read it ({e.strerror}); {how}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--disk-bandwidth {path}: not JSON ({e.msg}); {how}") from None
    rates = []
    for key in ("read_gib_s", "write_gib_s"):
        v = doc.get(key) if isinstance(doc, dict) else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"--disk-bandwidth {path}: no positive {key!r} (GiB/s); {how}")
        rates.append(float(v) * 2**30)
    return rates[0], rates[1]
