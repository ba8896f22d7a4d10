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

    @property
    def capability_text(self) -> str | None:
        """The compute capability as messages print it ("8.0"), None without a GPU."""
        return f"{self.capability[0]}.{self.capability[1]}" if self.capability else None

    @property
    def ampere(self) -> bool:
        """Compute capability >= 8.0: bf16, FlashAttention-2 and SDPA's flash kernel."""
        return self.capability is not None and self.capability >= (8, 0)

    def to_dict(self) -> dict:
        return asdict(self)


def _has(module: str) -> bool:
    """Whether `module` can be found (a dotted name imports its parents; a missing parent is False)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _providers(module: str) -> set[str]:
    """The installed distributions (normalised names) that ship the top-level package `module`."""
    import importlib.metadata

    found = importlib.metadata.packages_distributions().get(module, [])
    return {d.lower().replace("_", "-") for d in found}


def flash_attn_packages() -> dict[str, bool]:
    """{"flash_attn": flash-attn 2 is installed, "flash_attn_4": flash-attn-4 is}. Both write into
    the package `flash_attn` (flash-attn-4 only flash_attn.cute; flash-attn 2.8 ships a
    flash_attn/cute of its own, without the CUTLASS DSL it needs), so each is told by the
    distribution that provides it, as transformers does; flash-attn 2 also by its CUDA extension
    (flash_attn_2_cuda), which a source build without package metadata still has."""
    who = _providers("flash_attn")
    return {"flash_attn": _has("flash_attn_2_cuda") and ("flash-attn" in who or not who),
            "flash_attn_4": "flash-attn-4" in who and _has("flash_attn.cute")}


def flash_attn_4_loads() -> bool:
    """Whether flash-attn-4 imports, not only is installed: its CuTe DSL needs the
    nvidia-cutlass-dsl libraries for this CUDA, and an install without them would otherwise be
    taken by kernels.attention auto and fail at the first run. Says why where it does not."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to load means: not usable here
        print(f"longft: notice: flash-attn-4 is installed but does not load ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); attention runs without it", flush=True)
        return False
    return True


def detect() -> Hardware:
    """Look at the real machine (no CUDA context is kept if there is no GPU)."""
    import psutil
    import torch

    host = psutil.virtual_memory().total / 2**30
    common = dict(host_mem_gib=round(host, 1), cpu_count=os.cpu_count() or 1,
                  **flash_attn_packages(),
                  liger=importlib.util.find_spec("liger_kernel") is not None,
                  varlen_attn=importlib.util.find_spec("torch.nn.attention.varlen") is not None)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        p = torch.cuda.get_device_properties(0)
        if common["flash_attn_4"] and p.major >= 9:  # where auto may take it: it must load
            common["flash_attn_4"] = flash_attn_4_loads()
        return Hardware(device="cuda", gpu_name=p.name, gpu_count=torch.cuda.device_count(),
                        capability=(p.major, p.minor), gpu_mem_gib=round(p.total_memory / 2**30, 1),
                        **common)
    return Hardware(device="cpu", **common)
