"""Shared pytest fixtures."""

import pytest


@pytest.fixture(scope="session")
def byte_tokenizer():
    """The shipped byte tokenizer (configs/tokenizers/byte), loaded once per session."""
    from longft.config import ModelConfig
    from longft.model import load_tokenizer

    return load_tokenizer(ModelConfig())
