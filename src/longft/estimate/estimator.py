"""Predict a run's memory before it runs: peak GPU memory per rank and peak host memory per node.

    from longft.estimate import Setup, estimate, format_table
    print(format_table(estimate(arch, Setup(micro_batch=4, seq_len=16384))))

`estimate(arch, setup)` is a pure function of the architecture numbers (`plan.architecture()`) and
a `Setup` (micro-batch, sequence length, ranks, precision, kernels, checkpointing, ZeRO placement).
It returns every item in bytes: model states, gathered parameters, activation checkpoints, the
working set of the one decoder layer being recomputed, the loss, DeepSpeed buffers and pinned host
buffers. The GPU peak is the largest of three moments of an iteration (end of the fused loss,
backward of the last decoder layer, optimizer step) and predicts torch's max allocated memory; the
host peak is the larger of the start-up peak and the steady state after the first optimizer step,
and predicts the process-tree RSS.

Every formula, where each tensor comes from (DeepSpeed 0.19 / torch 2.11 / transformers 5 / Liger
0.8 code paths) and the calibration on the H200 rows are in docs/estimator.md.

This module holds the entry points (estimate, setup_from_config, estimate_for_plan, compare, fits)
and re-exports the names of the pieces it is built from:
    estimate_types   Setup, Item, Estimate, Fit and the calibration constants
    estimate_arch    parameter counts, LoRA subset, ZeRO sub-groups and bucket sizes
    estimate_gpu     per-rank GPU items (model states, activations, loss)
    estimate_host    per-node host items (baseline, pinned-pool replay, CPU Adam)
    estimate_format  describe, format_table, to_dict
"""

from __future__ import annotations

from collections.abc import Mapping

from longft.config import qlora
from longft.config.plan import Resolved
from longft.estimate.arch import numbers, param_numels, sub_groups, zero_knobs
from longft.estimate.format import describe, format_table, gib, to_dict
from longft.estimate.gpu import gpu_activation_items, gpu_state_items, layer_activation_bytes, reuse_layers
from longft.estimate.host import disk_items, host_items, host_peak, pinned, pinned_pool
from longft.estimate.types import (
    CUDA_CONTEXT_BYTES,
    GIB,
    LAUNCHER_BASE_BYTES,
    PHASES,
    RANK_BASE_BYTES,
    SETUP_LAUNCHER_BYTES,
    SETUP_RANK_BYTES,
    Estimate,
    Fit,
    Item,
    Setup,
    reserved_factor,
)

__all__ = [
    # entry points
    "estimate", "setup_from_config", "estimate_for_plan", "compare", "fits",
    # estimate_types
    "GIB", "PHASES", "CUDA_CONTEXT_BYTES", "RANK_BASE_BYTES", "LAUNCHER_BASE_BYTES", "SETUP_RANK_BYTES",
    "SETUP_LAUNCHER_BYTES",
    "Setup", "Item", "Estimate", "Fit",
    # estimate_arch
    "param_numels", "sub_groups", "zero_knobs",
    # estimate_gpu, estimate_host
    "layer_activation_bytes", "reuse_layers", "pinned", "pinned_pool", "host_peak",
    # estimate_format
    "describe", "format_table", "to_dict",
]


