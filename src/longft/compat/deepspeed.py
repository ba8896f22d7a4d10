"""DeepSpeed internals longft uses: its ZeRO-3 optimizer (`DeepSpeedZeroOptimizer_Stage3`, deepspeed
0.19) and parameter coordinator, which engine/overlap_step.py, param_copy_back.py, clip_scale.py,
grad_buffer.py and partial_offload.py patch after `deepspeed.initialize`. The names are declared
here once, and those modules reach the internals only through them: a name below (to check, read or
replace an attribute) or a helper below (a call, with DeepSpeed's own arguments).
tests/test_deepspeed_access.py fails on a private name spelled anywhere else, or used here undeclared.
`gate()` checks them when the patch stage plans (the optimizer's state is set in its `__init__`, so
it is checked in the class's source).
"""

from __future__ import annotations

from longft.compat import Access

STAGE3 = "deepspeed.runtime.zero.stage3"
OPTIMIZER = "DeepSpeedZeroOptimizer_Stage3"
COORDINATOR_MODULE = "deepspeed.runtime.zero.partitioned_param_coordinator"
COORDINATOR = "PartitionedParameterCoordinator"
PARAMETERS_MODULE = "deepspeed.runtime.zero.partition_parameters"

GATHER = "_PartitionedParameterCoordinator__all_gather_params"
"""The coordinator's name-mangled `__all_gather_params` (overlap_step's gate before a gather)."""
ALLGATHER_STREAM = "_PartitionedParameterCoordinator__allgather_stream"
FETCH = "fetch_sub_module"
"""The coordinator's fetch of a module's parameters (overlap_step's gate before a fetch)."""
GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
"""The optimizer's name-mangled map of gradient partitions into its host buffer (grad_buffer)."""
GRAD_BUFFER = "grad_partitions_flat_buffer"
"""The host buffer GRAD_PARTITIONS' slots view (grad_buffer)."""

FLAT16 = "fp16_partitioned_groups_flat"
"""Per sub-group: the 16-bit partition the model computes with (None where swapped out)."""
FLAT32 = "fp32_partitioned_groups_flat"
"""Per sub-group: the fp32 master partition (CPU Adam's, under offload_optimizer)."""
REASSIGN = "_reassign_or_swap_out_partitioned_parameters"
"""Copies sub-group i's master into its 16-bit partition (param_copy_back replaces it)."""
UNFLATTEN = "_unflatten_partitioned_parameters"
POST_STEP = "_post_step"
RESCALE = "unscale_and_clip_grads"
"""Divides sub-group i's gradients by loss scale x clip coefficient (clip_scale wraps it)."""
PERSISTENT = "persistent_parameters"
USE_MUON = "use_muon"
"""Set in `__init__` (Muon's step work, which overlap_step leaves to DeepSpeed's own step)."""
CACHE_FLUSHES = "n_caching_allocator_flushes"
BACKUP = "backup_optimizer"
"""The GPU share's torch AdamW under offload_optimizer.ratio < 1 (partial_offload)."""

STEP_METHODS = ("_pre_step", "_partition_all_parameters", "_overflow_check_and_loss_scale_update",
                "_loss_scale_update_and_overflow_cleanup", "_get_norm_groups", "_prepare_sub_group",
                RESCALE, "_optimizer_step", REASSIGN, "_release_sub_group", POST_STEP,
                "_get_param_coordinator")
STEP_STATE = ("fp16_groups", FLAT16, "loss_scale", "_global_grad_norm", "overflow")
STEP_PARTS = STEP_METHODS + STEP_STATE
"""What overlap_step rebuilds ZeRO-3's step() from."""
COPY_BACK_PARTS = (FLAT16, FLAT32, REASSIGN, UNFLATTEN, POST_STEP)
CLIP_SCALE_PARTS = (RESCALE, FLAT32, "clip_grad", "loss_scale")
GRAD_BUFFER_PARTS = ("__param_id_to_grad_partition", GRAD_BUFFER, "gradient_accumulation_steps",
                     "offload_optimizer", "dtype")


_METHODS = frozenset(STEP_METHODS + (UNFLATTEN,))


def _optimizer(feature: str, name: str) -> Access:
    """A method of the optimizer's class, or state its `__init__` sets."""
    return Access(feature, STAGE3, name, owner=OPTIMIZER, kind="attr" if name in _METHODS else "instance")


ENGINE_MODULE = "deepspeed"  # its runtime.engine imports only after deepspeed itself (a cycle)
ENGINE = "DeepSpeedEngine"
CONSOLIDATED = "_zero3_consolidated_16bit_state_dict"
"""The engine's gather of ZeRO-3's partitions into one 16-bit state dict on rank 0 (the export)."""


def consolidated_state_dict(engine) -> dict:
    """The whole 16-bit state dict under ZeRO-3, gathered layer by layer on rank 0 (collective)."""
    return getattr(engine, CONSOLIDATED)()


def grad_buffer_settings(o) -> tuple:
    """(micro-steps per step, whether the optimizer is offloaded, the training dtype); None, False,
    None for what the optimizer lacks (grad_buffer then refuses)."""
    return (getattr(o, "gradient_accumulation_steps", None), getattr(o, "offload_optimizer", False),
            getattr(o, "dtype", None))


