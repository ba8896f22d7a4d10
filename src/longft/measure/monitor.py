"""Sample host and GPU memory of a process tree in a background thread.

`HostSampler` runs beside a training launcher and records, at >= 10 Hz (20 Hz by default):
- rss_tree_bytes: RSS summed over the root process and all its descendants (DeepSpeed workers,
  data loader workers). Shared pages (CUDA libraries, shared-memory tensors) count once per
  process, so this can exceed what the tree really holds; `sys_used` is the check on it.
- sys_used_bytes: system-wide used memory, psutil's total - available; the summary reports its peak
  minus the value at start, i.e. what the run added to the machine (pinned buffers included).
- per GPU, when NVML is present: device memory used (all processes, like nvidia-smi) and
  utilisation %. Without a driver, NVML or GPUs these columns are simply absent. summary()'s
  gpu_util_mean_pct averages every sample (set-up included); the metrics stage reports the mean
  over the timed steps instead (`util_over_windows`).
- with disk_dir (offload_optimizer nvme: the swap directory), the bytes of the files under it and
  the free space of its disk, every 0.5 s (measure/disk.py); summary() only, not the CSV.

    with HostSampler(csv_path=Path("runs/train/memory.csv")) as s:
        subprocess.run(cmd)
    json.dump(s.summary(), open("runs/train/monitor.json", "w"))

The CSV is appended while the run goes and flushed about once a second, so a killed run still
leaves its timeline behind.
"""

from __future__ import annotations

import csv
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psutil

from longft.measure.disk import DiskWatch

log = logging.getLogger(__name__)

_TREE_REFRESH_S = 0.5
"""Re-list the process tree at most this often: listing children scans every process of the host,
reading the RSS of known processes is cheap. A process born in between is missed for <= 0.5 s,
when it is still small."""

_FLUSH_S = 1.0


