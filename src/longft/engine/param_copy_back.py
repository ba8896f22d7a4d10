"""The optimizer's fp32 master weights back into the 16-bit partitions, through pinned chunks.

After CPU Adam has updated a sub-group, DeepSpeed's ZeRO-3 step copies its fp32 master weights
(host) into the 16-bit partition the model computes with (on the GPU unless `offload_param`):
`fp16_partitioned_groups_flat[i].data.copy_(fp32_partitioned_groups_flat[i].data)`. A blocking
copy across devices that changes the dtype is done by torch as: convert on the CPU into a new
pageable tensor (freshly faulted pages), then copy it synchronously. On the H200's 8B row
(`zero.offload_ratio` 0.7) that is 11.2 GB a step at 7.3 GB/s, with the GPU idle (bench/LOG.md).

`ChunkedCopyBack` converts the master into a few page-locked chunks of the partition's dtype,
reused from sub-group to sub-group and step to step, and copies each one to the GPU on a side
stream while the CPU converts the next. The CPU does not wait for the copies: the next sub-group's
CPU Adam runs while the last chunks are in flight, and the step waits for them once, at its end
(ZeRO-3 gathers parameters on a stream of its own). The values are the same bits: the conversion
is torch's own on the CPU (round to nearest even), as in DeepSpeed's copy.
"""

from __future__ import annotations

from longft.compat.deepspeed import FLAT16, FLAT32, POST_STEP, REASSIGN, UNFLATTEN

CHUNK_ELEMENTS = 1 << 25
"""Elements per chunk: 64 MiB in bf16 (a power of two, so torch's pinned allocator wastes none)."""
CHUNKS = 3
"""Chunks in rotation: one being filled by the CPU, the others being read by copies."""


def host_bytes(dtype_bytes: int = 2) -> int:
    """Page-locked host memory the chunks take (counted by the estimator, estimate/host.py)."""
    return CHUNKS * CHUNK_ELEMENTS * dtype_bytes


class ChunkedCopyBack:
    def __init__(self, chunk: int | None = None, chunks: int | None = None):
        import torch

        self.chunk, self.n = chunk or CHUNK_ELEMENTS, chunks or CHUNKS
        self.pin = torch.cuda.is_available()
        self.stream = None              # the side stream, made on the first partition's GPU
        self.bufs: dict = {}            # dtype -> [(buffer, event of the copy that read it last)]
        self.turns: dict = {}           # dtype -> the next buffer of its ring to reuse
        self.copied = 0                 # elements copied back (for tests and logs)
        self.after = None               # an event: wait for it only, not for all queued work

    def _buffer(self, dtype):
        import torch

        ring = self.bufs.setdefault(dtype, [])
        if len(ring) < self.n:
            buf = torch.empty(self.chunk, dtype=dtype, pin_memory=self.pin)
            ring.append((buf, None))
            return len(ring) - 1, buf
        i = self.turns.get(dtype, 0)
        self.turns[dtype] = (i + 1) % self.n
        buf, done = ring[i]
        if done is not None:
            done.synchronize()          # the copy that read it last (long done, as a rule)
        return i, buf

    def copy(self, dst, src) -> None:
        """dst (16-bit, on the GPU or the host) <- src (fp32 on the host), as dst.copy_(src). On the
        GPU the compute stream waits for the copies, the CPU does not: `wait()` before anything
        else (another stream, the host) reads dst. The copies start after the work queued on the
        compute stream so far, or, with `after` set (overlap_step.py: the step's end, the last work
        that read these partitions), after that event only: not behind a forward queued since."""
        import torch

        dst, src = dst.view(-1), src.view(-1)
        if dst.numel() != src.numel():
            raise ValueError(f"copy back: {src.numel()} master values for a partition of {dst.numel()}")
        on_gpu = dst.is_cuda
        if on_gpu:
            if self.stream is None:
                self.stream = torch.cuda.Stream(device=dst.device)
            main = torch.cuda.current_stream(dst.device)
            if self.after is not None:      # only work queued before `after` reads the partition
                self.stream.wait_event(self.after)
            else:                           # queued work may still read the partition
                self.stream.wait_stream(main)
        ring = self.bufs.setdefault(dst.dtype, [])
        for off in range(0, src.numel(), self.chunk):
            m = min(self.chunk, src.numel() - off)
            i, buf = self._buffer(dst.dtype)
            buf[:m].copy_(src[off: off + m])    # fp32 -> 16 bits, on the CPU
            if not on_gpu:                      # (a partition on the host: only the CPU tests)
                dst[off: off + m].copy_(buf[:m])
                continue
            with torch.cuda.stream(self.stream):
                dst[off: off + m].copy_(buf[:m], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            ring[i] = (buf, done)
        if on_gpu:
            main.wait_stream(self.stream)       # the next forward reads the new weights
        self.copied += src.numel()

    def wait(self) -> None:
        """Until every copy has landed (as after DeepSpeed's own blocking copies): ZeRO-3 gathers
        parameters on a stream of its own, which does not wait for the compute stream."""
        if self.stream is not None:
            self.stream.synchronize()


def install(optimizer, devices: tuple[str, ...] = ("cuda",)) -> ChunkedCopyBack | None:
    """Route DeepSpeed ZeRO-3's copy of the updated fp32 master into the 16-bit partitions
    through `ChunkedCopyBack`, for the sub-groups whose master is on the host and whose partition,
    of another dtype, is on one of `devices` (a partition on the host, `offload_param`, is converted
    in place by DeepSpeed's own copy: nothing to gain). None (nothing changed) where no sub-group
    is such."""
    flat16, flat32 = getattr(optimizer, FLAT16, None), getattr(optimizer, FLAT32, None)
    reassign, unflatten = getattr(optimizer, REASSIGN, None), getattr(optimizer, UNFLATTEN, None)
    post_step = getattr(optimizer, POST_STEP, None)
    if None in (flat16, flat32, reassign, unflatten, post_step):
        return None

    def chunked(i: int) -> bool:
        a, b = flat16[i], flat32[i]
        return (a is not None and b is not None and b.device.type == "cpu"
                and a.device.type in devices and a.dtype != b.dtype and a.numel() == b.numel())

    if not any(chunked(i) for i in range(min(len(flat16), len(flat32)))):
        return None
    copier = ChunkedCopyBack()

    def reassign_chunked(sub_group_id):
        if not chunked(sub_group_id):
            return reassign(sub_group_id)
        copier.copy(flat16[sub_group_id].data, flat32[sub_group_id].data)
        unflatten(sub_group_id)     # as DeepSpeed's own: the parameters view the new partition

    def post_step_landed(*args, **kwargs):
        copier.wait()               # the step returns with every partition updated, as before
        return post_step(*args, **kwargs)

    setattr(optimizer, REASSIGN, reassign_chunked)
    setattr(optimizer, POST_STEP, post_step_landed)
    return copier
