"""The patch stage's check of every private access (compat/*.py) against the resolved knobs.

A knob resolved to a value that needs a missing internal is turned off with the reason where
params left it `auto`, and refused (one `PlanError` line naming the internal, the installed version
and the fix) where params set it. What has no "off" (the attention implementation every run reads,
QLoRA's bitsandbytes hooks, Ulysses, keep_attention (on varlen_attn's rows too), a partial
offload) refuses; what has a fallback of its own (clip_scale, the pinned-host cache's emptying) is
only recorded. plan.json's
`patches.compat` records each access checked: "ok" or why not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from longft.compat import Access, bitsandbytes, deepspeed, liger, torch, transformers, version
from longft.config.params import Config
from longft.config.plan import Choice

LIBRARIES = {"transformers": transformers, "torch": torch, "deepspeed": deepspeed, "liger-kernel": liger,
             "bitsandbytes": bitsandbytes}


@dataclass(frozen=True)
class Knob:
    """A resolved knob whose value `needs` uses the internals of `feature`; `off` runs without them
    (None: nothing does, so a missing internal refuses even under auto)."""

    feature: str
    param: str
    needs: Callable[[Choice], bool]
    off: object = None
    setting: Callable[[Config], str] = lambda cfg: ""


KNOBS = {
    "overlap_step": Knob("overlap_step", "zero.overlap_step", lambda c: c.value == "on", "off",
                         lambda cfg: cfg.zero.overlap_step),
    "copy_back": Knob("copy_back", "zero.copy_back", lambda c: c.value == "chunked", "deepspeed",
                      lambda cfg: cfg.zero.copy_back),
    "host_grad_buffer": Knob("host_grad_buffer", "zero.host_grad_buffer", lambda c: c.value == "shared",
                             "full", lambda cfg: cfg.zero.host_grad_buffer),
    "liger": Knob("liger", "kernels.liger", lambda c: c.value is True, False, lambda cfg: cfg.kernels.liger),
    "tiled_mlp": Knob("recompute_check", "kernels.tiled_mlp", lambda c: c.value is True, False,
                      lambda cfg: cfg.kernels.tiled_mlp),
    "checkpointing": Knob("checkpoint_function", "checkpointing.mode", lambda c: c.value == "cpu_offload",
                          "gpu", lambda cfg: cfg.checkpointing.mode),
    "quantize": Knob("quantize", "lora.quantize", lambda c: c.value != "none"),
}
"""Resolved knob -> what it needs; `auto` turns off, a value set in params refuses."""


def settings_needing(cfg: Config, choices: dict[str, Choice]) -> dict[str, str]:
    """Features that params (not a resolved knob) need, with the param that asks for them."""
    out = {"always": "the attention implementation (every run)"}
    if cfg.checkpointing.keep_attention > 0:
        out["keep_attention"] = "checkpointing.keep_attention"
        out["checkpoint_function"] = "checkpointing.keep_attention"
        if _value(choices, "packed_attention") == "varlen":  # keeps varlen_attn's kernel op too
            out["keep_attention_varlen"] = "checkpointing.keep_attention (on varlen_attn's packed rows)"
    if cfg.hardware.sequence_parallel > 1:
        out["sequence_parallel"] = "hardware.sequence_parallel"
    if cfg.zero.offload_ratio < 1:
        out["partial_offload"] = "zero.offload_ratio"
    if cfg.output.export and cfg.zero.stage == 3:
        out["export_zero3"] = "output.export (under zero.stage 3)"
    return out


RECORDED = frozenset({"clip_scale"})
"""Features with a fallback of their own (clip_scale falls back to DeepSpeed's clipping pass, the
same result): checked and recorded in plan.json, never refused."""

RECORDED_ON_CUDA = frozenset({"host_empty_cache"})
"""Recorded, never refused, on CUDA runs only: the trainer empties the pinned-host cache through
torch.accelerator.empty_host_cache where the private call is gone (the same allocator), and keeps
the cache where neither is there (more host RAM than the estimate; plan.json says why)."""


def _value(choices: dict[str, Choice], key: str):
    return choices[key].value if key in choices else None


def recorded(choices: dict[str, Choice]) -> frozenset[str]:
    """The features checked only to be recorded, for these resolved choices."""
    return RECORDED | (RECORDED_ON_CUDA if _value(choices, "device") == "cuda" else frozenset())


def accesses() -> tuple[tuple[str, Access], ...]:
    """(library, access) for every private access longft declares."""
    return tuple((lib, a) for lib, mod in LIBRARIES.items() for a in mod.ACCESSES)


def check(features: set[str] | None = None) -> dict[str, dict[str, str | None]]:
    """feature -> {access label: None (there) or why not}, for `features` (default all)."""
    out: dict[str, dict[str, str | None]] = {}
    for _, a in accesses():
        if features is None or a.feature in features:
            out.setdefault(a.feature, {})[a.label] = a.missing()
    return out


def _why(feature: str, found: dict[str, dict[str, str | None]]) -> str | None:
    gone = [why for why in found.get(feature, {}).values() if why]
    if not gone:
        return None
    lib = next(lib for lib, a in accesses() if a.feature == feature)
    return f"{'; '.join(gone)} in {lib} {version(lib)}"


def gate(cfg: Config, choices: dict[str, Choice]) -> tuple[dict[str, str], list[str]]:
    """Turn off (auto) or refuse (set in params) every knob whose internals are missing; change
    `choices` in place. Returns (plan.json's compat record, problems for one PlanError)."""
    asked = {k: kn for k, kn in KNOBS.items() if k in choices and kn.needs(choices[k])}
    direct = settings_needing(cfg, choices)
    found = check({kn.feature for kn in asked.values()} | set(direct) | recorded(choices))
    problems: list[str] = []
    for k, kn in asked.items():
        why = _why(kn.feature, found)
        if why is None:
            continue
        if kn.off is not None and kn.setting(cfg) == "auto":
            choices[k] = Choice(kn.off, f"auto: off, {why} (longft.compat)")
        else:
            fix = f"set {kn.param}: auto or {_off_word(kn.off)}" if kn.off is not None \
                else f"set {kn.param}: none"
            problems.append(_refusal(kn.param, choices[k].value, why, fix))
    for feature, param in direct.items():
        why = _why(feature, found)
        if why is not None:
            problems.append(_refusal(param, "", why, "install the version requirements/common.txt pins"))
    record = {label: why or "ok" for per in found.values() for label, why in per.items()}
    return dict(sorted(record.items())), problems


def _off_word(value) -> str:
    """A knob value as params.yaml spells it (True/False: on/off)."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _refusal(param: str, value, why: str, fix: str) -> str:
    what = f"{param}: {_off_word(value)}" if value != "" else param
    return (f"{what} needs a library internal that is not there: {why}. longft supports the "
            f"versions pyproject.toml declares (requirements/common.txt pins the tested ones); "
            f"install those, or {fix}")