def _nvml():
    """The initialised pynvml module, or None without the library, a driver or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.debug("NVML unavailable: %s", e)
        return None
    return pynvml


def _visible_handles(nv) -> list:
    """NVML handles of the GPUs CUDA would show this process (CUDA_VISIBLE_DEVICES honoured).

    NVML numbers devices by PCI bus order; CUDA does too with CUDA_DEVICE_ORDER=PCI_BUS_ID and, on
    the usual servers of identical GPUs, by default as well.
    """
    count = nv.nvmlDeviceGetCount()
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    handles = []
    for item in (s.strip() for s in spec.split(",")):
        try:  # like CUDA, stop at the first entry that names no device
            if item.isdigit():
                if int(item) >= count:
                    break
                handles.append(nv.nvmlDeviceGetHandleByIndex(int(item)))
            elif item.startswith(("GPU-", "MIG-")):
                handles.append(nv.nvmlDeviceGetHandleByUUID(item))
            else:
                break
        except nv.NVMLError:
            break
    return handles


def visible_gpus() -> tuple:
    """(the initialised pynvml module, the NVML handles of the GPUs this process can see, in CUDA's
    order); (None, []) without NVML or a GPU."""
    nv = _nvml()
    if nv is None:
        return None, []
    try:
        return nv, _visible_handles(nv)
    except Exception as e:  # noqa: BLE001 - NVML errors of a broken driver: no GPU to check
        log.debug("NVML devices unavailable: %s", e)
        return None, []


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def gpu_inventory() -> list[dict]:
    """Name, total memory and driver of each GPU this process can see; [] without NVML or GPU."""
    nv = _nvml()
    if nv is None:
        return []
    try:
        driver = _text(nv.nvmlSystemGetDriverVersion())
        out = []
        for i, h in enumerate(_visible_handles(nv)):
            out.append({"index": i, "name": _text(nv.nvmlDeviceGetName(h)),
                        "memory_total_bytes": int(nv.nvmlDeviceGetMemoryInfo(h).total),
                        "driver": driver})
        return out
    except nv.NVMLError as e:
        log.warning("NVML inventory failed: %s", e)
        return []
    finally:
        nv.nvmlShutdown()


def sys_used_bytes() -> int:
    """System-wide used memory: total - available (page cache that can be dropped is not used)."""
    vm = psutil.virtual_memory()
    return int(vm.total - vm.available)


def cpu_model() -> str | None:
    """The host CPU's model name (Linux /proc/cpuinfo, else platform.processor()), None if unknown:
    a CPU run's speed depends on it (AVX-512 and its bf16 instructions, say) as a GPU run's does on
    the GPU."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def rss_tree_bytes(pid: int) -> int:
    """RSS of a process and all its descendants now; 0 if the process is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    return _rss_sum(procs)


def _rss_sum(procs) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # vanished, zombie or not ours: contributes nothing
            pass
    return total


def util_over_windows(header: list[str], rows: list[list[Optional[float]]],
                      windows: list[tuple[float, float]]) -> list[Optional[float]]:
    """Mean utilisation % per GPU over the samples (a sampler CSV: header and float rows) whose
    time falls in one of `windows` ([(start, end)] in unix seconds, e.g. the timed steps), so
    model load, engine set-up and the final checkpoint do not dilute it. None for a GPU without
    a sample there."""
    cols = [i for i, c in enumerate(header) if c.startswith("gpu") and c.endswith("_util_pct")]
    spans = sorted(windows)
    sums, counts = [0.0] * len(cols), [0] * len(cols)
    for r in rows:
        t = r[0]
        if t is None or not any(lo <= t <= hi for lo, hi in spans):
            continue
        for k, i in enumerate(cols):
            if r[i] is not None:
                sums[k] += r[i]
                counts[k] += 1
    return [s / n if n else None for s, n in zip(sums, counts)]


class HostSampler:
    """Background sampler of process-tree RSS, system used memory and GPU memory/utilisation.

    root_pid: the tree to sample (default: this process). csv_path: timeline file (None: no file).
    hz: samples per second. gpus: sample GPUs through NVML when it is available. disk_dir: also
    watch the bytes under this directory and its disk's free space (DiskWatch).
    """

    def __init__(self, root_pid: int | None = None, csv_path: Path | None = None,
                 hz: float = 20.0, gpus: bool = True, disk_dir: Path | None = None):
        if not hz > 0:
            raise ValueError(f"hz must be positive, got {hz}")
        self.root_pid = os.getpid() if root_pid is None else int(root_pid)
        self.csv_path = Path(csv_path) if csv_path is not None else None
        self.hz = float(hz)
        self.gpus = gpus
        self._disk = DiskWatch(disk_dir) if disk_dir is not None else None
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._nv = None
        self._handles: list = []
        self._inventory: list[dict] = []
        self._procs: list = []
        self._procs_listed_at = float("-inf")
        self._file = None
        self._writer = None
        self._flushed_at = 0.0
        # running aggregates (the timeline itself goes to the CSV, not to memory)
        self._n = 0
        self._t_start = self._t_end = self._t_first = self._t_last = None
        self._baseline = 0
        self._rss_peak, self._rss_peak_t = 0, None
        self._sys_peak, self._sys_peak_t = 0, None
        self._gpu_base: list = []
        self._gpu_peak: list = []
        self._util_sum: list = []
        self._util_n: list = []

    def watch_disk(self, path: Path) -> None:
        """Watch `path` instead (a launch retried on another port swaps elsewhere), from now on."""
        disk = DiskWatch(path)
        if self._thread is not None:
            disk.start()
        self._disk = disk

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "HostSampler":
        if self._thread is not None:
            raise RuntimeError("HostSampler already started")
        if self.gpus:
            self._nv = _nvml()
            if self._nv is not None:
                try:
                    self._handles = _visible_handles(self._nv)
                except self._nv.NVMLError as e:
                    log.warning("NVML device listing failed, sampling no GPU: %s", e)
                    self._handles = []
                self._inventory = gpu_inventory() if self._handles else []
        n = len(self._handles)
        self._gpu_base, self._gpu_peak = [None] * n, [None] * n
        self._util_sum, self._util_n = [0.0] * n, [0] * n
        if self.csv_path is not None:
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.csv_path, "w", newline="")
            self._writer = csv.writer(self._file)
            header = ["t", "rss_tree_bytes", "sys_used_bytes"]
            for i in range(n):
                header += [f"gpu{i}_used_bytes", f"gpu{i}_util_pct"]
            self._writer.writerow(header)
            self._file.flush()
        self._baseline = sys_used_bytes()
        if self._disk is not None:
            self._disk.start()
        self._t_start = time.time()
        self._sample()  # one sample now: GPU baselines, and a summary even for a very short run
        self._thread = threading.Thread(target=self._run, name="longft-host-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling, take a last sample, close the CSV and return summary()."""
        if self._thread is None or self._stopped:
            return self.summary()
        self._stop_event.set()
        self._thread.join()
        self._sample()
        if self._disk is not None:
            self._disk.stop()
        self._stopped = True
        self._t_end = time.time()
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError:
                pass
        return self.summary()

    def __enter__(self) -> "HostSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- sampling ----------------------------------------------------------------------------
    def _run(self) -> None:
        period = 1.0 / self.hz
        next_t = time.monotonic()
        while not self._stop_event.is_set():
            next_t += period
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (slow /proc, busy host): resume the grid, do not burst
                next_t = time.monotonic()
            elif self._stop_event.wait(delay):
                break
            try:
                self._sample()
            except Exception:  # never let a sampling hiccup end the timeline
                log.exception("host sample failed")

    def _tree(self) -> list:
        now = time.monotonic()
        if now - self._procs_listed_at >= max(_TREE_REFRESH_S, 1.0 / self.hz):
            try:
                root = psutil.Process(self.root_pid)
                self._procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                self._procs = []
            self._procs_listed_at = now
        return self._procs

    def _gpu_values(self) -> list[tuple[Optional[int], Optional[float]]]:
        out = []
        for h in self._handles:
            used = util = None
            try:
                used = int(self._nv.nvmlDeviceGetMemoryInfo(h).used)
            except self._nv.NVMLError:
                pass
            try:
                util = float(self._nv.nvmlDeviceGetUtilizationRates(h).gpu)
            except self._nv.NVMLError:  # e.g. not supported on a MIG slice
                pass
            out.append((used, util))
        return out

    def _sample(self) -> None:
        t = time.time()
        rss = _rss_sum(self._tree())
        used = sys_used_bytes()
        gpu = self._gpu_values()
        if self._disk is not None:
            self._disk.sample()
        with self._lock:
            self._n += 1
            if self._t_first is None:
                self._t_first = t
            self._t_last = t
            if rss > self._rss_peak or self._rss_peak_t is None:
                self._rss_peak, self._rss_peak_t = rss, t
            if used > self._sys_peak or self._sys_peak_t is None:
                self._sys_peak, self._sys_peak_t = used, t
            for i, (g_used, g_util) in enumerate(gpu):
                if g_used is not None:
                    if self._gpu_base[i] is None:
                        self._gpu_base[i] = g_used
                    self._gpu_peak[i] = max(self._gpu_peak[i] or 0, g_used)
                if g_util is not None:
                    self._util_sum[i] += g_util
                    self._util_n[i] += 1
            if self._writer is not None:
                row: list[Any] = [f"{t:.3f}", rss, used]
                for g_used, g_util in gpu:
                    row += ["" if g_used is None else g_used, "" if g_util is None else g_util]
                self._writer.writerow(row)
                if t - self._flushed_at >= _FLUSH_S:
                    self._file.flush()
                    self._flushed_at = t

    # -- results -----------------------------------------------------------------------------
    def summary(self) -> dict:
        """Peaks and rates so far (also while running); times are unix seconds."""
        with self._lock:
            span = (self._t_last - self._t_first) if self._n >= 2 else 0.0
            return {
                "samples": self._n,
                "hz_achieved": (self._n - 1) / span if span > 0 else 0.0,
                "t_start": self._t_start,
                "t_end": self._t_end if self._t_end is not None else self._t_last,
                "root_pid": self.root_pid,
                "rss_tree_peak_bytes": self._rss_peak,
                "rss_tree_peak_t": self._rss_peak_t,
                "sys_used_baseline_bytes": self._baseline,
                "sys_used_minus_baseline_peak_bytes": self._sys_peak - self._baseline,
                "sys_used_peak_t": self._sys_peak_t,
                "sys_total_bytes": int(psutil.virtual_memory().total),
                "cpu_count": os.cpu_count(),
                "cpu_model": cpu_model(),
                "gpu_used_baseline_bytes": list(self._gpu_base),
                "gpu_used_peak_bytes": list(self._gpu_peak),
                "gpu_util_mean_pct": [s / n if n else None
                                      for s, n in zip(self._util_sum, self._util_n)],
                "gpus": list(self._inventory),
                **(self._disk.summary() if self._disk is not None else {}),
            }
