"""Activation checkpoints in pinned host memory (`checkpointing.mode: cpu_offload`).

Each decoder layer is checkpointed with PyTorch's non-reentrant checkpoint, which saves the layer's
inputs through the saved-tensor hooks in force *outside* the checkpointed region, while everything
inside the layer is recomputed in backward. `OffloadHooks` are those outer hooks, active only around
each decoder layer's checkpoint call (`CheckpointOffload`): each layer's input hidden states
([micro, seq, hidden]) are copied to pinned host memory on a side CUDA stream, so the copy overlaps
the next layers' compute, and the GPU copy is freed. In backward, unpacking the input of layer i
also starts the host-to-device copy of the tensor saved just before it (layer i-1's input) on the
side stream, so that it arrives while layer i recomputes: the prefetch the reference study listed as
future work. Prefetched tensors are allocated on the compute stream, so the side stream never grows
a memory pool of its own.

This works with transformers 5 (decoder layers return tensors; no reentrant unpacking of tuples)
and with ZeRO-3: parameters are never offloaded by these hooks (ZeRO-3 owns them), nor are small
tensors, for which a copy costs more than it saves.
"""

from __future__ import annotations

import functools

import torch

from longft.compat import transformers as tf_compat
from longft.model.pinned_slabs import PinnedSlabs

OFFLOAD_MIN_BYTES = 1 << 20
"""A decoder layer's saved input is moved to pinned host memory when it is at least this large
(the estimator's host items use the same threshold)."""


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, min_bytes: int = OFFLOAD_MIN_BYTES, pin_memory: bool | None = None,
                 prefetch: bool = True, slabs: PinnedSlabs | None = None):
        self.min_bytes = min_bytes
        self.prefetch = prefetch  # False: each tensor is copied back only when its unpack asks
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        # host buffers of the exact size (torch's pinned blocks round up to a power of two),
        # shared by the steps' hooks (CheckpointOffload)
        self.slabs = slabs if slabs is not None else PinnedSlabs(self.pin)
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.host: dict[int, tuple[torch.Tensor, torch.device, object]] = {}
        self.prefetched: dict[int, tuple[torch.Tensor, object]] = {}
        self.next_key = 0
        self.offloaded_bytes = 0  # bytes moved to the host in this forward pass
        self.prefetch_hits = 0  # unpacks whose tensor was already on its way back
        super().__init__(self._pack, self._unpack)

    # -- forward: device -> host
    def _offloadable(self, t: torch.Tensor) -> bool:
        return (not isinstance(t, torch.nn.Parameter) and t.device.type != "cpu"
                and t.numel() * t.element_size() >= self.min_bytes)

    def _pack(self, t: torch.Tensor):
        if not self._offloadable(t):
            return t
        key = self.next_key
        self.next_key += 1
        cpu = self.slabs.take(t.shape, t.dtype)
        if self.stream is not None and t.is_cuda:
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                cpu.copy_(t, non_blocking=self.pin)
                t.record_stream(self.stream)  # keep t's memory until the copy is done
                done = torch.cuda.Event()
                done.record(self.stream)
        else:
            cpu.copy_(t)
            done = None
        self.host[key] = (cpu, t.device, done)
        self.offloaded_bytes += t.numel() * t.element_size()
        return key

    # -- backward: host -> device, with the previous tensor prefetched
    def _to_device(self, key: int):
        cpu, device, done = self.host.pop(key)
        if self.stream is None or device.type != "cuda":
            gpu = cpu.to(device)
            self.slabs.give(cpu)
            return gpu, None
        # Allocate on the compute stream, so the block comes from (and goes back to) the compute
        # stream's pool: a tensor allocated on the side stream would sit in a pool of its own that
        # the compute stream never reuses (reserved memory far above allocated memory).
        main = torch.cuda.current_stream(device)
        gpu = torch.empty(cpu.shape, dtype=cpu.dtype, layout=cpu.layout, device=device)
        self.stream.wait_stream(main)  # the block may still be in use by queued compute work
        with torch.cuda.stream(self.stream):
            if done is not None:
                self.stream.wait_event(done)
            gpu.copy_(cpu, non_blocking=self.pin)
            # if it is dropped unused (an exception mid-backward), its block waits for the copy
            gpu.record_stream(self.stream)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.slabs.give(cpu, ready)  # reusable once this copy has read it
        return gpu, ready

    def release(self) -> None:
        """Give back the host buffers of tensors that no backward took (a forward without one,
        or a step that failed half-way), once their copies to the host are done."""
        for cpu, _, done in self.host.values():
            self.slabs.give(cpu, done)
        self.host.clear()

    def _unpack(self, packed):
        if not isinstance(packed, int):
            return packed
        hit = self.prefetched.pop(packed, None)
        self.prefetch_hits += hit is not None
        gpu, ready = hit or self._to_device(packed)
        if ready is not None:  # the compute stream uses (and frees) it only once it has arrived
            torch.cuda.current_stream(gpu.device).wait_event(ready)
        prev = packed - 1
        if self.prefetch and prev in self.host and prev not in self.prefetched:
            self.prefetched[prev] = self._to_device(prev)
        return gpu


class CheckpointOffload:
    """Installs itself as the checkpoint function of each decoder layer, so that only the layers'
    saved inputs go through `OffloadHooks`: tensors saved outside the layers (the final norm's
    input, the loss's gradients) are produced at the end of the forward and consumed at the start of
    the backward, so moving them would cost host memory and copies and free no GPU memory at the
    peak. The last `gpu_layers` layers keep their checkpoints on the GPU (their inputs are the first
    the backward needs), trading GPU memory for host memory and copies.

    Call `new_step()` before each forward; `hooks` then holds that micro-step's bookkeeping.
    """

    def __init__(self, layers, gpu_layers: int = 0, min_bytes: int = OFFLOAD_MIN_BYTES, hooks=None,
                 prefetch: bool = True):
        layers = [m for m in layers if getattr(m, "gradient_checkpointing", False)]
        if not layers:
            raise ValueError("no decoder layer has gradient checkpointing on: enable it first")
        self.hooks: OffloadHooks | None = None
        self.slabs = PinnedSlabs(torch.cuda.is_available())
        self._new_hooks = hooks or (lambda: OffloadHooks(min_bytes=min_bytes, prefetch=prefetch,
                                                         slabs=self.slabs))
        for i, layer in enumerate(layers):
            base = tf_compat.checkpoint_function(layer)
            tf_compat.set_checkpoint_function(layer, functools.partial(
                self._checkpoint, base, i < len(layers) - gpu_layers))

    def new_step(self) -> OffloadHooks:
        if self.hooks is not None:
            self.hooks.release()
        self.hooks = self._new_hooks()
        return self.hooks

    def _checkpoint(self, base, offload: bool, function, *args, **kwargs):
        if not offload or self.hooks is None:
            return base(function, *args, **kwargs)
        with self.hooks:  # only the checkpoint's own saved inputs pass through these hooks
            return base(function, *args, **kwargs)
