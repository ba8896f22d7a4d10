"""What the memory estimator works on and returns, and its calibration constants.

`Setup` is a run as far as memory cares (every `auto` resolved); `Item` is one line of the
estimate (bytes, where, when alive, formula); `Estimate` is the whole prediction. The constants
are measured on the H200 rows; docs/estimator.md says how.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from longft.config import qlora
from longft.hardware.policy import why_not_shared_grad_buffer as why_not
from longft.model.tiled_mlp import TILE_TOKENS

GIB = 2**30
PHASES = ("loss", "backward", "step")
"""GPU moments compared for the peak: end of the forward (fused loss computed), backward of the
last decoder layer (all checkpoints still held), optimizer step (activations gone)."""
HOST_PHASES = ("setup", "steady")
"""Host moments compared for the peak: start-up (end of deepspeed.initialize, before the trainer
empties the pinned cache) and training (after the first optimizer step)."""

# ---------------------------------------------------------------- calibration (docs/estimator.md)
CUDA_CONTEXT_BYTES = int(1.9 * GIB)
"""NVML used minus torch reserved: the CUDA context, cuBLAS/cuDNN handles, NCCL, loaded kernels and
driver reservations, outside torch's allocator. Calibrated on the H200 rows (docs/estimator.md,
"Reserved and NVML")."""
RESERVED_FACTOR = 1.2
"""torch max reserved / max allocated with the classic allocator (caching, fragmentation), as
measured on the H200 rows (docs/estimator.md, "Reserved and NVML")."""
RESERVED_FACTOR_EXPANDABLE = 1.06
"""The same with hardware.expandable_segments (the default). Not a bound: with nothing capping it,
DeepSpeed's side-stream pools can cache far more; under hardware.vram_limit_gib the allocator
flushes them instead, and the run fits (docs/estimator.md; the rows: bench/LOG.md)."""


def reserved_factor(expandable_segments: bool) -> float:
    return RESERVED_FACTOR_EXPANDABLE if expandable_segments else RESERVED_FACTOR
RANK_BASE_BYTES = int(2.02 * GIB)
"""Steady host RSS of one rank with nothing offloaded, while it trains: python, torch,
CUDA/cuBLAS/cuDNN/NCCL libraries, the CUDA context's host side, DeepSpeed, transformers."""
LAUNCHER_BASE_BYTES = int(1.28 * GIB)
"""Steady host RSS of the launcher side of the tree (stage process, deepspeed runner and launch).
Both solved from the H200 rows whose RSS peak came while training, 1-rank and 2-rank, as what they
leave beside their pinned and CPU Adam items; the per-rank split rests on one 2-rank row
(docs/estimator.md, "Host items")."""
SETUP_RANK_BYTES = int(1.57 * GIB)
SETUP_LAUNCHER_BYTES = int(3.37 * GIB)
"""The start-up peak of the tree (engine setup, before step 1), which the rows with little in host
memory show as their RSS peak, solved from a 1-rank and a 2-rank row as a launcher side plus a
share a rank. It is transient: it is gone by the time pinned buffers fill, so the host peak is the
larger of the two moments (estimate_host.HOST_PHASES; docs/estimator.md, "Host items")."""
FLASH_ATTN_4_RANK_BYTES = int(0.14 * GIB)
"""Host RSS a rank adds with kernels.packed_attention flash_attn_4: the CUTLASS DSL's MLIR
libraries (~240 MB of shared objects) and the JIT compile of its kernels in the first step: the
difference between the same H200 rows on flash_attn_4 and on varlen / per_document
(docs/estimator.md, "Host items")."""
CPU_RANK_BASE_BYTES = int(0.645 * GIB)
CPU_LAUNCHER_BASE_BYTES = int(0.39 * GIB)
"""The same two on a CPU-only run (no CUDA libraries): with the tiny model's tensors they add up to
what the repository's CPU run measures (metrics/train.json); the split is assumed. A run that
compiles DeepSpeed's CPU Adam first (a fresh machine) peaks at start-up with the compiler's
processes instead, which the estimate does not model (docs/estimator.md, "Host items")."""
DS_SUB_GROUP_SIZE = 10**9
"""DeepSpeed's default zero_optimization.sub_group_size (zero.sub_group_size's default): the
optimizer step and its fp32 gradient buffers work on groups of about this many parameter elements."""
NVME_BUFFER_COUNT = 4
"""offload_optimizer nvme: DeepSpeed's optimizer swapper keeps this many page-locked buffers of the
largest sub-group (offload_optimizer.buffer_count; Adam's 4 states: weight, gradient, m, v)."""
NVME_ALIGNED_BYTES = 1024
"""DeepSpeed's AIO_ALIGNED_BYTES (runtime/swap_tensor/utils.py): swapped tensors are padded to it."""
LOSS_CHUNK_MEM = 1
"""Liger fused linear cross-entropy's chunk_mem_const: logits chunk ~ BT x H elements."""


