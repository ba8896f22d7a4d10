"""SDPA kernel pinning: the order tried, and that a pinned kernel really is the one used."""

import pytest
import torch
import torch.nn.functional as F

from longft.model.attention import context, expand_kv_heads, fused_kernel, priority


def test_priority_puts_the_choice_first_then_fallbacks():
    assert priority("cudnn") == ["cudnn", "efficient", "math"]
    assert priority("efficient") == ["efficient", "math"]
    assert priority("math") == ["math", "efficient"]


def _kernels_run(first: str) -> set[str]:
    """The aten SDPA kernels that ran under context(first), seen by the profiler (public API)."""
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(1, 2, 8, 16)
    with context(first), profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}


FLASH_CPU, MATH = "aten::_scaled_dot_product_flash_attention_for_cpu", \
    "aten::_scaled_dot_product_attention_math"


def test_default_pins_nothing_and_a_pin_changes_the_kernel_that_runs():
    # On the CPU PyTorch's own choice is its flash kernel; a pin that excludes it must move SDPA
    # to the math kernel (context() as a no-op would leave the flash kernel running).
    assert _kernels_run("default") == {FLASH_CPU}
    assert _kernels_run("flash") == {FLASH_CPU}
    for first in ("math", "cudnn", "efficient"):  # the last two fall back to math on the CPU
        assert _kernels_run(first) == {MATH}, first


def test_math_pin_is_honoured_and_matches_reference():
    q, k, v = (torch.randn(1, 2, 32, 16, dtype=torch.float64) for _ in range(3))
    with context("math"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ v)


def test_a_pin_without_fallback_for_the_input_fails_loudly():
    # CPU has no cuDNN kernel; with only cuDNN allowed SDPA must refuse rather than pick silently.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, 2, 8, 16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_fused_kernel_is_every_kernel_but_the_math_path():
    """What checkpointing.keep_attention can keep: flash-attn 2/4 whatever the SDPA pin, SDPA
    unless it is pinned to the math path (which has no kept output), never eager."""
    assert fused_kernel("flash_attention_2", "math") and fused_kernel("flash_attn_4", "default")
    assert fused_kernel("sdpa", "cudnn") and fused_kernel("sdpa", "default")
    assert not fused_kernel("sdpa", "math")
    assert not fused_kernel("eager", "cudnn") and not fused_kernel(None, "default")


def test_expand_kv_heads_stops_transformers_passing_enable_gqa():
    # (conftest restores transformers' own function after the test)
    from transformers.integrations import sdpa_attention

    k = torch.zeros(1, 2, 4, 8)
    assert sdpa_attention.use_gqa_in_sdpa(None, k, k) is True  # transformers' choice on its own
    expand_kv_heads()
    assert sdpa_attention.use_gqa_in_sdpa(None, k, k) is False
