"""Model and tokenizer loading: random init from an architecture config, or real weights.

Random init (`model.source: random`) exists for memory and speed studies only: no download, same
shapes. `model.source: pretrained` goes through `from_pretrained` on a hub id or a local directory;
both paths return the same kind of object and are trained by the same code.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from longft.compat import transformers as tf_compat
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


def _refuse_remote_code(e: Exception, key: str, name: str) -> None:
    """Raise the fix when transformers refused `name` for needing its own code. longft always
    passes trust_remote_code explicitly (never None), so transformers never stops at its
    interactive "Do you wish to run the custom code? [y/N]" prompt inside a stage."""
    if isinstance(e, ValueError) and "trust_remote_code" in str(e):
        raise ModelError(
            f"{key}: {name!r} contains custom code (an auto_map in its config) that must run to "
            f"load it; if you trust that code, set model.trust_remote_code: true (it then runs in "
            f"every stage)") from None


def _validation_problem(e: Exception) -> str:
    """One line from huggingface_hub's strict-dataclass error: the field and what is wrong."""
    cause = e.__cause__ or getattr(e, "cause", None)  # its text names the field
    return (str(cause) if cause is not None else str(e).splitlines()[-1].strip()).rstrip(".")


def _architecture_config(f: Path):
    """A transformers config from an architecture config.json, with every failure a ModelError."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        raw = json.loads(f.read_text())
    except ValueError as e:
        raise ModelError(f"{f}: not valid JSON ({e}); fix the file") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{f}: expected a JSON object of config fields, got {type(raw).__name__}")
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ModelError(f"{f}: has no model_type; it is not a transformers config.json")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING), n=3)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise ModelError(
            f"{f}: model_type {model_type!r} is not an architecture this transformers knows"
            f"{hint}; fix model_type, or, for a model with its own code, set model.source: "
            f"pretrained with model.trust_remote_code: true")
    try:
        return AutoConfig.for_model(model_type, **raw)
    except StrictDataclassError as e:  # transformers' configs check each field's type and range
        raise ModelError(f"{f}: {_validation_problem(e)}; fix it in that file (fields and types "
                         f"as in transformers' {CONFIG_MAPPING[model_type].__name__})") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{f}: transformers refuses this {model_type} config "
                         f"({e.__class__.__name__}: {str(e).splitlines()[0]}); fix the file") from None


def _folders(d: Path) -> list[str]:
    try:
        return sorted(e.name for e in d.iterdir() if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return []


TYPO_RATIO = 0.9
"""How alike (difflib's ratio) a missing `owner/name` and a folder in a local `owner/` must be for
the name to be read as that folder mistyped (`my-lama`/`my-llama` 0.93; `Llama-3.2-1B`/`Llama-3.1-8B`
0.83, two hub models)."""


def _typo_of(name: str, folder: str) -> bool:
    """`name` reads as `folder` mistyped: alike, but not a sibling that differs in its numbers only
    (`Llama-3.2-3B` beside a downloaded `Llama-3.2-1B`, `Qwen2.5-7B` beside `Qwen2.5-3B`: other
    sizes or versions of one family, hub ids)."""
    def letters(s: str) -> str:
        return re.sub(r"[0-9]+", "#", s)
    return letters(name) != letters(folder)


def check_local(name: str, key: str) -> None:
    """Refuse at once (ModelError) a model or tokenizer name that is meant as a local path and does
    not exist, with what its folder holds and the closest name there. A name is meant as a local
    path when it starts with `.`, `/` or `~` or has more than one `/`. `owner/name` is a hub id
    unless a folder `owner/` exists here holding a near twin of `name` (`models/my-lama` where
    `models/my-llama` is: a typo, SequenceMatcher ratio >= TYPO_RATIO); with a folder `owner/`
    of other models (`meta-llama/Llama-3.1-8B` downloaded, `meta-llama/Llama-3.2-1B` asked), or of
    siblings that differ in numbers only (`Llama-3.2-1B` downloaded, `Llama-3.2-3B` asked), it is
    still a hub id. Hub ids are left to from_pretrained (which retries huggingface.co for ~25 s
    before it fails: never for a local typo)."""
    p = Path(name)
    marked = name.startswith((".", "/", "~")) or len(p.parts) > 2  # a hub id is [owner/]name
    if p.exists() or not (marked or (len(p.parts) == 2 and p.parent.is_dir())):
        return
    if not marked and not any(_typo_of(p.name, d) for d in difflib.get_close_matches(
            p.name, _folders(p.parent), n=3, cutoff=TYPO_RATIO)):
        return  # owner/ exists here, but nothing in it is this name mistyped: a hub id
    full = p.expanduser()
    if full.exists():  # transformers reads "~/x" as a hub id: it does not expand ~
        raise ModelError(f"{key}: {name!r}: transformers does not expand '~'; write it as {full}")
    folder = full.parent
    while folder != folder.parent and not folder.is_dir():  # "." and "/" end the walk
        folder = folder.parent
    missing = full.parts[len(folder.parts)]
    dirs = _folders(folder)
    held = (", ".join(dirs[:12]) + (f", and {len(dirs) - 12} more" if len(dirs) > 12 else "")
            if dirs else "no folder")
    close = difflib.get_close_matches(missing, dirs, n=1)
    guess = (f"; did you mean {Path(folder, close[0], *full.parts[len(folder.parts) + 1:])}?"
             if close else "")
    why = "" if marked else (f" (read as a local path: {p.parent}/ exists here and holds a near "
                             f"twin; for the hub model of that name, run from another directory)")
    shown = str(folder).rstrip("/") + "/"
    raise ModelError(f"{key}: no directory {name} ({shown} holds: {held}){guess}{why}; give the "
                     f"directory written by save_pretrained, or a hub id")


def load_model_config(mc: ModelConfig):
    """The transformers config of the model (no weights are read)."""
    if mc.source == "random":
        f = _architecture_file(mc.name)
        if f is None:
            raise ModelError(
                f"model.name: {mc.name!r} is neither a file in configs/models "
                f"({', '.join(shipped_architectures())}) nor a path to a config.json; "
                f"pick one of those or set model.source: pretrained for a hub id")
        return _architecture_config(f)
    check_local(mc.name, "model.name")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(mc.name, trust_remote_code=mc.trust_remote_code)
    except StrictDataclassError as e:
        raise ModelError(f"model.name: the config.json of {mc.name!r} is invalid: "
                         f"{_validation_problem(e)}; fix it in that file") from None
    except (OSError, ValueError) as e:
        _refuse_remote_code(e, "model.name", mc.name)
        raise ModelError(
            f"model.name: cannot load a config for {mc.name!r} ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0]}). Give a local directory written by save_pretrained, a hub id "
            f"reachable from this machine, or set model.source: random with an architecture in "
            f"configs/models") from None
    check_weights(mc.name)  # prepare and patch read this config: a broken shard stops them
    return config


INDEX = "model.safetensors.index.json"


def _shard_keys(f: Path) -> set[str]:
    """The tensor names in a safetensors file's header (the header only: nothing is loaded)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), "pt") as h:
            return set(h.keys())
    except (SafetensorError, OSError) as e:
        raise ModelError(f"model.name: {f} is not a readable safetensors file ({e}); download "
                         "or save the model again (a copy cut short or an HTML error page "
                         "saved as weights looks like this)") from None


def check_weights(name: str) -> None:
    """For a local model directory: every safetensors shard has a valid header that covers the
    whole file, and the index (model.safetensors.index.json) names only shards that exist and
    tensors that are in them. Raises ModelError naming the file, before any rank starts (a
    broken shard used to surface as a traceback on rank 0 after prepare and patch had passed).
    Hub ids are left to from_pretrained, which downloads and checks them."""
    d = Path(name)
    if not d.is_dir():
        return
    index = d / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"model.name: {index} is not a valid safetensors index ({type(e).__name__}: "
                             f"{e}); download or save the model again") from None
        by_shard: dict[str, set[str]] = {}
        for tensor, shard in weight_map.items():
            by_shard.setdefault(str(shard), set()).add(tensor)
        missing = sorted(s for s in by_shard if not (d / s).is_file())
        if missing:
            raise ModelError(f"model.name: {index} names shards that are not in {d}: "
                             f"{', '.join(missing)}; download or save the model again")
        for shard, tensors in sorted(by_shard.items()):
            absent = sorted(tensors - _shard_keys(d / shard))
            if absent:
                raise ModelError(
                    f"model.name: {d / shard} lacks {len(absent)} tensor(s) that {INDEX} puts in "
                    f"it (e.g. {absent[0]}); the shards and the index are of different saves: "
                    "download or save the model again")
        return
    for f in sorted(d.glob("*.safetensors")):
        _shard_keys(f)


