"""Pinned host buffers of exactly the bytes asked for, reused from step to step.

torch's pinned host allocator (`torch.empty(..., pin_memory=True)`) rounds every block up to a power
of two: an offloaded checkpoint of 2.75 GiB (Llama-3.1-8B at 352K tokens) takes 4 GiB of RAM, and
768 MiB (96K tokens) takes 1 GiB. torch 2.11 has no setting against it (scripts/pinned_probe.py).
`PinnedSlabs` takes ordinary host memory of the exact size and page-locks it with
`cudaHostRegister`, so that copies to and from the GPU stay asynchronous; a slab given back is
handed out again, once the copy that read it has finished, for the next tensor of the same size (the
same layer's checkpoint in the next step). Slabs stay registered for the life of the process, as
torch's cached pinned blocks do.

Without CUDA, or where `cudaHostRegister` fails (a locked-memory limit, say), a slab is plain or
torch-pinned memory, and the first failure is said once.
"""

from __future__ import annotations

import sys

_KEPT: list = []
"""Every registered slab, so that no registered range is ever freed (they live as long as the
process, as torch's cached pinned blocks do)."""


class PinnedSlabs:
    def __init__(self, pin: bool):
        self.pin = pin
        self.free: dict[int, list[tuple[object, object]]] = {}  # bytes -> [(slab, event)]
        self.allocated_bytes = 0        # every slab ever made (they are never given back)
        self.registered = pin           # False once cudaHostRegister failed: torch's pinning

    def take(self, shape, dtype):
        """A host tensor of `shape` and `dtype` on a slab of exactly its bytes."""
        import torch

        n = torch.Size(shape).numel() * dtype.itemsize
        ready = self.free.get(n)
        if ready:
            slab, event = ready.pop()
            if event is not None:
                event.synchronize()     # the copy that read it last (long done, as a rule)
        else:
            slab = self._new(n)
        return slab.view(dtype).view(shape)

    def give(self, t, event=None) -> None:
        """Give `t` (from take) back once `event` (the copy reading it; None: nothing pending)."""
        import torch

        n = t.numel() * t.element_size()
        slab = t._base if t._base is not None else t.view(torch.uint8).view(-1)
        self.free.setdefault(n, []).append((slab, event))

    def _new(self, n: int):
        import torch

        self.allocated_bytes += n
        if not self.pin:
            return torch.empty(n, dtype=torch.uint8)
        if self.registered:
            slab = torch.empty(n, dtype=torch.uint8)
            err = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), n, 0)
            if int(err) == 0:
                _KEPT.append(slab)
                return slab
            self.registered = False
            print(f"longft: cudaHostRegister of {n / 2**30:.2f} GiB failed ({err}); offloaded "
                  "checkpoints use torch's pinned blocks, which round each one up to a power of two "
                  "(more host RAM than the estimate counts). Raise the locked-memory limit "
                  "(ulimit -l) to avoid it.", file=sys.stderr)
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)
