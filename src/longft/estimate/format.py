"""An Estimate as text and as JSON: the one-line description, the itemised table and to_dict()."""

from __future__ import annotations

import dataclasses

from longft.estimate.types import (
    CUDA_CONTEXT_BYTES,
    DS_SUB_GROUP_SIZE,
    GIB,
    HOST_PHASES,
    LAUNCHER_BASE_BYTES,
    PHASES,
    RANK_BASE_BYTES,
    SETUP_LAUNCHER_BYTES,
    SETUP_RANK_BYTES,
    Estimate,
    Fit,
    Setup,
    reserved_factor,
)


def gib(n: float) -> float:
    """Bytes as GiB, rounded to 3 places (the *_gib fields)."""
    return round(n / GIB, 3)


def setup_from_dict(d: dict) -> Setup:
    """The Setup of to_dict()'s "setup" (plan.json's estimate): fields a newer Setup added keep
    their defaults, keys an older one had and this one lacks are ignored, lists become tuples."""
    names = {f.name for f in dataclasses.fields(Setup)}
    return Setup(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def to_dict(est: Estimate) -> dict:
    """JSON-able form: bytes and GiB, every item with its formula."""
    def items(where):
        return [{"name": i.name, "bytes": i.bytes, "gib": gib(i.bytes), "phases": list(i.phases),
                 "formula": i.formula} for i in est.items if i.where == where]
    return {
        "setup": dataclasses.asdict(est.setup),
        "gpu": {"allocated_bytes": est.gpu_allocated, "allocated_gib": gib(est.gpu_allocated),
                "reserved_bytes": est.gpu_reserved, "reserved_gib": gib(est.gpu_reserved),
                "nvml_bytes": est.gpu_nvml, "nvml_gib": gib(est.gpu_nvml),
                "peak_phase": est.gpu_peak_phase,
                "phases_bytes": dict(est.gpu_phases), "items": items("gpu")},
        "host": {"rss_bytes": est.host_rss, "rss_gib": gib(est.host_rss),
                 "peak_moment": est.host_peak_moment, "items": items("host")},
        **({"disk": {"bytes": est.disk_bytes, "gib": gib(est.disk_bytes), "items": items("disk")}}
           if est.disk_bytes else {}),
        "constants": {"reserved_factor": reserved_factor(est.setup.expandable_segments),
                      "cuda_context_bytes": CUDA_CONTEXT_BYTES,
                      "rank_base_bytes": RANK_BASE_BYTES, "launcher_base_bytes": LAUNCHER_BASE_BYTES,
                      "setup_rank_bytes": SETUP_RANK_BYTES,
                      "setup_launcher_bytes": SETUP_LAUNCHER_BYTES},
        "per": "gpu: one rank (the largest); host: one node (launcher + its ranks)",
        "doc": "docs/estimator.md",
    }


def describe(s: Setup) -> str:
    """One line: what the estimate is for."""
    groups = f", sub-groups {s.sub_group_size:,}" if s.sub_group_size != DS_SUB_GROUP_SIZE else ""
    opt = "optimizer" + (f"(nvme{groups})" if s.nvme else f"(ratio {s.offload_ratio:g})"
                         if s.offload_ratio < 1 else "")
    off = "+".join(n for n, on in ((opt, s.offload_optimizer), ("params", s.offload_param))
                   if on) or "none"
    if s.optimizer_states == "bf16":
        off += ", bf16 optimizer states"
    attn = s.attention + (f"({s.sdpa_backend})" if s.attention == "sdpa" else "")
    where = "" if s.device == "cuda" else " on CPU (GPU items = the rank's tensors in host RAM)"
    sp = (f" (each sequence over {s.sequence_parallel}: Ulysses)" if s.sequence_parallel > 1
          else "")
    return (f"seq {s.seq_len:,} x micro-batch {s.micro_batch}, {s.world_size} rank(s){sp}{where}, "
            f"{s.precision}, {attn}, Liger {'on' if s.liger else 'off'}, checkpointing "
            f"{s.checkpointing}, ZeRO-{s.zero_stage} offload {off}"
            + (f", {'QLoRA ' + s.quantize if s.quantize != 'none' else 'LoRA'} r={s.lora_rank}"
               if s.lora_rank else "")
            + (f", optimizer {s.optimizer}" if s.optimizer != "adamw" else ""))


def unmeasured(s: Setup) -> list[str]:
    """Notes for the parts of a setup that no measured row has checked yet (QLoRA, 8-bit Adam)."""
    out = []
    if s.quantize != "none":
        out.append(f"QLoRA ({s.quantize}, ZeRO-2): the quantized weights are bitsandbytes' own bytes"
                   + ("; the activations carry a surplus measured on one 8B row, not yet attributed"
                      if s.quantize == "nf4" else "; int8 has no measured row")
                   + "; the host build and the speed are unmeasured")
    if s.optimizer != "adamw":
        out.append(f"{s.optimizer}: 8-bit Adam states at bitsandbytes' own bytes, unmeasured"
                   + ("; paged states may spill to the host, counted on the GPU"
                      if s.optimizer.startswith("paged") else ""))
    return out


def format_table(est: Estimate, fit: Fit | None = None) -> str:
    """The itemised table: GPU items (per rank) with the phases they live in, host items (per
    node), the totals per phase and the predicted torch/NVML/RSS peaks."""
    lines = [describe(est.setup), "",
             f"{'GPU, per rank':48s} {'GiB':>9s}  {'live in':18s} formula"]
    for i in est.gpu_items():
        if i.bytes:
            ph = "all" if i.phases == PHASES else ",".join(i.phases)
            lines.append(f"  {i.name:46s} {i.bytes / GIB:9.3f}  {ph:18s} {i.formula}")
    lines.append("  by phase: " + " | ".join(
        f"{p} {est.gpu_phases[p] / GIB:.3f}" + (" <- peak" if p == est.gpu_peak_phase else "")
        for p in PHASES))
    lines += [f"{'host, per node':48s} {'GiB':>9s}"]
    for i in est.host_items():
        ph = "all" if i.phases == HOST_PHASES else ",".join(i.phases)
        lines.append(f"  {i.name:46s} {i.bytes / GIB:9.3f}  {ph:18s} {i.formula}")
    lines.append("  by moment: " + " | ".join(
        f"{p} {est.host_moments[p] / GIB:.3f}" + (" <- peak" if p == est.host_peak_moment else "")
        for p in HOST_PHASES))
    for i in est.items:
        if i.where == "disk":
            lines.append(f"{'disk (zero.nvme_path), per node':48s} {'GiB':>9s}")
            lines.append(f"  {i.name:46s} {i.bytes / GIB:9.3f}  {'all':18s} {i.formula}")
    lines += ["",
              f"peak VRAM (torch max allocated)   {est.gpu_allocated / GIB:9.3f} GiB  [{est.gpu_peak_phase}]",
              f"VRAM reserved (x {reserved_factor(est.setup.expandable_segments)})          "
              f"{est.gpu_reserved / GIB:9.3f} GiB",
              f"VRAM used, NVML (+ context)       {est.gpu_nvml / GIB:9.3f} GiB",
              f"peak DRAM (process-tree RSS)      {est.host_rss / GIB:9.3f} GiB  [{est.host_peak_moment}]"]
    if fit is not None:
        lines.append("")
        lines += [f"{r}" for r in fit.reasons]
        verdict = {True: "fits", False: "does NOT fit", None: "not checked"}
        lines.append(f"verdict: GPU {verdict[fit.gpu_ok]}, host {verdict[fit.host_ok]}"
                     + (f", disk {verdict[fit.disk_ok]}" if est.disk_bytes else ""))
    return "\n".join(lines)
