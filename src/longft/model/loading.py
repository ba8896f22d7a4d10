"""Model and tokenizer loading: random init from an architecture config, or real weights.

Random init (`model.source: random`) exists for memory and speed studies only: no download, same
shapes. `model.source: pretrained` goes through `from_pretrained` on a hub id or a local directory;
both paths return the same kind of object and are trained by the same code.
"""

from __future__ import annotations

import json
from pathlib import Path

from longft.config.params import ModelConfig
from longft.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
MODELS_DIR = REPO_ROOT / "configs" / "models"
BYTE_TOKENIZER = REPO_ROOT / "configs" / "tokenizers" / "byte"


class ModelError(UserError, ValueError):
    """A model or tokenizer that cannot be found or loaded; the message says what to change."""


def _architecture_file(name: str) -> Path | None:
    p = Path(name)
    if p.suffix == ".json" and p.is_file():
        return p
    if p.is_dir() and (p / "config.json").is_file():
        return p / "config.json"
    shipped = MODELS_DIR / f"{name}.json"
    return shipped if shipped.is_file() else None


def shipped_architectures() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def load_model_config(mc: ModelConfig):
    """The transformers config of the model (no weights are read)."""
    from transformers import AutoConfig

    if mc.source == "random":
        f = _architecture_file(mc.name)
        if f is None:
            raise ModelError(
                f"model.name: {mc.name!r} is neither a file in configs/models "
                f"({', '.join(shipped_architectures())}) nor a path to a config.json; "
                f"pick one of those or set model.source: pretrained for a hub id")
        raw = json.loads(f.read_text())
        model_type = raw.pop("model_type", None)
        if model_type is None:
            raise ModelError(f"{f}: has no model_type; it is not a transformers config.json")
        return AutoConfig.for_model(model_type, **raw)
    try:
        return AutoConfig.from_pretrained(mc.name, trust_remote_code=mc.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"model.name: cannot load a config for {mc.name!r} ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0]}). Give a local directory written by save_pretrained, a hub id "
            f"reachable from this machine, or set model.source: random with an architecture in "
            f"configs/models") from None


def tokenizer_path(mc: ModelConfig) -> str:
    if mc.tokenizer:
        return mc.tokenizer
    if mc.source == "pretrained":
        return mc.name
    return str(BYTE_TOKENIZER)


def load_tokenizer(mc: ModelConfig):
    from transformers import AutoTokenizer

    path = tokenizer_path(mc)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=mc.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"model.tokenizer: cannot load a tokenizer from {path!r} ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0]}); set model.tokenizer to a directory with tokenizer files") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def check_vocab(tokenizer, model_config) -> None:
    """Refuse a tokenizer whose ids do not fit the model's embedding table."""
    n = len(tokenizer)
    if n > model_config.vocab_size:
        raise ModelError(
            f"tokenizer has {n} tokens but the model's vocab_size is {model_config.vocab_size}; "
            f"use the model's own tokenizer (model.tokenizer: null) or a model with a larger vocabulary")


def build_model(mc: ModelConfig, attn_implementation: str, dtype):
    """Instantiate the causal LM: random init from its config, or weights via from_pretrained.

    Under ZeRO-3 call this inside `deepspeed.zero.Init` so that parameters are partitioned as
    they are created and the full model never sits on one device.
    """
    from transformers import AutoModelForCausalLM

    if mc.source == "random":
        config = load_model_config(mc)
        config._attn_implementation = attn_implementation
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation,
            trust_remote_code=mc.trust_remote_code)
    try:
        return AutoModelForCausalLM.from_pretrained(
            mc.name, dtype=dtype, attn_implementation=attn_implementation,
            trust_remote_code=mc.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"model.name: cannot load weights from {mc.name!r} ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0]})") from None
