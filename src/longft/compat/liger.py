"""Liger internals longft uses: `_apply_liger_kernel_to_instance`, which patches one model instance
(its public per-family functions patch the classes, for every model of the process)."""

from __future__ import annotations

from longft.compat import Access

ACCESSES = (Access("liger", "liger_kernel.transformers", "_apply_liger_kernel_to_instance"),)


def apply_to_instance(model) -> None:
    """Liger RMSNorm, RoPE, SwiGLU and fused linear cross-entropy on this instance."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True,
                                    cross_entropy=False, fused_linear_cross_entropy=True)
