"""Checks the train stage makes before it starts any rank: nothing is allocated yet, and a refusal
deletes nothing (data/prepared, runs/train, checkpoints and export/ stay as they are).

host_memory(): the patch stage's estimate (artifacts/plan.json, `memory_estimate.estimate.host`)
predicts the peak host memory of this node's process tree (launcher and its ranks: CPU Adam
states, pinned offload buffers, offloaded activation checkpoints, ...). If that prediction exceeds
the RAM available right now (psutil's `available`: free plus reclaimable page cache), the run would
be killed by the OOM killer minutes later, after the model was built and the buffers pinned; it is
refused instead, with the numbers and the fixes. `hardware.host_mem_check: false` turns it off.

writable(): runs/train, checkpoints/ and export/ must be directories this process can create and
write files in (export/ is written beside itself, in a temporary folder, and renamed: its parent too), or
the final checkpoint and the export would fail only after every step had trained.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from longft.config.params import Config
from longft.config.plan import Plan
from longft.estimate.types import GIB
from longft.run.launch import LaunchError


class HostMemoryError(LaunchError):
    """The planned run needs more host RAM than this machine has available."""


class OutputDirError(LaunchError):
    """An output directory of the train stage cannot be created or written."""


def _write_problem(d: Path) -> str | None:
    """Why no file can be created in existing directory d, or None (a real probe, not access():
    read-only mounts, quotas of 0 and ACLs all show)."""
    try:
        fd, name = tempfile.mkstemp(dir=d, prefix=".longft-write-test-")
    except OSError as e:
        return e.strerror or type(e).__name__
    os.close(fd)
    os.unlink(name)
    return None


def _dir_problem(key: str, d: Path, beside: bool = False) -> str | None:
    """The problem with output directory d (None: fine). beside: files are also created in its
    parent (a temporary sibling renamed into place)."""
    if d.exists() and not d.is_dir():
        return (f"{key} {d} exists and is not a directory; remove or rename it, or pass another "
                f"path")
    probe = [d] if d.is_dir() else []
    if beside or not d.is_dir():
        anc = d.parent
        while not anc.exists() and anc != anc.parent:
            anc = anc.parent
        if not anc.is_dir():
            return (f"{key} {d} cannot be created: {anc} is not a directory; pass a path under "
                    f"a directory")
        probe.append(anc)
    for p in probe:
        why = _write_problem(p)
        if why:
            what = "written in" if p == d else f"created ({d} needs a file created in {p})"
            return (f"{key} {d} cannot be {what}: {why}; fix its permissions or owner (chmod, "
                    f"chown), free the file system or remount it writable, or pass another path")
    if d.is_dir():
        for sub in d.iterdir():  # e.g. checkpoints/final of an earlier run, written again
            if sub.is_dir() and not sub.name.startswith(".") and _write_problem(sub):
                return (f"{key} {sub} (of an earlier run, written again) cannot be written in; "
                        f"fix its permissions or remove it")
    return None


def writable(dirs: dict[str, Path], beside: tuple[str, ...] = ("export",)) -> None:
    """Raise OutputDirError listing every output directory (name -> path) that cannot be created
    or written. Nothing is created: a probe file is made and removed in the directory, or in its
    nearest existing ancestor when it does not exist yet."""
    problems = [p for k, d in dirs.items()
                if (p := _dir_problem(k, Path(d), k in beside)) is not None]
    if problems:
        raise OutputDirError(
            "the train stage cannot write its outputs, which would be found only after training "
            "(the final checkpoint, the export): " + "; ".join(problems)
            + ". No rank was started and nothing was deleted.")


def host_memory(cfg: Config, plan: Plan, available: int | None = None) -> str | None:
    """Raise HostMemoryError when the predicted peak host RAM exceeds what is available now.

    Returns a one-line note of the comparison (None when the check is off or the plan has no
    estimate). `available` (bytes) defaults to psutil.virtual_memory().available.
    """
    if not cfg.hardware.host_mem_check:
        return None
    need = plan.memory_estimate.host_rss_bytes
    if need is None:
        return "host RAM check skipped: artifacts/plan.json has no host estimate (re-run the patch stage)"
    items = plan.memory_estimate.host_items
    if available is None:
        import psutil

        vm = psutil.virtual_memory()
        available, total = int(vm.available), int(vm.total)
    else:
        total = None
    if need <= available:
        return (f"host RAM: predicted peak {need / GIB:.2f} GiB (plan.json), "
                f"{available / GIB:.2f} GiB available")
    resolved = plan.resolved
    top = sorted((i for i in items if i.get("bytes")), key=lambda i: -i["bytes"])[:3]
    biggest = "; ".join(f"{i['name']} {i['bytes'] / GIB:.2f} GiB" for i in top)
    fixes = [f"lower data.max_seq_length ({cfg.data.max_seq_length}) or train.micro_batch_size "
             f"({cfg.train.micro_batch_size})"]
    if resolved.checkpointing.value == "cpu_offload":
        fixes.append("use checkpointing.mode: gpu instead of cpu_offload (activation checkpoints "
                     "stay in GPU memory)")
    if cfg.zero.offload_param == "cpu":
        fixes.append("set zero.offload_param: none (parameters stay in GPU memory)")
    if cfg.zero.offload_optimizer == "cpu" and resolved.device.value == "cuda":
        fixes.append("set zero.offload_optimizer: none if the GPUs have room for the optimizer states")
    fixes.append("free host memory (close other jobs) or use a machine with more RAM")
    of_total = f" (of {total / GIB:.1f} GiB total)" if total else ""
    raise HostMemoryError(
        f"not enough host RAM for this run: the estimate predicts a peak of {need / GIB:.2f} GiB "
        f"(process-tree RSS of this node, artifacts/plan.json) but only {available / GIB:.2f} GiB "
        f"is available{of_total}. Largest items: {biggest or 'n/a'}. No rank was started and "
        "nothing was deleted. To fit: " + "; ".join(fixes) + ". `longft estimate` itemises the "
        "prediction; if it is wrong for this machine, set hardware.host_mem_check: false to start "
        "anyway.")
