"""Checks the train stage makes before it starts any rank: nothing is allocated yet, and a refusal
deletes nothing (data/prepared, runs/train, checkpoints and export/ stay as they are).

host_memory(): the patch stage's estimate (artifacts/plan.json, `memory_estimate.estimate.host`)
predicts the peak host memory of this node's process tree (launcher and its ranks: CPU Adam
states, pinned offload buffers, offloaded activation checkpoints, ...). If that prediction exceeds
the RAM available right now (psutil's `available`: free plus reclaimable page cache), the run would
be killed by the OOM killer minutes later, after the model was built and the buffers pinned; it is
refused instead, with the numbers and the fixes. `hardware.host_mem_check: false` turns it off.

gpu_memory(): a second job on the same card. When another process holds memory on a GPU this
node's ranks will use, and what is free there is less than the estimate's need of one rank (its
NVML-level peak, `memory_estimate.estimate.gpu`), the ranks would run out of GPU memory after the
model was built; the run is refused instead, naming the processes. A GPU no other process uses
is not checked (the patch stage already fitted the plan to the card). `hardware.gpu_mem_check:
false` turns it off.

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
from longft.estimate.types import CUDA_CONTEXT_BYTES, GIB
from longft.run.launch import LaunchError


class HostMemoryError(LaunchError):
    """The planned run needs more host RAM than this machine has available."""


class GpuMemoryError(LaunchError):
    """Another process holds the GPU memory the planned run needs."""


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
    top = _largest(items)
    biggest = "; ".join(f"{i['name']} {i['bytes'] / GIB:.2f} GiB" for i in top)
    fixes = _fixes(cfg, plan, {_kind(i["name"]) for i in top if i["bytes"] >= need / 10}, available)
    of_total = f" (of {total / GIB:.1f} GiB total)" if total else ""
    raise HostMemoryError(
        f"not enough host RAM for this run: the estimate predicts a peak of {need / GIB:.2f} GiB "
        f"(process-tree RSS of this node, artifacts/plan.json) but only {available / GIB:.2f} GiB "
        f"is available{of_total}. Largest items: {biggest or 'n/a'}. No rank was started and "
        "nothing was deleted. To fit: " + "; ".join(fixes) + ". `longft estimate` itemises the "
        "prediction; if it is wrong for this machine, set hardware.host_mem_check: false to start "
        "anyway.")


def gpu_memory(cfg: Config, plan: Plan, device: str, gpus: tuple | None = None) -> str | None:
    """Raise GpuMemoryError when another process holds memory on a GPU of this run and the free
    memory there is below one rank's predicted need; else a one-line note (None when not checked:
    CPU, the check off, no estimate, no NVML). `gpus`: (pynvml, visible handles), for tests."""
    est = plan.memory_estimate.estimate
    if device != "cuda" or not cfg.hardware.gpu_mem_check or not est:
        return None
    need = int(est["gpu"]["nvml_bytes"])
    if cfg.hardware.vram_limit_gib is not None:  # an emulated card holds no more than its cap
        need = min(need, int(cfg.hardware.vram_limit_gib * GIB) + CUDA_CONTEXT_BYTES)
    if gpus is None:
        from longft.measure.monitor import visible_gpus

        gpus = visible_gpus()
    nv, handles = gpus
    if nv is None:
        return None
    busy, least = [], None
    for i, h in enumerate(handles[:cfg.hardware.num_gpus]):
        try:
            free = int(nv.nvmlDeviceGetMemoryInfo(h).free)
            others = [p for p in nv.nvmlDeviceGetComputeRunningProcesses(h) if p.pid != os.getpid()]
        except getattr(nv, "NVMLError", OSError) as e:  # MIG or vGPU: not supported there
            return f"GPU memory: not checked (NVML on GPU {i}: {e})"
        if others and free < need:
            held = ", ".join(f"pid {p.pid} ({_process_name(p.pid)}, "
                             f"{(p.usedGpuMemory or 0) / GIB:.1f} GiB)" for p in others)
            busy.append(f"GPU {i}: {free / GIB:.1f} GiB free, held by {held}")
            least = free if least is None else min(least, free)
    if not busy:
        return f"GPU memory: a rank needs {need / GIB:.2f} GiB (plan.json); no other job holds it"
    plan_free = (f", or plan for what is free (`longft placement --gpu-mem {least / GIB:.1f} ...`)"
                 if least > CUDA_CONTEXT_BYTES else "")   # less than a CUDA context: nothing to plan
    raise GpuMemoryError(
        f"another job holds the GPU memory this run needs: a rank needs {need / GIB:.2f} GiB "
        f"(NVML-level peak, artifacts/plan.json) but " + "; ".join(busy) + ". No rank was started "
        "and nothing was deleted. To fit: wait for that job to end, run on another GPU "
        f"(CUDA_VISIBLE_DEVICES){plan_free}; if the estimate is wrong for this machine, set "
        "hardware.gpu_mem_check: false to start anyway.")


def _process_name(pid: int) -> str:
    try:
        import psutil

        return " ".join(psutil.Process(pid).cmdline()[:3]) or psutil.Process(pid).name()
    except Exception:  # noqa: BLE001 - gone, or another user's: the pid is enough
        return "?"


# Host items by what shrinks them (names of estimate/host.py and estimate/estimator.py): the
# sequence and micro-batch shrink activations; LoRA, 8-bit or bf16 states and another placement
# shrink model states (weights, gradients, optimizer); nothing in the params shrinks the fixed ones.
ACTIVATIONS = ("activation checkpoints", "DataLoader")
FIXED = ("process baseline", "flash-attn-4 runtime", "start-up peak above the baseline")
MIXED = ("rank tensors",)   # a CPU run: the GPU items (weights, gradients, activations) in host RAM


def _kind(name: str) -> str:
    """"activations", "fixed", "mixed" or "states": what a host item of the estimate is."""
    for kind, prefixes in (("activations", ACTIVATIONS), ("fixed", FIXED), ("mixed", MIXED)):
        if name.startswith(prefixes):
            return kind
    return "states"


def _largest(items) -> list:
    """The three largest items of the host moment with the most bytes (start-up or training; an
    item without phases counts in every moment): the items the predicted peak is made of."""
    moments = {m for i in items for m in i.get("phases", ())} or {None}

    def held(i, m):
        return m is None or "phases" not in i or m in i["phases"]

    peak = max(moments, key=lambda m: sum(i["bytes"] or 0 for i in items if held(i, m)))
    return sorted((i for i in items if i.get("bytes") and held(i, peak)), key=lambda i: -i["bytes"])[:3]


def _fixes(cfg: Config, plan: Plan, kinds: set[str], available: int) -> list[str]:
    """The changes that shrink the largest items (`kinds`), then more RAM."""
    fixes = []
    if kinds & {"activations", "mixed"}:
        micro = cfg.train.micro_batch_size
        fixes.append(f"lower data.max_seq_length ({cfg.data.max_seq_length})"
                     + (f" or train.micro_batch_size ({micro})" if micro > 1 else ""))
        if plan.resolved.checkpointing.value == "cpu_offload":
            fixes.append("use checkpointing.mode: gpu instead of cpu_offload (activation checkpoints "
                         "stay in GPU memory)")
    if kinds & {"states", "mixed"}:
        smaller = ("LoRA or QLoRA (lora.rank, lora.quantize), 8-bit Adam (optim.name: adamw_8bit) "
                   "or bf16 states (zero.optimizer_states: bf16)")
        gpu = plan.hardware.get("gpu_mem_gib")  # Hardware.to_dict; None without a GPU
        if plan.resolved.device.value == "cuda" and gpu:
            gpus = f" --gpus {cfg.hardware.num_gpus}" if cfg.hardware.num_gpus > 1 else ""
            host = int(available / GIB * 10) / 10
            fixes.append(f"`longft placement --gpu-mem {gpu:g} --host-mem {host:g} --seq "
                         f"{cfg.data.max_seq_length}{gpus} --lora any --quantize any --optimizer any "
                         f"--optimizer-states any` finds a placement that fits, with {smaller}")
        else:
            fixes.append(f"fewer or smaller model states: {smaller}")
    fixes.append("free host memory (close other jobs) or use a machine with more RAM")
    return fixes
