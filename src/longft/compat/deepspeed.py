"""DeepSpeed internals longft uses: its ZeRO-3 optimizer (`DeepSpeedZeroOptimizer_Stage3`, deepspeed
0.19) and parameter coordinator, which engine/overlap_step.py, param_copy_back.py, clip_scale.py,
grad_buffer.py and partial_offload.py patch after `deepspeed.initialize`. The names are declared
here once; those modules take them from here, and `gate()` checks them when the patch stage plans
(the optimizer's state is set in its `__init__`, so it is checked in the class's source).
"""

from __future__ import annotations

from longft.compat import Access

STAGE3 = "deepspeed.runtime.zero.stage3"
OPTIMIZER = "DeepSpeedZeroOptimizer_Stage3"
COORDINATOR_MODULE = "deepspeed.runtime.zero.partitioned_param_coordinator"
COORDINATOR = "PartitionedParameterCoordinator"

GATHER = "_PartitionedParameterCoordinator__all_gather_params"
"""The coordinator's name-mangled `__all_gather_params` (overlap_step's gate before a gather)."""
ALLGATHER_STREAM = "_PartitionedParameterCoordinator__allgather_stream"
GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
"""The optimizer's name-mangled map of gradient partitions into its host buffer (grad_buffer)."""

STEP_METHODS = ("_pre_step", "_partition_all_parameters", "_overflow_check_and_loss_scale_update",
                "_get_norm_groups", "_prepare_sub_group", "unscale_and_clip_grads", "_optimizer_step",
                "_reassign_or_swap_out_partitioned_parameters", "_release_sub_group", "_post_step",
                "_get_param_coordinator")
STEP_STATE = ("fp16_groups", "fp16_partitioned_groups_flat", "loss_scale")
STEP_PARTS = STEP_METHODS + STEP_STATE
"""What overlap_step rebuilds ZeRO-3's step() from."""
COPY_BACK_PARTS = ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
                   "_reassign_or_swap_out_partitioned_parameters", "_unflatten_partitioned_parameters",
                   "_post_step")
CLIP_SCALE_PARTS = ("unscale_and_clip_grads", "fp32_partitioned_groups_flat", "clip_grad", "loss_scale")


_METHODS = frozenset(STEP_METHODS + ("_unflatten_partitioned_parameters",))


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


ACCESSES = (
    Access("export_zero3", ENGINE_MODULE, CONSOLIDATED, owner=ENGINE),
    *(_optimizer("overlap_step", n) for n in STEP_PARTS),
    _optimizer("overlap_step", "persistent_parameters"),
    Access("overlap_step", COORDINATOR_MODULE, "fetch_sub_module", owner=COORDINATOR),
    Access("overlap_step", COORDINATOR_MODULE, GATHER, owner=COORDINATOR),
    Access("overlap_step", COORDINATOR_MODULE, "__allgather_stream", owner=COORDINATOR, kind="instance"),
    Access("overlap_step", COORDINATOR_MODULE, "iter_params"),
    *(_optimizer("copy_back", n) for n in COPY_BACK_PARTS),
    *(_optimizer("clip_scale", n) for n in CLIP_SCALE_PARTS),
    _optimizer("host_grad_buffer", "__param_id_to_grad_partition"),
    _optimizer("host_grad_buffer", "grad_partitions_flat_buffer"),
    _optimizer("partial_offload", "backup_optimizer"),
)
