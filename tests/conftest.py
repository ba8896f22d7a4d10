"""Shared pytest fixtures."""

import pytest


@pytest.fixture(scope="session")
def byte_tokenizer():
    """The shipped byte tokenizer (configs/tokenizers/byte), loaded once per session."""
    from longft.config.params import ModelConfig
    from longft.model.loading import load_tokenizer

    return load_tokenizer(ModelConfig())


@pytest.fixture(autouse=True)
def _restore_liger_globals(monkeypatch):
    """Liger's instance patching also swaps module-level classes/functions of the modeling files
    (process-wide); a plan made for faked GPU hardware must not leak Liger into later CPU tests."""
    import importlib

    for mod, names in {"llama": ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"),
                       "qwen2": ("Qwen2RMSNorm", "Qwen2MLP", "apply_rotary_pos_emb")}.items():
        m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        for n in names:
            monkeypatch.setattr(m, n, getattr(m, n))
    from transformers.integrations import sdpa_attention
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", sdpa_attention.use_gqa_in_sdpa)
