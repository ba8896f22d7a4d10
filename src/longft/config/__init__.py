"""params.yaml as typed, frozen dataclasses (`params`), read by a strict YAML loader (`typed_yaml`).
Every problem is reported at once, with the fix, before any model or GPU work. The patch stage's
artifacts/plan.json is read the same way, as a frozen `Plan` (`plan`)."""

from longft.config.params import (
                                  CheckpointingConfig,
                                  Config,
                                  ConfigError,
                                  DataConfig,
                                  HardwareConfig,
                                  KernelsConfig,
                                  LoraConfig,
                                  ModelConfig,
                                  OptimConfig,
                                  OutputConfig,
                                  TrainConfig,
                                  ZeroConfig,
                                  from_dict,
                                  load,
                                  merge,
                                  to_dict,
)
from longft.config.plan import Choice, Plan, PlanFileError, Resolved

__all__ = ["Config", "ConfigError", "load", "from_dict", "merge", "to_dict", "ModelConfig",
           "DataConfig", "KernelsConfig", "CheckpointingConfig", "HardwareConfig", "TrainConfig",
           "OptimConfig", "ZeroConfig", "LoraConfig", "OutputConfig", "Plan", "PlanFileError",
           "Resolved", "Choice"]
