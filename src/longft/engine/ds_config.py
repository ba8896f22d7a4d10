"""The DeepSpeed config dict, built in code from params (never hand-edited).

`build()` is a pure function of the validated Config and the resolved precision, so it is tested on
CPU against hand-written expectations and written to artifacts/ds_config.json by the patch stage.
"""

from __future__ import annotations

import math

from longft.config.params import Config
from longft.hardware.step_policy import persistence_threshold


def lr_factor(cfg: Config, step: int) -> float:
    """The multiple of optim.lr that optimizer step `step` (0 = the first) applies.

    Warm-up is linear over optim.warmup_steps steps and starts above 0: step i < W applies
    lr x (i + 1) / W, so warmup_steps 1 means no warm-up and every step moves the weights.
    (DeepSpeed's WarmupLR/WarmupCosineLR, used before, raise warm-up to at least 2 steps and
    start it at lr 0, so their first two optimizer steps applied lr 0 and changed nothing.) After
    it, cosine decays to lr x min_lr_ratio at the last step (train.iterations), linear does the
    same in a straight line, constant stays at lr.
    """
    o, steps = cfg.optim, cfg.train.iterations
    warm = min(o.warmup_steps, steps)
    if step < warm:
        return (step + 1) / warm
    if o.scheduler == "constant":
        return 1.0
    progress = min(1.0, (step + 1 - warm) / max(1, steps - warm))
    lo = o.min_lr_ratio
    if o.scheduler == "linear":
        return 1.0 - (1.0 - lo) * progress
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_scheduler(cfg: Config):
    """A callable for deepspeed.initialize(lr_scheduler=...): torch's LambdaLR over lr_factor. Its
    state (the step) is saved in and restored from DeepSpeed checkpoints."""
    import functools

    from torch.optim.lr_scheduler import LambdaLR

    return lambda optimizer: LambdaLR(optimizer, functools.partial(lr_factor, cfg))


def nvme_dir(cfg: Config) -> str:
    """Where DeepSpeed's swapper writes (it adds its own zero_stage_3/... below): longft's own
    directory under zero.nvme_path, so a shared path keeps other files apart."""
    import os

    from longft.hardware.nvme import SWAP_DIR

    return os.path.join(cfg.zero.nvme_path, SWAP_DIR)


def nvme_swap_root(ds: dict) -> str | None:
    """The swap directory a built config names (nvme_dir: every run's run-<key> lies below it), or
    None without offload_optimizer nvme. The train stage measures the disk of its run's
    run-<port> below it (run/launch.py)."""
    off = ds.get("zero_optimization", {}).get("offload_optimizer", {})
    return off["nvme_path"] if off.get("device") == "nvme" else None


def nvme_run_path(root: str, run_key) -> str:
    """The swap directory of one run below the swap root: run-<run_key> (the rendezvous port)."""
    import os

    return os.path.join(root, f"run-{run_key}")


def nvme_run_dir(ds: dict, run_key: str) -> str | None:
    """offload_optimizer nvme: point this run's DeepSpeed config at a swap directory of its own,
    run-<run_key> below nvme_dir (the ranks of one run share a key: the rendezvous port), so two
    runs on one nvme_path never share swap files. Returns it; None without NVMe."""
    root = nvme_swap_root(ds)
    if root is None:
        return None
    off = ds["zero_optimization"]["offload_optimizer"]
    off["nvme_path"] = nvme_run_path(root, run_key)
    return off["nvme_path"]


def _or(value: int | None, default: int) -> int:
    return default if value is None else int(value)


def zero_section(cfg: Config, hidden_size: int, overlap_step: bool = False) -> dict:
    z = cfg.zero
    sec: dict = {"stage": z.stage, "overlap_comm": z.overlap_comm, "contiguous_gradients": True,
                 # Bucket sizes scaled to the model width, as DeepSpeed's "auto" does in HF Trainer
                 # (each zero.* knob set in params.yaml replaces its default).
                 "reduce_bucket_size": _or(z.reduce_bucket_size, hidden_size * hidden_size)}
    if z.offload_optimizer == "cpu":
        sec["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if z.offload_ratio < 1:     # the first int((1 - ratio) x sub-groups) step on the GPU
            sec["offload_optimizer"]["ratio"] = z.offload_ratio
    elif z.offload_optimizer == "nvme":
        sec["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir(cfg), "pin_memory": True,
                                    "buffer_count": 4}
    sec["sub_group_size"] = z.sub_group_size
    if z.stage == 3:
        sec.update({
            "stage3_prefetch_bucket_size": _or(z.prefetch_bucket_size, int(0.9 * hidden_size * hidden_size)),
            "stage3_param_persistence_threshold": persistence_threshold(cfg, overlap_step, hidden_size),
            "stage3_max_live_parameters": _or(z.max_live_parameters, int(1e9)),
            "stage3_max_reuse_distance": int(1e9),
            "stage3_gather_16bit_weights_on_model_save": False,
            # DeepSpeed's default (true) crashes in backward through checkpointed layers on
            # torch 2.11 + deepspeed 0.19.8 ("apply returned NULL"); plain nn.Linear works.
            "memory_efficient_linear": False,
        })
        if z.offload_param == "cpu":
            sec["offload_param"] = {"device": "cpu", "pin_memory": True}
    else:
        sec["allgather_bucket_size"] = hidden_size * hidden_size
    return sec


def build(cfg: Config, precision: str, hidden_size: int, *, overlap_step: bool = False) -> dict:
    """The full DeepSpeed config for this run; overlap_step: zero.overlap_step resolved on."""
    t, o = cfg.train, cfg.optim
    ds = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        # with hardware.sequence_parallel N every loaded row is N micro-steps (one per shard set)
        "gradient_accumulation_steps": cfg.grad_accum_steps * cfg.hardware.sequence_parallel,
        "gradient_clipping": t.max_grad_norm,
        "steps_per_print": 10**9,  # longft logs itself, on rank 0
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero_section(cfg, hidden_size, overlap_step),
        "bf16": {"enabled": precision == "bf16",
                 # zero.optimizer_states bf16: master weights, their gradients and Adam m, v in bf16
                 **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                    if precision == "bf16" and cfg.zero.optimizer_states == "bf16" else {})},
        # fp16: dynamic loss scaling (loss_scale 0); overflowing steps are skipped and counted.
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    }
    if o.name == "adamw":  # else bitsandbytes' 8-bit AdamW, handed over by engine/optimizer.py
        ds["optimizer"] = {"type": "AdamW",
                           "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                      "weight_decay": o.weight_decay}}
    if cfg.hardware.sequence_parallel > 1:
        # read where no mpu is at hand (zero.Init under HfDeepSpeedConfig): the data-parallel world
        # is world / N; deepspeed.initialize gets DeepSpeed's Ulysses mpu itself
        ds["sequence_parallel_size"] = cfg.hardware.sequence_parallel
        # the gradient path whose averaging the loss aggregation matches (engine/ulysses.py):
        # reduce-scatter divides by the whole world; DeepSpeed's all-reduce path (reduce_scatter
        # false) divides by the data-parallel world instead
        ds["zero_optimization"]["reduce_scatter"] = True
    return ds