def estimate(arch: dict, s: Setup) -> Estimate:
    """Itemised peak GPU memory per rank and host memory per node (bytes) for `s` on `arch`."""
    bad = s.problems()
    if bad:
        raise ValueError("; ".join(bad))
    n = numbers(arch, s)
    items = (gpu_state_items(arch, s, n) + gpu_activation_items(arch, s, n)
             + host_items(arch, s, n) + disk_items(s, n))
    phases = {p: sum(i.bytes for i in items if i.where == "gpu" and p in i.phases) for p in PHASES}
    peak_phase = max(PHASES, key=lambda p: phases[p])
    alloc = phases[peak_phase]
    if s.device == "cpu":    # no GPU: the "gpu" items are the rank's tensors, held in host memory
        items.append(Item("rank tensors (the GPU items, in host RAM)", "host",
                          s.ranks_per_node * alloc, ("steady",),
                          f"{s.ranks_per_node} rank(s) x the {peak_phase} total of the GPU items"))
        alloc = 0
    reserved = int(alloc * reserved_factor(s.expandable_segments))
    host_phase, host_totals = host_peak(items)
    return Estimate(setup=s, items=tuple(items), gpu_phases=phases, gpu_peak_phase=peak_phase,
                    gpu_allocated=alloc, gpu_reserved=reserved,
                    gpu_nvml=reserved + CUDA_CONTEXT_BYTES if s.device == "cuda" else 0,
                    host_rss=host_totals[host_phase], host_moments=host_totals,
                    host_peak_moment=host_phase)


