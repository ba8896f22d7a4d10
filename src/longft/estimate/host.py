"""Host items of the estimate, per node: the process baseline, the pinned buffers (replayed through
torch's power-of-two host caching allocator) and CPU Adam's states.
"""

from __future__ import annotations

from longft.engine import host_cache, param_copy_back
from longft.estimate.arch import Numbers, share
from longft.estimate.types import (
    CPU_LAUNCHER_BASE_BYTES,
    CPU_RANK_BASE_BYTES,
    FLASH_ATTN_4_RANK_BYTES,
    GIB,
    HOST_PHASES,
    LAUNCHER_BASE_BYTES,
    NVME_ALIGNED_BYTES,
    NVME_BUFFER_COUNT,
    RANK_BASE_BYTES,
    SETUP_LAUNCHER_BYTES,
    SETUP_RANK_BYTES,
    Item,
    Setup,
)
from longft.model.checkpoint_offload import OFFLOAD_MIN_BYTES


def pinned(n: int) -> int:
    """Bytes that a pinned host buffer of n bytes really takes: torch's CachingHostAllocator rounds
    every request up to a power of two and keeps freed blocks cached (resident) for reuse."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def pinned_pool(events: list[tuple[str, str, int]], rounding: bool = True
                ) -> tuple[dict[str, int], int]:
    """Replay pinned allocations through torch's host caching allocator.

    events: ("alloc", key, bytes), ("free", key, 0) or ("empty", "", 0). A request reuses a cached
    free block of the same power-of-two size, else takes a new one; freed blocks stay resident
    until an "empty" (where engine/host_cache.py says the trainer empties the cache) gives the
    cached ones back to the OS. Returns
    (rounded bytes of the blocks still allocated, by key) and the resident total (all blocks).
    rounding=False (a CPU run: pin_memory does nothing) keeps sizes and frees for real.
    """
    live, resident, _ = _replay(events, rounding)
    return live, resident


def pinned_peak(events: list[tuple[str, str, int]], rounding: bool = True) -> int:
    """The most resident bytes at any point of the same replay (pinned_pool)."""
    return _replay(events, rounding)[2]


def _replay(events, rounding: bool) -> tuple[dict[str, int], int, int]:
    """(live blocks by key, resident total at the end, resident peak) of pinned_pool's replay."""
    free: dict[int, int] = {}
    live: dict[str, int] = {}
    resident = peak = 0
    for op, key, n in events:
        if op == "empty":
            resident -= sum(size * count for size, count in free.items())
            free = {}
        elif op == "alloc":
            r = pinned(n) if rounding else n
            if rounding and free.get(r, 0) > 0:
                free[r] -= 1
            else:
                resident += r
            live[key] = r
        elif rounding:
            r = live.pop(key)
            free[r] = free.get(r, 0) + 1
        else:                      # not pinned: freed for real
            resident -= live.pop(key)
        peak = max(peak, resident)
    return live, resident, peak


def host_peak(items: list[Item]) -> tuple[str, dict[str, int]]:
    """The host moment with the most RSS (start-up or training) and the totals of both."""
    totals = {p: sum(i.bytes for i in items if i.where == "host" and p in i.phases)
              for p in HOST_PHASES}
    return max(HOST_PHASES, key=lambda p: totals[p]), totals


