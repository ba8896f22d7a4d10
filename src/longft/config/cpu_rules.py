"""What a run on the CPU cannot take, one function per rule, each returning its problem ([] = fine).

Two callers apply them: the config check (`checks._cpu_device`, hardware.device set to cpu) and the
hardware policy (`longft.hardware.policy`, device auto resolved to cpu on a machine without a GPU),
so the rule and its message are written here once.
"""

from __future__ import annotations

from typing import Optional


def precision(value: str) -> list[str]:
    """fp16 has no CPU kernels (bf16 and fp32 do)."""
    if value == "fp16":
        return ["precision: fp16 is not supported on CPU; use bf16 or fp32 (or auto)"]
    return []


def checkpointing(mode: str) -> list[str]:
    """cpu_offload moves activations off a GPU; on the CPU there is nothing to move them off."""
    if mode == "cpu_offload":
        return ["checkpointing.mode: cpu_offload moves GPU activations to the host and needs "
                "a CUDA GPU; on CPU use gpu (recompute) or none"]
    return []


def attention(value: str) -> list[str]:
    """flash-attn's kernels are CUDA kernels."""
    if value in ("flash_attention_2", "flash_attn_4"):
        return [f"kernels.attention: {value} needs a CUDA GPU; use sdpa on CPU"]
    return []


def sdpa_backend(value: str) -> list[str]:
    """SDPA's cuDNN and memory-efficient kernels exist only on CUDA."""
    if value in ("cudnn", "efficient"):
        return [f"kernels.sdpa_backend: {value} needs a CUDA GPU; use auto or default on CPU"]
    return []


def liger(value: str) -> list[str]:
    """Liger's kernels are Triton GPU kernels."""
    if value == "on":
        return ["kernels.liger: on needs a CUDA GPU (Triton kernels); use auto or off on CPU"]
    return []


def vram_limit(gib: Optional[float]) -> list[str]:
    """A GPU memory cap means nothing without a GPU."""
    if gib is not None:
        return ["hardware.vram_limit_gib: only meaningful with hardware.device cuda; set it to null"]
    return []


def offload_ratio(ratio: float) -> list[str]:
    """DeepSpeed's partial offload keeps sub-groups on the accelerator; on the CPU accelerator that
    is the host too, so every group would step with CPU Adam and the ratio would do nothing."""
    if 0 < ratio < 1:   # out of (0, 1] is the params check's own message
        return [f"zero.offload_ratio: {ratio} keeps part of the optimizer on a GPU; on CPU every "
                "sub-group is on the host already (it would change nothing): set it to 1.0"]
    return []


def optimizer(name: str) -> list[str]:
    """Paged optimizer states live in CUDA unified memory."""
    if name.startswith("paged_"):
        return [f"optim.name: {name} pages its states through CUDA unified memory and needs a CUDA "
                f"GPU; use adamw_8bit on CPU"]
    return []
