"""What hardware is here: GPUs (name, count, compute capability, memory), host RAM and cores, and
whether flash-attn and liger-kernel are installed. Tests pass a fake `Hardware` instead."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Hardware:
    device: str  # "cuda" or "cpu"
    gpu_name: str | None = None
    gpu_count: int = 0
    capability: tuple[int, int] | None = None
    gpu_mem_gib: float | None = None
    host_mem_gib: float = 0.0
    cpu_count: int = 1
    flash_attn: bool = False
    liger: bool = False
    varlen_attn: bool = False
    """torch has torch.nn.attention.varlen.varlen_attn (2.10 and later): packed rows in one call."""
    flash_attn_4: bool = False
    """flash-attn-4 is installed (flash_attn.cute: CuTe DSL kernels for Hopper and Blackwell)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _has(module: str) -> bool:
    """Whether `module` can be found (a dotted name imports its parents; a missing parent is False)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def detect() -> Hardware:
    """Look at the real machine (no CUDA context is kept if there is no GPU)."""
    import psutil
    import torch

    host = psutil.virtual_memory().total / 2**30
    common = dict(host_mem_gib=round(host, 1), cpu_count=os.cpu_count() or 1,
                  # flash-attn 2's CUDA extension: flash-attn-4 installs flash_attn.cute alone
                  flash_attn=_has("flash_attn_2_cuda"), flash_attn_4=_has("flash_attn.cute"),
                  liger=importlib.util.find_spec("liger_kernel") is not None,
                  varlen_attn=importlib.util.find_spec("torch.nn.attention.varlen") is not None)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        p = torch.cuda.get_device_properties(0)
        return Hardware(device="cuda", gpu_name=p.name, gpu_count=torch.cuda.device_count(),
                        capability=(p.major, p.minor), gpu_mem_gib=round(p.total_memory / 2**30, 1),
                        **common)
    return Hardware(device="cpu", **common)
