"""ZeRO-3 partial optimizer offload (`zero.offload_ratio` < 1): keep its GPU share on the LR schedule.

With `offload_optimizer.ratio` < 1 DeepSpeed's ZeRO-3 optimizer steps the sub-groups it keeps on the
GPU with a second optimizer, `backup_optimizer`: a torch AdamW that DeepSpeed 0.19 builds once, in
its constructor, from the first param group's lr, betas, eps and weight decay *of that moment*.
The LR scheduler (longft's LambdaLR, or any other) moves the lr of the CPU Adam's param groups
only, so the GPU sub-groups stepped at the initial lr for the whole run: no warm-up, no decay.
Shown on the H200 (tests/test_gpu.py::test_offload_ratio_trains_like_full_offload: the losses part
from full offload's at the first step where cosine lowers the lr) and on the CPU with DeepSpeed's
own optimizer (tests/test_partial_offload.py).

`follow_schedule` wraps the backup optimizer's `step` so that each call first copies the
hyper-parameters of the matching CPU Adam param group (the ones the schedule and the user set):
both halves of the model then take the same AdamW step, as full offload does.
"""

from __future__ import annotations

from longft.compat.deepspeed import BACKUP
from longft.errors import UserError

# what DeepSpeed copies from the CPU Adam's first param group into the backup AdamW
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


class PartialOffloadError(UserError, RuntimeError):
    """zero.offload_ratio < 1 but DeepSpeed's optimizer is not the one this module knows."""


def follow_schedule(optimizer) -> bool:
    """Make the GPU share of a partially offloaded ZeRO-3 optimizer follow the CPU Adam's param
    groups (lr schedule included) at every step. `optimizer`: DeepSpeed's ZeRO-3 optimizer
    (`engine.optimizer`). Returns False (and changes nothing) where there is no GPU share."""
    backup = getattr(optimizer, BACKUP, None)
    if backup is None:
        return False
    main = getattr(optimizer, "optimizer", None)
    groups = getattr(main, "param_groups", None)
    if not groups or len(groups) != len(backup.param_groups):
        raise PartialOffloadError(
            "zero.offload_ratio < 1: DeepSpeed's ZeRO-3 optimizer has a GPU optimizer "
            f"(backup_optimizer) but its param groups do not match the CPU Adam's ({type(main)}); "
            "this DeepSpeed version is not the one longft was written for (requirements/common.txt). "
            "Fix: install the pinned DeepSpeed, or set zero.offload_ratio: 1.0")
    step = backup.step

    def step_on_schedule(*args, **kwargs):
        # read at each step: a checkpoint load replaces an optimizer's param_groups list
        for cpu_group, gpu_group in zip(main.param_groups, backup.param_groups):
            for key in HYPERPARAMETERS:
                gpu_group[key] = cpu_group[key]
        return step(*args, **kwargs)

    backup.step = step_on_schedule
    return True
