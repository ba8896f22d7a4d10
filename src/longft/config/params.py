"""params.yaml -> frozen, typed configuration.

Every knob of a run lives in params.yaml, one section per concern, as a frozen dataclass
(`sections`). `load()` reads the file, checks every key, type, range and combination (`checks`),
and raises one `ConfigError` that lists *all* problems at once, before any model, data or GPU work
starts. Code reads the config only through these dataclasses; this module re-exports them, so
`from longft.config.params import Config` is the one import a reader needs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import yaml

from longft.config import checks
from longft.config.sections import (
    NOTHING_TO_TRACK,
    CheckpointingConfig,
    Config,
    DataConfig,
    HardwareConfig,
    KernelsConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
    TrackConfig,
    TrainConfig,
    ZeroConfig,
)
from longft.config.typed_yaml import DuplicateKeyError, build_dataclass, load_yaml
from longft.errors import ProblemsError

__all__ = ["ConfigError", "from_dict", "load", "merge", "to_dict", "Config", "ModelConfig",
           "DataConfig", "KernelsConfig", "CheckpointingConfig", "HardwareConfig", "TrainConfig",
           "OptimConfig", "ZeroConfig", "LoraConfig", "OutputConfig", "TrackConfig",
           "NOTHING_TO_TRACK"]


class ConfigError(ProblemsError, ValueError):
    """One or more problems in params.yaml; the message lists each with its key and a fix."""

    def __init__(self, problems: list[str], source: str = "params.yaml"):
        super().__init__(problems, source)


# --------------------------------------------------------------------------- parsing


def from_dict(raw: dict, source: str = "params.yaml") -> Config:
    """Build and validate a Config from a params mapping; raise ConfigError listing every problem."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise ConfigError([f"top level: expected a mapping of sections, got {type(raw).__name__}"],
                          source)
    cfg = build_dataclass(Config, raw, "", problems)
    # Fields with a bad type fell back to their (valid) defaults, so range and combination
    # checks still run and everything wrong is reported in one go.
    problems += checks.problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load(path: str | Path = "params.yaml", overrides: Optional[dict] = None) -> Config:
    """Read params.yaml (optionally deep-merged with `overrides`) into a validated Config."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: file not found; run from the repository root or pass its path"],
                          str(path))
    try:
        raw = load_yaml(path.read_text())
    except DuplicateKeyError as e:
        raise ConfigError([e.problem], str(path)) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {e}"], str(path)) from None
    if raw is None:  # empty or only comments; an explicit `{}` still means "all defaults"
        raise ConfigError([f"{path} is empty; copy the shipped params.yaml (`git show "
                           f"HEAD:params.yaml > {path}`) and edit it, or write `{{}}` to run on "
                           f"the defaults"], str(path))
    if overrides:
        raw = merge(raw, overrides)
    return from_dict(raw, str(path))


def merge(base: dict, over: dict) -> dict:
    """Deep-merge two params mappings (over wins); neither input is modified."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def to_dict(cfg: Config) -> dict:
    """Plain dict (lists instead of tuples) of a Config, for plan.json and logs."""
    def conv(x):
        if isinstance(x, tuple):
            return [conv(v) for v in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x
    return conv(dataclasses.asdict(cfg))


def section_digests(cfg: Config) -> dict[str, str]:
    """A short digest of each params section as validated (defaults filled in, so writing a
    default out changes none): a run records them (metrics/env.json, export/longft_export.json),
    and `longft report` and `longft generate` compare them with the params of today."""
    import hashlib
    import json

    return {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:12]
            for k, v in to_dict(cfg).items()}


def sections_changed(recorded: dict | None, cfg: Config) -> list[str]:
    """The params sections whose digest differs from `recorded` (section_digests of a run); []
    where nothing was recorded (a run written before the digests)."""
    if not isinstance(recorded, dict) or not recorded:
        return []
    return [k for k, v in section_digests(cfg).items() if recorded.get(k) != v]
