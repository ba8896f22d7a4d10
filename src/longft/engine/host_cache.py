"""When the trainer empties torch's pinned-host cache: one rule, which the host estimate replays
(estimate/host.py).

zero.Init pins each parameter's partition, then copies them into flat pinned buffers: the
per-parameter blocks go back to torch's pinned-host cache, which never returns them to the OS nor
reuses them (sizes differ). On CUDA the trainer gives them back once, right after
deepspeed.initialize (and the resume, whose loading buffers would stay cached too): GiBs of host RAM
with offload_param. On CPU nothing is pinned, so there is nothing to empty.
"""

from __future__ import annotations


def empties_after_init(cuda: bool) -> bool:
    """Whether the trainer empties the pinned-host cache after deepspeed.initialize (CUDA only)."""
    return cuda


def empty_after_init(cuda: bool) -> None:
    """The trainer's call, after deepspeed.initialize and the resume."""
    if empties_after_init(cuda):
        from longft.compat import torch as torch_compat

        torch_compat.empty_host_cache()
