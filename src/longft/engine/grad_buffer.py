"""One host staging buffer for all gradient partitions (`zero.host_grad_buffer: shared`).

With `offload_optimizer` DeepSpeed's ZeRO-3 optimizer allocates `grad_partitions_flat_buffer`: a
host copy, in the training dtype, of every gradient partition of the rank (2 B x parameters, pinned:
a 16 GiB block for Llama-3.1-8B). It exists to accumulate gradients over micro-steps. On the first
micro-step of a step (`micro_step_id == 0`), `partition_grads` only copies each reduced partition
into its slot and at once copies the slot back to the GPU, where the fp32 gradient for CPU Adam is
made; nothing reads the slot again. With one micro-step per step every step is a first micro-step,
so the slots can all be one buffer of the largest partition's size: the copies run in order on one
CUDA stream (the reduce stream), so the next partition's copy into the buffer waits for the
previous one's copy out of it.

Not for fp16: there DeepSpeed's overflow check scans the whole host buffer for inf/NaN.
`longft.hardware.policy` decides (auto: shared only where it is exact); this module swaps the buffer.
It relies on one forward and backward per optimizer step, as the trainer runs them; DeepSpeed's
paths that read the slots later are not used by longft and do not work with a shared slot:
unmanaged gradient accumulation, `offload_states` / `reload_states`, DeepCompile.
"""

from __future__ import annotations

from longft.compat import deepspeed as ds
from longft.compat.deepspeed import GRAD_BUFFER
from longft.compat.deepspeed import GRAD_PARTITIONS as MAP
from longft.errors import UserError


class GradBufferError(UserError, RuntimeError):
    """zero.host_grad_buffer: shared asked for where the slot cannot be shared; says the fix."""


def share(optimizer) -> int:
    """Point every gradient partition of DeepSpeed's ZeRO-3 optimizer at one buffer; return the
    host bytes given back. Call after deepspeed.initialize (and a resume), before emptying torch's
    pinned host cache, so the old pinned block goes back to the OS."""
    import torch

    slots = getattr(optimizer, MAP, None)
    flat = getattr(optimizer, GRAD_BUFFER, None)
    if not isinstance(slots, dict) or not isinstance(flat, torch.Tensor) or not slots:
        raise GradBufferError(
            f"zero.host_grad_buffer: shared needs DeepSpeed's ZeRO-3 optimizer with its host "
            f"gradient buffer ({type(optimizer).__name__} has none; deepspeed 0.19 has it). "
            "Set zero.host_grad_buffer: full")
    fix = "Set zero.host_grad_buffer: full (or auto, which chooses full here)"
    accumulation, offload, dtype = ds.grad_buffer_settings(optimizer)
    if accumulation != 1:
        raise GradBufferError("zero.host_grad_buffer: shared needs one micro-step per step "
                              "(train.global_batch_size = micro_batch_size x GPUs). " + fix)
    if not offload:
        raise GradBufferError("zero.host_grad_buffer: shared needs zero.offload_optimizer: cpu. " + fix)
    if dtype == torch.float16:
        raise GradBufferError("zero.host_grad_buffer: shared cannot run in fp16 (DeepSpeed's "
                              "overflow check reads every partition's host copy). " + fix)
    largest = max(t.numel() for t in slots.values())
    pinned = flat.device.type == "cpu" and flat.is_pinned()
    shared = torch.empty(largest, dtype=flat.dtype, device=flat.device, pin_memory=pinned)
    for key, t in slots.items():
        slots[key] = shared.narrow(0, 0, t.numel())
    setattr(optimizer, GRAD_BUFFER, shared)
    return (flat.numel() - largest) * flat.element_size()