def tokenizer_path(mc: ModelConfig) -> str:
    if mc.tokenizer:
        return mc.tokenizer
    if mc.source == "pretrained":
        return mc.name
    return str(BYTE_TOKENIZER)


def load_tokenizer(mc: ModelConfig):
    from transformers import AutoTokenizer

    path = tokenizer_path(mc)
    check_local(path, "model.tokenizer" if mc.tokenizer else "model.name")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=mc.trust_remote_code)
    except (OSError, ValueError) as e:
        _refuse_remote_code(e, "model.tokenizer", path)
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


_SCALED_ROPE = ("linear", "dynamic", "yarn")
"""RoPE scalings whose configs keep the pre-scaling max_position_embeddings: the positions reach
factor x original (llama3 and longrope configs already state the scaled length)."""


def position_limit(model_config) -> int | None:
    """The longest sequence the model's positions cover, or None when its config does not say."""
    n = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(n, int):
        return None
    rope = getattr(model_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    factor = rope.get("factor") if kind in _SCALED_ROPE else None
    if isinstance(factor, (int, float)) and factor > 1:
        base = rope.get("original_max_position_embeddings") or n
        return max(n, int(factor * base))
    return n


def check_context_length(model_config, max_seq_length: int, name: str) -> None:
    """Refuse a data.max_seq_length the model's positions do not cover, before any sample of that
    length is generated or allocated."""
    limit = position_limit(model_config)
    if limit is not None and max_seq_length > limit:
        raise ModelError(
            f"data.max_seq_length ({max_seq_length}) is longer than the {limit} positions model "
            f"{name!r} covers (max_position_embeddings {model_config.max_position_embeddings}); "
            f"lower data.max_seq_length to at most {limit}, or use a model with longer positions "
            f"or RoPE scaling (rope_scaling with rope_type yarn/linear/dynamic and a factor in its "
            f"config.json)")


def transformers_attention(attention: str) -> str:
    """The attn_implementation transformers builds the model with for a resolved kernels.attention:
    flash_attn_4 is longft's attention function, installed over SDPA by model/patches.py."""
    return "sdpa" if attention == "flash_attn_4" else attention


def build_model(mc: ModelConfig, attn_implementation: str, dtype):
    """Instantiate the causal LM: random init from its config, or weights via from_pretrained.

    Under ZeRO-3 call this inside `deepspeed.zero.Init` so that parameters are partitioned as
    they are created and the full model never sits on one device.
    """
    from transformers import AutoModelForCausalLM

    attn_implementation = transformers_attention(attn_implementation)
    if mc.source == "random":
        config = load_model_config(mc)
        tf_compat.set_attn_implementation(config, attn_implementation)
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation,
            trust_remote_code=mc.trust_remote_code)
    check_local(mc.name, "model.name")
    try:
        return AutoModelForCausalLM.from_pretrained(
            mc.name, dtype=dtype, attn_implementation=attn_implementation,
            trust_remote_code=mc.trust_remote_code)
    except (OSError, ValueError) as e:
        _refuse_remote_code(e, "model.name", mc.name)
        raise ModelError(
            f"model.name: cannot load weights from {mc.name!r} ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0]})") from None
