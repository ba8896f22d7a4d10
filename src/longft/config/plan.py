"""artifacts/plan.json as a typed, frozen `Plan`.

The patch stage writes the plan (`run.patch_stage.make_plan`: every `auto` resolved with its reason,
the modules the patches replace, the architecture numbers, the memory estimate); the train stage,
every rank, the host-RAM pre-flight check and the metrics stage read it back through `Plan.read()`.

`Plan.from_dict()` is the one place that knows the file's shape, including what older longft
versions wrote. A plan from before a knob existed gets what the code did then:
    resolved.sdpa_backend           "default"  (PyTorch picked the SDPA kernel itself)
    resolved.tiled_mlp              False      (no tiled MLP)
    resolved.host_grad_buffer       "full"     (DeepSpeed's own host gradient buffer)
    resolved.quantize               "none"     (base weights in the training dtype)
    resolved.copy_back              "deepspeed" (DeepSpeed's own copy of the updated weights)
    resolved.overlap_step           "off"      (DeepSpeed's step as it is)
    patches.attention_kept_layers   0          (no attention output kept)
    memory_estimate.estimate        None       (no prediction: the host-RAM check is skipped)
Anything else missing, of the wrong type or unknown raises one `PlanFileError` that lists every
problem, names the file and says to re-run the patch stage. `to_dict()` gives back the dict it
was made from (same keys, same order), so a file read and written again is unchanged.

Parts that consumers pass on without looking inside (params, hardware, batch, the architecture
numbers, the estimator's itemised estimate) stay mappings, made read-only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, TypeVar, get_args, get_type_hints

from longft.config.params import ConfigError

T = TypeVar("T")


class PlanFileError(ConfigError):
    """artifacts/plan.json is missing, unreadable or not a plan this code can read."""

    def __init__(self, problems: list[str], source: str = "artifacts/plan.json"):
        super().__init__(problems, source)
        self.args = (f"{self.args[0]}\nre-run `dvc repro patch` to write it again",)


@dataclass(frozen=True)
class Choice(Generic[T]):
    """One resolved knob: its value and why (`hardware.resolve` makes them)."""

    value: T
    reason: str


OLDER = "not in this plan (written before the knob existed)"


@dataclass(frozen=True)
class Resolved:
    """What every `auto` resolved to on the patch stage's machine, in `hardware.resolve`'s order."""

    device: Choice[str]
    """cuda | cpu (DeepSpeed's CPU accelerator with gloo)."""
    precision: Choice[str]
    """bf16 | fp16 | fp32."""
    attention: Choice[str]
    """kernels.attention: flash_attention_2 | sdpa | flash_attn_4 | eager (flash_attn_4 builds on
    sdpa and installs longft's attention function over it)."""
    sdpa_backend: Choice[str]
    """The pinned SDPA kernel order: default (PyTorch's own) | flash | cudnn | efficient | math."""
    packed_attention: Choice[str]
    """Attention over rows of several documents: none (one document a row) | varlen |
    per_document | flash_attn_4 (longft's attention function, model/packed_attention.py) | flash_attention_2
    (its own variable-length path) | mask (transformers' dense block mask)."""
    liger: Choice[bool]
    """Liger kernels (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy)."""
    tiled_mlp: Choice[bool]
    """The MLP runs over tiles of kernels.tiled_mlp_tokens tokens."""
    checkpointing: Choice[str]
    """none | gpu | cpu_offload."""
    host_grad_buffer: Choice[str]
    """full (DeepSpeed's host gradient buffer) | shared (one slot for all sub-groups)."""
    quantize: Choice[str]
    """The frozen base weights of a LoRA run: none (training dtype) | nf4 | int8 (bitsandbytes);
    the reason says which ZeRO stage QLoRA runs on and why."""
    copy_back: Choice[str]
    """How the ZeRO-3 step brings the updated fp32 master weights from the host into the GPU's
    partitions: chunked (engine/param_copy_back.py) | deepspeed (its own copy)."""
    overlap_step: Choice[str]
    """on: the optimizer step's sub-groups update during the next forward (engine/overlap_step.py)
    | off: DeepSpeed's step as it is."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "artifacts/plan.json") -> Resolved:
        """From plan.json's {knob: {"value", "reason"}}, `hardware.resolve`'s {knob: Choice} or
        plain {knob: value}; knobs newer than the plan take OLDER_DEFAULTS."""
        problems: list[str] = []
        out = _resolved(d, "resolved", problems)
        if problems:
            raise PlanFileError(problems, source)
        return out

    def items(self) -> Iterator[tuple[str, Choice]]:
        """(knob, Choice) in resolve order."""
        for f in dataclasses.fields(self):
            yield f.name, getattr(self, f.name)

    def to_dict(self) -> dict[str, dict]:
        return {k: {"value": c.value, "reason": c.reason} for k, c in self.items()}


OLDER_DEFAULTS: Mapping[str, Choice] = MappingProxyType({
    "sdpa_backend": Choice("default", f"{OLDER}: PyTorch's own SDPA kernel choice"),
    "packed_attention": Choice("mask", f"{OLDER}: transformers' dense block mask"),
    "tiled_mlp": Choice(False, f"{OLDER}: off"),
    "host_grad_buffer": Choice("full", f"{OLDER}: DeepSpeed's full host gradient buffer"),
    "quantize": Choice("none", f"{OLDER}: base weights in the training dtype"),
    "copy_back": Choice("deepspeed", f"{OLDER}: DeepSpeed's own copy of the updated weights"),
    "overlap_step": Choice("off", f"{OLDER}: DeepSpeed's step as it is"),
})
"""The knobs a plan can lack, and what the code did before each existed."""


@dataclass(frozen=True)
class ModelInfo:
    """plan.json "model": which model, and its parameter counts."""

    name: str
    source: str
    """random | pretrained."""
    n_params: int
    n_trainable: int
    """All parameters without LoRA; the adapters' parameters with it."""


@dataclass(frozen=True)
class Patches:
    """What `model.patches.apply` recorded on the meta-device model; the train stage checks that
    the real model gets the same replacements."""

    replaced_modules: Mapping[str, int]
    """"OldClass->NewClass": count."""
    attention_kept_layers: int
    """Layers whose attention output survives the recompute (checkpointing.keep_attention)."""
    record: Mapping[str, Any]
    """The whole record as written (forward, rotary, loss, kernels, ...)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """plan.json "memory_estimate"."""

    model_states_bytes: Mapping[str, int]
    """weights, gradients, optimizer (all ranks together)."""
    estimate: Mapping[str, Any] | None
    """The itemised estimate (`estimate.format.to_dict`); None in plans older than the estimator."""
    note: str

    @property
    def host_rss_bytes(self) -> int | None:
        """Predicted peak process-tree RSS of a node; None when the plan has no host estimate."""
        host = (self.estimate or {}).get("host")
        rss = host.get("rss_bytes") if isinstance(host, Mapping) else None
        return int(rss) if isinstance(rss, (int, float)) and not isinstance(rss, bool) else None

    @property
    def host_items(self) -> tuple[Mapping[str, Any], ...]:
        """The host estimate's items ({"name", "bytes", ...}); () when there is none."""
        host = (self.estimate or {}).get("host")
        return tuple(host.get("items", ())) if isinstance(host, Mapping) else ()


@dataclass(frozen=True)
class Plan:
    """artifacts/plan.json; fields in the file's key order."""

    config: Mapping[str, Any]
    """The params the plan was made from (`config.params.to_dict`)."""
    hardware: Mapping[str, Any]
    """The machine the knobs were resolved on (`hardware.Hardware.to_dict`)."""
    resolved: Resolved
    model_config: Mapping[str, Any]
    """Architecture numbers (`model.architecture`): FLOPs per token, the estimator."""
    model: ModelInfo
    patches: Patches
    batch: Mapping[str, Any]
    """world_size, micro/global batch size, grad_accum_steps, seq_len, tokens_per_step."""
    memory_estimate: MemoryEstimate

    @classmethod
    def read(cls, path: str | Path) -> Plan:
        """Read plan.json; PlanFileError (naming `path`) if it is missing, corrupt or misshapen."""
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise PlanFileError(["the file does not exist"], str(path)) from None
        except OSError as e:
            raise PlanFileError([f"cannot be read ({e.strerror or e})"], str(path)) from None
        try:
            d = json.loads(text)
        except ValueError as e:
            raise PlanFileError([f"is not valid JSON ({e}); was the write cut short?"],
                                str(path)) from None
        return cls.from_dict(d, str(path))

    @classmethod
    def from_dict(cls, d: Any, source: str = "artifacts/plan.json") -> Plan:
        """From make_plan's dict (or plan.json's); every problem is reported at once."""
        if not isinstance(d, Mapping):
            raise PlanFileError([f"expected a JSON object, got {type(d).__name__}"], source)
        problems: list[str] = []
        names = [f.name for f in dataclasses.fields(cls)]
        problems += [f"{k}: missing" for k in names if k not in d]
        problems += [f"{k}: unknown key" for k in d if k not in names]
        if problems:
            raise PlanFileError(problems, source)
        passed = {k: _mapping(d[k], k, problems)
                  for k in ("config", "hardware", "model_config", "batch")}
        plan = cls(**passed, resolved=_resolved(d["resolved"], "resolved", problems),
                   model=_model(d["model"], problems), patches=_patches(d["patches"], problems),
                   memory_estimate=_memory(d["memory_estimate"], problems))
        if problems:
            raise PlanFileError(problems, source)
        return plan

    def to_dict(self) -> dict[str, Any]:
        """The plan as plan.json holds it (plain dicts and lists)."""
        mem = self.memory_estimate
        memory = {"model_states_bytes": _thaw(mem.model_states_bytes),
                  **({"estimate": _thaw(mem.estimate)} if mem.estimate is not None else {}),
                  "note": mem.note}
        return {"config": _thaw(self.config), "hardware": _thaw(self.hardware),
                "resolved": self.resolved.to_dict(), "model_config": _thaw(self.model_config),
                "model": dataclasses.asdict(self.model), "patches": _thaw(self.patches.record),
                "batch": _thaw(self.batch), "memory_estimate": memory}


# -- reading the parts -------------------------------------------------------------------------

def _freeze(x: Any) -> Any:
    if isinstance(x, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


def _thaw(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _thaw(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [_thaw(v) for v in x]
    return x


def _mapping(x: Any, key: str, problems: list[str]) -> Mapping[str, Any]:
    if not isinstance(x, Mapping):
        problems.append(f"{key}: expected an object, got {type(x).__name__}")
        return MappingProxyType({})
    return _freeze(x)


def _typed(x: Any, want: type, key: str, problems: list[str]) -> Any:
    # bool is an int to isinstance; a count or a flag of the other kind is a misshapen file
    if not isinstance(x, want) or (want is int and isinstance(x, bool)):
        problems.append(f"{key}: expected {want.__name__}, got {x!r}")
    return x


def _knob_types() -> dict[str, type]:
    """knob -> the type of its value, from Resolved's annotations (Choice[str] -> str)."""
    return {k: get_args(t)[0] for k, t in get_type_hints(Resolved).items()}


def _resolved(x: Any, key: str, problems: list[str]) -> Resolved:
    if not isinstance(x, Mapping):
        problems.append(f"{key}: expected an object, got {type(x).__name__}")
        x = {}
    types = _knob_types()
    problems += [f"{key}.{k}: unknown knob" for k in x if k not in types]
    out = {}
    for k, want in types.items():
        if k not in x:
            if k in OLDER_DEFAULTS:
                out[k] = OLDER_DEFAULTS[k]
            else:
                problems.append(f"{key}.{k}: missing")
                out[k] = Choice(None, "")
            continue
        v = x[k]
        if isinstance(v, Mapping):  # plan.json
            if "value" not in v:
                problems.append(f"{key}.{k}: has no value")
            value, reason = v.get("value"), v.get("reason", "")
        elif isinstance(v, Choice):  # hardware.resolve
            value, reason = v.value, v.reason
        else:  # a plain value
            value, reason = v, ""
        out[k] = Choice(_typed(value, want, f"{key}.{k}.value", problems),
                        _typed(reason, str, f"{key}.{k}.reason", problems))
    return Resolved(**out)


def _model(x: Any, problems: list[str]) -> ModelInfo:
    m = _mapping(x, "model", problems)
    hints = get_type_hints(ModelInfo)
    problems += [f"model.{k}: unknown key" for k in m if k not in hints]
    missing = [k for k in hints if k not in m]
    problems += [f"model.{k}: missing" for k in missing]
    return ModelInfo(**{k: None if k in missing else _typed(m[k], t, f"model.{k}", problems)
                        for k, t in hints.items()})


def _patches(x: Any, problems: list[str]) -> Patches:
    record = _mapping(x, "patches", problems)
    replaced = record.get("replaced_modules")
    if not isinstance(replaced, Mapping):
        problems.append(f"patches.replaced_modules: expected an object, got {replaced!r}")
        replaced = MappingProxyType({})
    kept = _typed(record.get("attention_kept_layers", 0), int, "patches.attention_kept_layers",
                  problems)
    return Patches(replaced_modules=replaced, attention_kept_layers=kept, record=record)


def _memory(x: Any, problems: list[str]) -> MemoryEstimate:
    m = _mapping(x, "memory_estimate", problems)
    problems += [f"memory_estimate.{k}: unknown key" for k in m
                 if k not in ("model_states_bytes", "estimate", "note")]
    states = _mapping(m.get("model_states_bytes"), "memory_estimate.model_states_bytes", problems)
    est = m.get("estimate")
    if est is not None and not isinstance(est, Mapping):
        problems.append(f"memory_estimate.estimate: expected an object, got {type(est).__name__}")
        est = None
    return MemoryEstimate(model_states_bytes=states, estimate=est,
                          note=_typed(m.get("note", ""), str, "memory_estimate.note", problems))