@dataclass(frozen=True)
class Setup:
    """Everything about a run that memory depends on, with every `auto` already resolved."""
    micro_batch: int
    seq_len: int
    device: str = "cuda"             # cuda | cpu (DeepSpeed's CPU accelerator: tensors in host RAM)
    world_size: int = 1
    ranks_per_node: int = 1
    precision: str = "bf16"          # bf16 | fp16 | fp32
    attention: str = "sdpa"          # flash_attention_2 | sdpa | flash_attn_4 | eager
    sdpa_backend: str = "default"    # default | flash | cudnn | efficient | math
    liger: bool = True
    checkpointing: str = "gpu"       # none | gpu | cpu_offload
    gpu_layers: int = 0              # cpu_offload: last N layers keep their checkpoints on the GPU
    ckpt_prefetch: bool = True       # cpu_offload: the previous layer's checkpoint comes back early
    keep_attention: int = 0          # last N layers keep their attention output (no recompute)
    tiled_mlp: bool = False          # MLP over tiles of tile_tokens tokens (tiled.py)
    tile_tokens: int = TILE_TOKENS
    expandable_segments: bool = True  # hardware.expandable_segments (reserved ~ allocated)
    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = True
    offload_ratio: float = 1.0       # share of the optimizer's sub-groups on the host (DeepSpeed ratio)
    nvme: bool = False               # offload_optimizer to NVMe files (ZeRO-Infinity), via host buffers
    optimizer_states: str = "fp32"   # fp32 | bf16 (master weights, their gradients, Adam m and v)
    sub_group_size: int = DS_SUB_GROUP_SIZE
    # zero.* bucket / threshold knobs (None: longft's defaults from the hidden size, ds_config.py)
    reduce_bucket_size: int | None = None
    prefetch_bucket_size: int | None = None
    param_persistence_threshold: int | None = None
    max_live_parameters: int | None = None
    grad_accum: int = 1
    host_grad_buffer: str = "full"   # full | shared (grad_buffer.py): DeepSpeed's host gradient copy
    copy_back: str = "deepspeed"     # deepspeed (its own copy) | chunked (engine/param_copy_back.py)
    overlap_step: bool = False       # zero.overlap_step resolved on (ds_config: persistence threshold 0)
    block_mask: bool = False         # packed rows under transformers' dense [s x s] block mask
                                     # (kernels.packed_attention: mask; per-document attention has none)
    flash_attn_4: bool = False       # flash-attn-4's kernels run (its host runtime)
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    quantize: str = "none"           # the frozen base linears under LoRA or blocks: none | nf4 | int8
    sparse_blocks: int = 0           # block-sparse finetuning: blocks trained per target linear (0 = off)
    sparse_block_size: int = 64      # rows and columns of a block
    sparse_targets: tuple[str, ...] = ()  # the linears that train blocks (sparse.target_modules)
    optimizer: str = "adamw"         # adamw | adamw_8bit | paged_adamw_8bit (8-bit m, v on the GPU)
    sequence_parallel: int = 1       # hardware.sequence_parallel: each rank holds seq / N tokens
    # the data, for the speed heuristic only (memory does not depend on them): sum(L_i^2) /
    # sum(L_i) over the rows' documents (None: seq_len, one document a row) and the share of the
    # rows' tokens that is padding (tokens/s then counts the rest, as a run's own does)
    attention_length: float | None = None
    padding: float = 0.0
    # the disk under zero.nvme_path, for the speed heuristic only: read and write bytes a second
    # (None: speed.NVME_BYTES_PER_S each way; `longft placement --disk-bandwidth`)
    disk_read_bps: float | None = None
    disk_write_bps: float | None = None

    def at_length(self, seq: int) -> "Setup":
        """This setup at another sequence length (a longest-context search): documents longer than
        `seq` are cut to it, so the data's attention length is clamped to `seq`."""
        span = self.attention_length
        return dataclasses.replace(self, seq_len=seq,
                                   attention_length=None if span is None else min(span, seq))

    @property
    def frozen_base(self) -> bool:
        """The base weights are frozen: LoRA's adapters or block-sparse's blocks train beside them."""
        return self.lora_rank > 0 or self.sparse_blocks > 0

    @property
    def local_tokens(self) -> int:
        """Tokens of a micro-step on one rank: micro x seq, over N ranks of a sequence."""
        return self.micro_batch * self.seq_len // self.sequence_parallel

    @property
    def offload_device(self) -> str:
        """zero.offload_optimizer as params.yaml spells it: none | cpu | nvme."""
        return "nvme" if self.nvme else "cpu" if self.offload_optimizer else "none"

    def problems(self) -> list[str]:
        p = []
        if self.micro_batch < 1 or self.seq_len < 1 or self.world_size < 1 or self.ranks_per_node < 1:
            p.append("micro_batch, seq_len, world_size and ranks_per_node must be >= 1")
        sp = self.sequence_parallel
        if sp < 1 or self.ranks_per_node % sp or self.seq_len % sp:
            p.append(f"sequence_parallel {sp} must be >= 1 and divide ranks_per_node "
                     f"({self.ranks_per_node}) and seq_len ({self.seq_len})")
        if self.attention_length is not None and not 0 < self.attention_length <= self.seq_len:
            p.append(f"attention_length {self.attention_length} must be in (0, seq_len "
                     f"{self.seq_len}]")
        if not 0 <= self.padding < 1:
            p.append(f"padding {self.padding} must be in [0, 1)")
        if self.device not in ("cuda", "cpu"):
            p.append(f"device {self.device!r} is not cuda or cpu")
        if self.precision not in ("bf16", "fp16", "fp32"):
            p.append(f"precision {self.precision!r} is not bf16, fp16 or fp32")
        if self.attention not in ("flash_attention_2", "sdpa", "flash_attn_4", "eager"):
            p.append(f"attention {self.attention!r} is not flash_attention_2, sdpa, flash_attn_4 "
                     "or eager")
        if self.sdpa_backend not in ("default", "flash", "cudnn", "efficient", "math"):
            p.append(f"sdpa_backend {self.sdpa_backend!r} is not default, flash, cudnn, efficient or math")
        if self.checkpointing not in ("none", "gpu", "cpu_offload"):
            p.append(f"checkpointing {self.checkpointing!r} is not none, gpu or cpu_offload")
        if self.zero_stage not in (2, 3):
            p.append(f"zero_stage {self.zero_stage} is not 2 or 3")
        if self.offload_param and self.zero_stage != 3:
            p.append("offload_param needs zero_stage 3")
        if not 0 < self.offload_ratio <= 1:
            p.append(f"offload_ratio {self.offload_ratio} is not in (0, 1]")
        elif self.offload_ratio < 1 and not (self.offload_optimizer and self.zero_stage == 3
                                             and not self.nvme and not self.offload_param):
            p.append("offload_ratio < 1 needs offload_optimizer to the CPU, zero_stage 3 and no "
                     "offload_param")
        if self.nvme and not (self.offload_optimizer and self.zero_stage == 3):
            p.append("nvme needs offload_optimizer and zero_stage 3")
        if self.optimizer_states not in ("fp32", "bf16"):
            p.append(f"optimizer_states {self.optimizer_states!r} is not fp32 or bf16")
        elif self.optimizer_states == "bf16" and self.precision != "bf16":
            p.append("optimizer_states bf16 needs precision bf16")
        if self.copy_back not in ("chunked", "deepspeed"):
            p.append(f"copy_back {self.copy_back!r} is not chunked or deepspeed")
        if self.quantize not in ("none", "nf4", "int8"):
            p.append(f"quantize {self.quantize!r} is not none, nf4 or int8")
        elif self.quantize != "none" and (
                not qlora.quantized_base(self.lora_rank, self.quantize, self.sparse_blocks)
                or self.zero_stage != qlora.QLORA_STAGE):
            p.append(f"quantize (a quantized base) needs lora_rank > 0 or sparse_blocks > 0, and "
                     f"zero_stage {qlora.QLORA_STAGE}")
        if self.sparse_blocks and (self.lora_rank or self.sparse_block_size < 1):
            p.append("sparse_blocks needs lora_rank 0 and sparse_block_size >= 1")
        if self.optimizer not in ("adamw", "adamw_8bit", "paged_adamw_8bit"):
            p.append(f"optimizer {self.optimizer!r} is not adamw, adamw_8bit or paged_adamw_8bit")
        elif self.optimizer != "adamw" and self.offload_optimizer:
            p.append(f"optimizer {self.optimizer} keeps its 8-bit states on the GPU: it needs "
                     "offload_optimizer none")
        if self.sub_group_size < 1:
            p.append("sub_group_size must be >= 1")
        if self.host_grad_buffer not in ("full", "shared"):
            p.append(f"host_grad_buffer {self.host_grad_buffer!r} is not full or shared")
        elif self.host_grad_buffer == "shared" and why_not(
                self.zero_stage, self.offload_device, self.grad_accum, self.precision):
            p.append("host_grad_buffer shared needs zero_stage 3, offload_optimizer, grad_accum 1 "
                     "and not fp16")
        return p