# ZeRO-3's step(), piece by piece, as overlap_step runs it (each is DeepSpeed's call with its own
# arguments; `timer_names` is an empty set, as DeepSpeed's step passes one before starting timers)

def sub_groups(o) -> list:
    """The optimizer's sub-groups: the 16-bit parameters of each, in order."""
    return o.fp16_groups


def partition16(o, i: int):
    """Sub-group i's 16-bit partition (None where swapped out)."""
    return o.fp16_partitioned_groups_flat[i]


def step_start(o):
    """DeepSpeed 0.19's step up to its sub-group loop: `_pre_step`, `_partition_all_parameters`,
    the fp16 overflow check, the global norm of the loss-scaled gradients (combined as DeepSpeed
    does, keeping its -1 sentinel of a NaN/inf group invalid), an invalid norm counted as an
    overflow (bf16 too), then the loss scale's update. Returns the scaled norm (a tensor), with
    the unscaled one stashed for `engine.get_global_grad_norm()`; None where the step is skipped
    (DeepSpeed logs the swapper's timers then, and reports the norm as inf)."""
    from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm

    o._pre_step()
    o._partition_all_parameters()
    o._overflow_check_and_loss_scale_update(update_scale=False)
    scaled = None
    if not o.overflow:
        scaled = combine_grad_norm_groups(o._get_norm_groups())
        if is_invalid_grad_norm(scaled):
            o.overflow = True
    if o._loss_scale_update_and_overflow_cleanup():
        if swaps(o):
            o.optimizer_swapper.log_timers()
        return None
    o._global_grad_norm = scaled / o.loss_scale
    return scaled


def uses_muon(o) -> bool:
    """Whether the optimizer runs Muon (its step adds work overlap_step does not rebuild)."""
    return bool(getattr(o, USE_MUON, False))   # (gone: the plan turned overlap_step off)


def swaps(o) -> bool:
    """Whether the optimizer swaps its states to NVMe."""
    return getattr(o, "swap_optimizer", False)


def loss_scale_and_clip(o) -> tuple:
    """The loss scale (1 under bf16) and `gradient_clipping` (0: off) the gradients are divided by."""
    return o.loss_scale, o.clip_grad


def prepare_sub_group(o, i: int) -> None:
    o._prepare_sub_group(i, set())


def rescale_sub_group(o, i: int, scaled_norm) -> None:
    o.unscale_and_clip_grads(i, scaled_norm)


def optimizer_step(o, i: int) -> None:
    o._optimizer_step(i)


def reassign_sub_group(o, i: int) -> None:
    o._reassign_or_swap_out_partitioned_parameters(i)


def release_sub_group(o, i: int) -> None:
    """Drop sub-group i's fp32 gradient (on the GPU's place) or swap its states out (NVMe)."""
    o._release_sub_group(i, set())


def post_step(o, gather_persistent: bool = True) -> None:
    """DeepSpeed's end of step; gather_persistent False: without its gathering of the persistent
    parameters (overlap_step gathers them after their sub-group)."""
    if gather_persistent:
        o._post_step(set())
        return
    persistent, o.persistent_parameters = o.persistent_parameters, []
    try:
        o._post_step(set())
    finally:
        o.persistent_parameters = persistent


def param_coordinator(o):
    """The coordinator that fetches the model's parameters for the forward (and backward)."""
    return o._get_param_coordinator()


def persistent(params) -> list:
    """Those of `params` ZeRO-3 keeps gathered (`stage3_param_persistence_threshold`)."""
    return [p for p in params if getattr(p, "ds_persist", False)]


def gather(params) -> None:
    """All-gather `params` (ZeRO-3 parameters; not empty), as DeepSpeed's `_post_step` does."""
    params[0].all_gather(params)


ACCESSES = (
    Access("export_zero3", ENGINE_MODULE, CONSOLIDATED, owner=ENGINE),
    *(_optimizer("overlap_step", n) for n in STEP_PARTS),
    _optimizer("overlap_step", PERSISTENT),
    _optimizer("overlap_step", "swap_optimizer"),
    _optimizer("overlap_step", "optimizer_swapper"),
    _optimizer("overlap_step", CACHE_FLUSHES),
    _optimizer("overlap_step", USE_MUON),
    Access("overlap_step", COORDINATOR_MODULE, FETCH, owner=COORDINATOR),
    Access("overlap_step", COORDINATOR_MODULE, GATHER, owner=COORDINATOR),
    Access("overlap_step", COORDINATOR_MODULE, "__allgather_stream", owner=COORDINATOR, kind="instance"),
    Access("overlap_step", COORDINATOR_MODULE, "iter_params"),
    Access("overlap_step", PARAMETERS_MODULE, "ds_persist", kind="source"),
    *(Access("overlap_step", "deepspeed.runtime.utils", n)
      for n in ("combine_grad_norm_groups", "is_invalid_grad_norm")),
    *(_optimizer("copy_back", n) for n in COPY_BACK_PARTS),
    *(_optimizer("clip_scale", n) for n in CLIP_SCALE_PARTS),
    *(_optimizer("host_grad_buffer", n) for n in GRAD_BUFFER_PARTS),
    _optimizer("partial_offload", BACKUP),
)