def host_items(arch: dict, s: Setup, n: Numbers) -> list[Item]:
    """Per node: process baseline (and its start-up peak), pinned buffers (replayed through torch's
    host cache), CPU Adam."""
    R, w, N, z3 = s.ranks_per_node, n.w, s.world_size, s.zero_stage == 3
    cuda = s.device == "cuda"
    launcher, rank = ((LAUNCHER_BASE_BYTES, RANK_BASE_BYTES) if cuda
                      else (CPU_LAUNCHER_BASE_BYTES, CPU_RANK_BASE_BYTES))
    out = [Item("process baseline", "host", launcher + R * rank, HOST_PHASES,
                f"launcher {launcher / GIB:.2f} GiB + {R} rank(s) x {rank / GIB:.2f} GiB")]
    if cuda and s.flash_attn_4:
        out.append(Item("flash-attn-4 runtime", "host", R * FLASH_ATTN_4_RANK_BYTES, HOST_PHASES,
                        f"{R} rank(s) x {FLASH_ATTN_4_RANK_BYTES / GIB:.2f} GiB: the CUTLASS DSL's "
                        "libraries and its first-step kernel compile"))
    setup = SETUP_LAUNCHER_BYTES + R * SETUP_RANK_BYTES
    if cuda and setup > out[0].bytes:   # the start-up peak, over before the pinned buffers fill
        out.append(Item("start-up peak above the baseline", "host", setup - out[0].bytes,
                        ("setup",), f"launcher {SETUP_LAUNCHER_BYTES / GIB:.2f} GiB + {R} rank(s) x "
                        f"{SETUP_RANK_BYTES / GIB:.2f} GiB at start-up, less the baseline"))
    if cuda and not z3:    # no zero.Init: the model is built on the host, then moved (engine/build.py)
        # Not held at once with the start-up peak above: only the larger of the two counts (the 1B
        # ZeRO-2 row h200-1b-16k-w2mem-fastest-zero2 peaked 1.98 GiB above the baseline, with a
        # 2.30 GiB build and a 1.64 GiB start-up peak; the sum would be 3.94).
        build = R * w * n.P - max(0, setup - out[0].bytes)
        if build > 0:
            out.append(Item("start-up: the model built on the host (ZeRO-2)", "host", build,
                            ("setup",), f"{R} rank(s) x {w} B x {n.P:,} params before they move "
                            "to the GPU" + (" and are quantized (assumed; unmeasured)" if n.Pq else "")
                            + ", less the start-up peak (not held at once)"))
    events: list[tuple[str, str, int]] = []
    names: dict[str, str] = {}

    def alloc(key, b, name):
        events.append(("alloc", key, b))
        names[key] = name

    if s.offload_param:      # zero.Init pins each partition, then the optimizer moves them to one buffer
        # Only the parameters the optimizer owns move (DeepSpeed sizes the buffer from the trainable
        # groups): a frozen base keeps zero.Init's blocks, and the buffer holds the trained ones
        frozen = s.frozen_base
        for i, (_, m) in enumerate(n.params):
            alloc(f"init:{i}", w * share(m, N), "weights: frozen partitions (pinned)" if frozen else "")
        alloc("lp", w * (n.Pt_r if frozen else n.P_r),
              "weights: trained partitions (pinned)" if frozen else "weights: partitions (pinned)")
        if not frozen:
            events += [("free", f"init:{i}", 0) for i in range(len(n.params))]
    kind = "bf16" if n.ms == 2 else "fp32"
    if s.offload_optimizer and z3:
        k = len(n.gpu_groups)
        for i, g in enumerate(n.groups if not s.nvme else []):
            # every sub-group's gradient buffer is made pinned on the host; a GPU group's is then
            # copied to the GPU and freed into torch's pinned cache (stage3.initialize_optimizer_states)
            alloc(f"g32:{i}", n.ms * g, f"CPU Adam {kind} gradients (pinned)")
            if i < k:
                events.append(("free", f"g32:{i}", 0))
        alloc("g16", w * n.Pt_r, "gradients: partitions (pinned)")
        if s.host_grad_buffer == "shared":  # the trainer swaps it for one slot (grad_buffer.py)
            alloc("g16s", w * max(share(m, N) for m in n.trainable),
                  "gradients: one shared staging slot (pinned)")
            events.append(("free", "g16", 0))
    elif s.offload_optimizer:
        alloc("m32", 4 * n.Pt_r, "optimizer: fp32 master (pinned)")
        alloc("p16", w * n.Pt_r, "weights: bf16 staging (pinned)")
        alloc("tmp", w * n.largest, "gradients: staging (pinned)")
        alloc("g32", 4 * n.Pt_r, "CPU Adam fp32 gradients (pinned)")
        if s.grad_accum > 1:
            for i, m in enumerate(n.trainable):
                alloc(f"acc:{i}", w * share(m, N), "gradient accumulation buffers (pinned)")
    at_start = pinned_peak(events, rounding=cuda)   # all of deepspeed.initialize's pinned blocks
    if host_cache.empties_after_init(cuda):   # the trainer's rule, after deepspeed.initialize
        events.append(("empty", "", 0))
    # only the decoder layers' saved inputs go (offload.CheckpointOffload), not the last
    # gpu_layers; in slabs of their exact size (model/pinned_slabs.py), not the power-of-two
    # blocks of torch's pinned allocator
    offloaded = (max(0, n.a["L"] - s.gpu_layers) if s.checkpointing == "cpu_offload"
                 and n.T * w * n.a["h"] >= OFFLOAD_MIN_BYTES else 0)
    for j in range(2):       # the DataLoader pins each batch; the previous one is still referenced
        for t in range(3):
            alloc(f"batch:{j}:{t}", n.T * 8, "DataLoader pinned batches")
    live, resident = pinned_pool(events, rounding=cuda)
    by_name: dict[str, int] = {}
    for key, r in live.items():
        by_name[names[key]] = by_name.get(names[key], 0) + r
    for name, b in by_name.items():
        out.append(Item(name if cuda else name.replace(" (pinned)", "").replace(" pinned", ""),
                        "host", R * b, ("steady",),
                        f"{R} rank(s) x power-of-two pinned blocks" if cuda else f"{R} rank(s)"))
    if offloaded:
        out.append(Item("activation checkpoints (pinned)" if cuda else "activation checkpoints",
                        "host", R * offloaded * n.T * w * n.a["h"], ("steady",),
                        f"{R} rank(s) x {offloaded} layers x micro x seq x h x {w} B"
                        + (", pinned in slabs of their exact size" if cuda else "")))
    if s.offload_optimizer and z3 and s.nvme:
        out += nvme_swap_items(n, R)
    if at_start:
        out.append(Item("start-up: pinned blocks of DeepSpeed's init" if cuda
                        else "start-up: host buffers of DeepSpeed's init", "host", R * at_start,
                        ("setup",), f"{R} rank(s) x the resident peak before the pinned cache is "
                        "emptied (freed zero.Init blocks included)" if cuda
                        else f"{R} rank(s) x the peak of DeepSpeed's host buffers at start-up"))
    if resident > sum(live.values()):
        out.append(Item("pinned blocks cached (freed, not reused)", "host",
                        R * (resident - sum(live.values())), ("steady",),
                        "freed pinned blocks kept in torch's host cache"))
    host_share = sum(n.host_groups) if z3 else n.Pt_r
    if (s.offload_optimizer and z3 and not s.offload_param and cuda and w < n.ms
            and max(n.host_groups, default=0)):
        if s.copy_back == "chunked":
            # the step copies each sub-group's fp32 master into the GPU's bf16 partition through
            # a few pinned chunks of the partition's dtype (engine/param_copy_back.py)
            out.append(Item("step: copy-back chunks (pinned)", "host",
                            R * param_copy_back.host_bytes(w), ("steady",),
                            f"{R} rank(s) x {param_copy_back.CHUNKS} x "
                            f"{param_copy_back.CHUNK_ELEMENTS:,} elements x {w} B"))
        else:
            # DeepSpeed's own copy_: a CPU -> GPU copy that changes dtype converts on the CPU
            # first (ATen copy_kernel_cuda), into a pageable temporary of the whole sub-group
            g = max(n.host_groups)
            out.append(Item("step: bf16 copy of a sub-group (pageable)", "host", R * w * g,
                            ("steady",), f"{R} rank(s) x {w} B x {g:,} elements, during the step"))
    if s.offload_optimizer and not s.nvme and host_share:
        of = "" if s.offload_ratio == 1 else f" (offload_ratio {s.offload_ratio:g}: {len(n.host_groups)} of " \
            f"{len(n.groups)} sub-groups)"
        if z3:
            out.append(Item(f"optimizer: {kind} master", "host", R * n.ms * host_share, HOST_PHASES,
                            f"{R} x {n.ms} B x {host_share:,}{of}"))
        moments = "optimizer: Adam m, v (CPU Adam" + (", bf16)" if n.ms == 2 else ")")
        out.append(Item(moments, "host", R * 2 * n.ms * host_share, ("steady",),
                        f"{R} x {2 * n.ms} B x {host_share:,}{of}"))
    return out


