"""The run's environment record (the "env" line of runs/train/rank0.jsonl, metrics/env.json):
hardware, library versions and every resolved knob, written once by rank 0 when a run starts."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

from longft.config.params import Config, section_digests
from longft.config.plan import Plan
from longft.engine import lockfile
from longft.measure.monitor import gpu_inventory
from longft.model import packed_attention


def _pkg(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


ZERO_KNOBS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
              "stage3_max_live_parameters", "sub_group_size")


def optimizer_groups(engine) -> dict | None:
    """Where DeepSpeed put this rank's optimizer sub-groups: {"gpu": k, "host": m} from ZeRO-3's
    own subgroup_to_device map (offload_optimizer with offload_ratio), None where it keeps none
    (no ZeRO-3 optimizer offload). What the estimator's optimizer_split predicts, as it ran."""
    where = getattr(getattr(engine, "optimizer", None), "subgroup_to_device", None)
    if not isinstance(where, dict) or not where:
        return None
    host = sum(1 for d in where.values() if d == "cpu")
    return {"gpu": len(where) - host, "host": host}


def environment(cfg: Config, plan: Plan, ds: dict | None = None, engine=None) -> dict:
    import torch

    r = plan.resolved
    cuda = torch.cuda.is_available()
    gpus = gpu_inventory() if cuda else []
    driver = gpus[0]["driver"] if gpus else None
    return {
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": driver, "cuda": torch.version.cuda if cuda else None,
        "torch": torch.__version__, "deepspeed": _pkg("deepspeed"),
        "transformers": _pkg("transformers"), "liger_kernel": _pkg("liger-kernel"),
        "peft": _pkg("peft"), "flash_attn": _pkg("flash-attn"), "flash_attn_4": _pkg("flash-attn-4"),
        "python": platform.python_version(),
        **lockfile.record(),  # env_lock: the lock's hash; env_lock_differs: packages not as locked
        "precision": r.precision.value, "attention": r.attention.value,
        "sdpa_backend": r.sdpa_backend.value, "packed_attention": r.packed_attention.value,
        "cudnn_ragged": packed_attention.cudnn_ragged(),
        "checkpointing": r.checkpointing.value, "liger": r.liger.value,
        "tiled_mlp": r.tiled_mlp.value, "host_grad_buffer": r.host_grad_buffer.value,
        "overlap_step": r.overlap_step.value,
        "gpu_layers": cfg.checkpointing.gpu_layers, "ckpt_prefetch": cfg.checkpointing.prefetch,
        # the ZeRO bucket / threshold numbers DeepSpeed ran with (zero.* knobs or their defaults)
        "zero_knobs": {k: v for k, v in ((ds or {}).get("zero_optimization") or {}).items()
                       if k in ZERO_KNOBS},
        "zero_stage": cfg.zero.stage, "offload_optimizer": cfg.zero.offload_optimizer,
        "offload_ratio": cfg.zero.offload_ratio, "optimizer_states": cfg.zero.optimizer_states,
        "sub_group_size": cfg.zero.sub_group_size, "bind_cores": cfg.hardware.bind_cores,
        "optimizer_groups": optimizer_groups(engine),
        # the dtypes the trained parameters run in (LoRA adapters: the training dtype, see engine/build.py)
        "trainable_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in engine.module.parameters()
                                    if p.requires_grad}) if engine is not None else None,
        "offload_param": cfg.zero.offload_param, "world_size": cfg.world_size,
        "sequence_parallel": cfg.hardware.sequence_parallel,
        "micro_batch_size": cfg.train.micro_batch_size,
        "global_batch_size": cfg.train.global_batch_size, "seq_len": cfg.data.max_seq_length,
        "model_name": cfg.model.name, "model_source": cfg.model.source,
        "n_params": plan.model.n_params, "lora_rank": cfg.lora.rank,
        # each params section's digest: `longft report` leaves out metrics of other params
        "params_digests": section_digests(cfg),
        # the rendezvous port the launcher gave the ranks (hardware.master_port auto: picked then)
        "master_port": int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None,
    }