def setup_from_config(cfg, resolved: Resolved | Mapping, world_size: int | None = None) -> Setup:
    """The Setup of a validated Config whose `auto` values were resolved: a Plan's `resolved`, or
    what `Resolved.from_dict` reads (hardware.resolve's Choices, plan.json's dicts, plain values)."""
    r = resolved if isinstance(resolved, Resolved) else Resolved.from_dict(resolved, "resolved")
    ws = world_size or cfg.world_size
    micro = cfg.train.micro_batch_size
    return Setup(
        micro_batch=micro, seq_len=cfg.data.max_seq_length, world_size=ws,
        device=r.device.value,
        ranks_per_node=max(1, min(cfg.hardware.num_gpus, ws)),
        precision=r.precision.value,
        attention=r.attention.value,
        sdpa_backend=r.sdpa_backend.value,
        liger=r.liger.value,
        checkpointing=r.checkpointing.value,
        gpu_layers=cfg.checkpointing.gpu_layers, ckpt_prefetch=cfg.checkpointing.prefetch,
        keep_attention=cfg.checkpointing.keep_attention,
        tiled_mlp=r.tiled_mlp.value,
        tile_tokens=cfg.kernels.tiled_mlp_tokens,
        expandable_segments=cfg.hardware.expandable_segments,
        zero_stage=qlora.stage(cfg.zero.stage, cfg.lora.rank, cfg.lora.quantize, cfg.sparse.blocks),
        offload_optimizer=cfg.zero.offload_optimizer != "none",
        nvme=cfg.zero.offload_optimizer == "nvme", offload_ratio=cfg.zero.offload_ratio,
        optimizer_states=cfg.zero.optimizer_states, sub_group_size=cfg.zero.sub_group_size,
        reduce_bucket_size=cfg.zero.reduce_bucket_size, prefetch_bucket_size=cfg.zero.prefetch_bucket_size,
        param_persistence_threshold=cfg.zero.param_persistence_threshold,
        max_live_parameters=cfg.zero.max_live_parameters,
        offload_param=cfg.zero.offload_param == "cpu", overlap_comm=cfg.zero.overlap_comm,
        grad_accum=max(1, cfg.train.global_batch_size // (micro * ws)),
        host_grad_buffer=r.host_grad_buffer.value, copy_back=r.copy_back.value,
        overlap_step=r.overlap_step.value == "on",
        # packed rows build a [seq x seq] mask only under kernels.packed_attention: mask
        block_mask=r.packed_attention.value == "mask" and cfg.data.pack and cfg.data.source != "random",
        flash_attn_4="flash_attn_4" in (r.packed_attention.value, r.attention.value),
        lora_rank=cfg.lora.rank, lora_targets=tuple(cfg.lora.target_modules),
        quantize=cfg.lora.quantize if qlora.quantized(cfg) else "none", optimizer=cfg.optim.name,
        sparse_blocks=cfg.sparse.blocks, sparse_block_size=cfg.sparse.block_size,
        sparse_targets=tuple(cfg.sparse.target_modules) if cfg.sparse.blocks else (),
        sequence_parallel=cfg.hardware.sequence_parallel)


def estimate_for_plan(cfg, arch: Mapping, resolved: Resolved | Mapping, world_size: int) -> dict:
    """The memory estimate for artifacts/plan.json (JSON-able)."""
    return to_dict(estimate(arch, setup_from_config(cfg, resolved, world_size)))


def _measured(d: dict, *keys):
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d if isinstance(d, (int, float)) else None


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured, 4 decimals; None where either is missing or measured is 0.
    Every predicted-against-measured number of a run is this (memory here, disk in peak_disk)."""
    if predicted is None or not measured:
        return None
    return round((predicted - measured) / measured, 4)


def compare(predicted: dict, train_metrics: dict) -> dict:
    """Predicted vs measured peaks (GiB) and relative error (predicted - measured) / measured.

    predicted: estimate_for_plan()'s dict (or a dict holding it under "estimate");
    train_metrics: metrics/train.json. Measurements a run lacks (VRAM on CPU) give null errors.
    """
    est = predicted.get("estimate", predicted)
    rows = {
        "vram_max_allocated": (est["gpu"]["allocated_bytes"], ("peak_vram", "max_allocated_gib")),
        "vram_max_reserved": (est["gpu"]["reserved_bytes"], ("peak_vram", "max_reserved_gib")),
        "vram_nvml_used": (est["gpu"]["nvml_bytes"], ("peak_vram", "nvml_used_gib")),
        "dram_rss_tree": (est["host"]["rss_bytes"], ("peak_dram", "rss_tree_gib")),
    }
    out = {}
    for name, (pred, keys) in rows.items():
        meas = _measured(train_metrics, *keys)
        out[name] = {"predicted_gib": gib(pred), "measured_gib": meas,
                     "rel_error": rel_error(pred / GIB, meas)}
    return out


def fits(est: Estimate, gpu_mem_gib: float | None, host_mem_gib: float | None,
         vram_limit_gib: float | None = None, disk_gib: float | None = None) -> Fit:
    """Does it fit? GPU: the NVML-level prediction (reserved + context) against the card, and the
    reserved prediction against hardware.vram_limit_gib; host: predicted RSS against host RAM;
    disk (offload_optimizer nvme): the state files against the free space under zero.nvme_path."""
    reasons, gpu_ok, host_ok, disk_ok = [], None, None, None
    if disk_gib is not None and est.disk_bytes:
        disk_ok = est.disk_bytes <= disk_gib * GIB
        reasons.append(f"disk: needs {est.disk_bytes / GIB:.2f} GiB of {disk_gib:.1f} GiB free")
    if gpu_mem_gib is not None:
        gpu_ok = est.gpu_nvml <= gpu_mem_gib * GIB
        factor = reserved_factor(est.setup.expandable_segments)
        reasons.append(f"GPU: needs {est.gpu_nvml / GIB:.2f} GiB (allocated {est.gpu_allocated / GIB:.2f}"
                       f" x {factor} + context {CUDA_CONTEXT_BYTES / GIB:.1f}) of "
                       f"{gpu_mem_gib:.1f} GiB")
    if vram_limit_gib is not None:
        ok = est.gpu_reserved <= vram_limit_gib * GIB
        gpu_ok = ok if gpu_ok is None else gpu_ok and ok
        reasons.append(f"GPU cap: reserved {est.gpu_reserved / GIB:.2f} GiB of "
                       f"hardware.vram_limit_gib {vram_limit_gib:.1f}")
    if host_mem_gib is not None:
        host_ok = est.host_rss <= host_mem_gib * GIB
        reasons.append(f"host: needs {est.host_rss / GIB:.2f} GiB of {host_mem_gib:.1f} GiB")
    return Fit(gpu_ok, host_ok, tuple(reasons), disk_ok)
