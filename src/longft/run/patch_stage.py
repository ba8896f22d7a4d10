"""The patch stage's work: resolve params against the hardware, patch a meta-device model to record
what gets replaced, and produce artifacts/plan.json and artifacts/ds_config.json.
"""

from __future__ import annotations

from longft import hardware
from longft.compat import gate as compat
from longft.config import block_sparse
from longft.config.params import Config, to_dict
from longft.config.plan import Resolved
from longft.engine import ds_config
from longft.estimate.estimator import estimate_for_plan
from longft.hardware import nvme
from longft.model import patches as patch
from longft.model.architecture import architecture, is_lora_target
from longft.model.loading import check_context_length, load_model_config, transformers_attention


def meta_model(model_config, attention: str, trust_remote_code: bool = False):
    """The model on the meta device: shapes and modules, no memory, no weights read.
    trust_remote_code is always passed (None would ask on stdin for a custom-code model)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config,
                                                attn_implementation=transformers_attention(attention),
                                                trust_remote_code=trust_remote_code)


def sparse_trainable(cfg: Config, model) -> int:
    """Parameters block-sparse finetuning trains on the (meta) model; PlanError when sparse.*
    does not fit its linear layers."""
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features")}
    found = block_sparse.shape_problems(cfg, linears)
    if found:
        raise hardware.PlanError(found)
    hit = sum(1 for n in linears if n.rsplit(".", 1)[-1] in cfg.sparse.target_modules)
    return block_sparse.trainable(cfg, hit)


def model_state_bytes(n_params: int, n_trainable: int, precision: str, states: str = "fp32") -> dict:
    """Bytes of weights, gradients and Adam states (mixed precision: fp32 master + 2 moments;
    zero.optimizer_states bf16: bf16 master + 2 bf16 moments)."""
    w = 4 if precision == "fp32" else 2
    if states == "bf16":
        return {"weights": n_params * w, "gradients": n_trainable * w, "optimizer": n_trainable * 6}
    master = 0 if precision == "fp32" else 4
    return {"weights": n_params * w, "gradients": n_trainable * w,
            "optimizer": n_trainable * (master + 8)}


def lora_targets(model, names: tuple[str, ...], model_type: str) -> list:
    """The linear modules LoRA adapts: those whose last name part is in `names`. Every name must
    match one (a typo would otherwise silently train fewer modules than asked)."""
    linear = {n: m for n, m in model.named_modules() if hasattr(m, "in_features")}
    known = sorted({n.split(".")[-1] for n in linear})
    unmatched = [t for t in names if t not in known]
    if unmatched:
        which = "none" if len(unmatched) == len(names) else "some"
        raise hardware.PlanError([
            f"lora.target_modules: {which} of the names match a linear layer of {model_type}: "
            f"{unmatched} match nothing; its linear modules are {known}. Remove or correct "
            f"those names"])
    return [m for n, m in linear.items() if is_lora_target(n, names)]


def make_plan(cfg: Config, hw: hardware.Hardware) -> tuple[dict, dict]:
    """Return (plan, ds_config) for cfg on hw; raises PlanError/ModelError on impossible requests."""
    mc = load_model_config(cfg.model)
    check_context_length(mc, cfg.data.max_seq_length, cfg.model.name)
    arch = architecture(mc)
    choices = hardware.resolve(cfg, hw, mc.model_type, patch.attention_softcap(mc),
                               (arch["num_attention_heads"], arch["num_key_value_heads"]),
                               window=patch.attention_window(mc))
    # every private internal the resolved knobs need (longft.compat): auto off, or refuse
    compat_record, missing = compat.gate(cfg, choices)
    if missing:
        raise hardware.PlanError(missing)
    precision = choices["precision"].value
    model = meta_model(mc, choices["attention"].value, cfg.model.trust_remote_code)
    try:
        record = patch.apply_resolved(model, Resolved.from_dict(choices), cfg)
    except patch.PatchError as e:  # a knob this model or mode cannot take (patch checks it)
        raise hardware.PlanError([str(e)]) from None
    record["compat"] = compat_record
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.lora.rank > 0:
        targets = lora_targets(model, cfg.lora.target_modules, mc.model_type)
        n_trainable = sum(cfg.lora.rank * (m.in_features + m.out_features) for m in targets)
    elif cfg.sparse.blocks > 0:  # the targets' shapes, checked before any weight is read
        n_trainable = sparse_trainable(cfg, model)
    else:
        n_trainable = n_params
    states = model_state_bytes(n_params, n_trainable, precision, cfg.zero.optimizer_states)
    ds = ds_config.build(cfg, precision, arch["hidden_size"],
                         overlap_step=choices["overlap_step"].value == "on")
    est = estimate_for_plan(cfg, arch, choices, cfg.world_size)
    if cfg.zero.offload_optimizer == "nvme":   # the disk and libaio, before any rank starts
        found = nvme.problems(cfg.zero.nvme_path, est.get("disk", {}).get("bytes", 0))
        if found:
            raise hardware.PlanError(found)
    plan = {
        "config": to_dict(cfg),
        "hardware": hw.to_dict(),
        "resolved": {k: {"value": c.value, "reason": c.reason} for k, c in choices.items()},
        "model_config": arch,
        "model": {"name": cfg.model.name, "source": cfg.model.source, "n_params": n_params,
                  "n_trainable": n_trainable},
        "patches": record,
        "batch": {"world_size": cfg.world_size, "micro_batch_size": cfg.train.micro_batch_size,
                  "global_batch_size": cfg.train.global_batch_size,
                  "grad_accum_steps": cfg.grad_accum_steps, "seq_len": cfg.data.max_seq_length,
                  "tokens_per_step": cfg.tokens_per_step},
        "memory_estimate": {"model_states_bytes": states,
                            "estimate": est,
                            "note": "itemised peak VRAM per rank and DRAM per node; "
                                    "formulas in docs/estimator.md"},
    }
    return plan, ds