def nvme_swap_items(n: Numbers, R: int) -> list[Item]:
    """offload_optimizer nvme, per node: the swapper's buffers, and Adam's m and v of the first
    step. The buffers are DeepSpeed's own page-locked memory (aio_handle.new_cpu_locked_tensor:
    posix_memalign + mlock), not torch's pinned cache, so their size is exact, held from start-up.
    In the first step a sub-group's swap-in reserves buffers for its weights and gradient only
    (no state is on the disk yet), so DeepSpeedCPUAdam creates m and v in pageable memory; they go
    when the sub-group is swapped out, after the step's bf16 copy. From the second step they live
    in the buffers. Measured on the H200 (135a550, Llama-3.2-3B: 36.05 GiB against 35.70 with
    both) and on CPU, sub-group by sub-group (docs/estimator.md, "Host items")."""
    g = io_aligned(max(n.groups), n.ms)
    return [Item("NVMe swap buffers (page-locked)", "host", R * NVME_BUFFER_COUNT * n.ms * g,
                 HOST_PHASES, f"{R} rank(s) x buffer_count {NVME_BUFFER_COUNT} x {n.ms} B x "
                 f"{g:,} elements (the largest sub-group), exact"),
            Item("first step: CPU Adam m, v (pageable)", "host", R * 2 * n.ms * g,
                 ("steady",), f"{R} rank(s) x 2 x {n.ms} B x {g:,} elements, created by the first "
                 "step before the swapper holds them")]


def io_aligned(numel: int, element_size: int) -> int:
    """DeepSpeed's swapper rounds a tensor's elements up to whole AIO_ALIGNED_BYTES (1,024 B,
    times intra_op_parallelism 1) for its reads and writes."""
    a = max(1, NVME_ALIGNED_BYTES // element_size)
    return -(-numel // a) * a


def disk_items(s: Setup, n: Numbers) -> list[Item]:
    """offload_optimizer nvme: the files under zero.nvme_path (per node): each rank's master
    weights, Adam m and v, and the optimizer's gradient copy."""
    if not s.nvme:
        return []
    kind = "bf16" if n.ms == 2 else "fp32"
    R = s.ranks_per_node
    return [Item(f"NVMe: {kind} master, gradient, Adam m, v", "disk", R * 4 * n.ms * n.Pt_r,
                 HOST_PHASES, f"{R} rank(s) x 4 x {n.ms} B x {n.Pt_r:,}")]