@dataclass(frozen=True)
class Item:
    name: str
    where: str                       # "gpu" (per rank), "host" or "disk" (per node)
    bytes: int
    phases: tuple[str, ...]          # GPU: the PHASES it is alive in; host: HOST_PHASES
    formula: str


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    items: tuple[Item, ...]
    gpu_phases: dict                 # phase -> bytes
    gpu_peak_phase: str
    gpu_allocated: int               # predicts torch.cuda.max_memory_allocated()
    gpu_reserved: int                # x reserved_factor(): predicts max_memory_reserved()
    gpu_nvml: int                    # + CUDA_CONTEXT_BYTES: predicts NVML device used
    host_rss: int                    # predicts process-tree RSS peak of one node
    host_moments: dict               # HOST_PHASES moment -> bytes
    host_peak_moment: str            # the moment host_rss is taken at

    def gpu_items(self) -> list[Item]:
        return [i for i in self.items if i.where == "gpu"]

    def host_items(self) -> list[Item]:
        return [i for i in self.items if i.where == "host"]

    @property
    def disk_bytes(self) -> int:
        """Bytes of the NVMe state files per node (offload_optimizer nvme; else 0)."""
        return sum(i.bytes for i in self.items if i.where == "disk")


@dataclass(frozen=True)
class Fit:
    gpu_ok: bool | None              # None: no GPU size to compare with
    host_ok: bool | None
    reasons: tuple[str, ...]
    disk_ok: bool | None = None      # None: nothing on disk, or no free space to compare with

    @property
    def ok(self) -> bool:
        return self.gpu_ok is not False and self.host_ok is not False and self.disk_ok is not False
