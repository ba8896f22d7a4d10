"""Predict a run's memory before it runs: peak GPU memory per rank and peak host memory per node.

    from longft.estimate import Setup, estimate, format_table
    print(format_table(estimate(arch, Setup(micro_batch=4, seq_len=16384))))

`estimate(arch, setup)` is a pure function of the architecture numbers (`plan.architecture()`) and
a `Setup` (micro-batch, sequence length, ranks, precision, kernels, checkpointing, ZeRO placement).
It returns every item in bytes: model states, gathered parameters, activation checkpoints, the
working set of the one decoder layer being recomputed, the loss, DeepSpeed buffers and pinned host
buffers. The GPU peak is the largest of three moments of an iteration (end of the fused loss,
backward of the last decoder layer, optimizer step) and predicts torch's max allocated memory; the
host peak is the steady state after the first optimizer step and predicts the process-tree RSS.

Every formula, where each tensor comes from (DeepSpeed 0.19 / torch 2.11 / transformers 5 / Liger
0.8 code paths) and the calibration on the H200 rows are in docs/estimator.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GIB = 2**30
PHASES = ("loss", "backward", "step")
"""GPU moments compared for the peak: end of the forward (fused loss computed), backward of the
last decoder layer (all checkpoints still held), optimizer step (activations gone)."""

# ---------------------------------------------------------------- calibration (docs/estimator.md)
CUDA_CONTEXT_BYTES = int(1.9 * GIB)
"""NVML used minus torch reserved on the H200 rows: 1.89 and 1.93 GiB (CUDA context, cuBLAS/cuDNN
handles, NCCL, loaded kernels, driver reservations). Not part of torch's allocator."""
RESERVED_FACTOR = 1.2
"""torch max reserved / max allocated on the H200 rows: 1.17 and 1.24 (caching, fragmentation)."""
RANK_BASE_BYTES = int(3.44 * GIB)
"""Host RSS of one rank with nothing offloaded: python, torch, CUDA/cuBLAS/cuDNN/NCCL libraries,
the CUDA context's host side, DeepSpeed, transformers."""
LAUNCHER_BASE_BYTES = int(1.50 * GIB)
"""Host RSS of the launcher side of the tree (stage process, deepspeed runner and launch). With the
per-rank part this adds up to the 4.94 GiB measured on H200 row (a); the split is assumed."""
CPU_RANK_BASE_BYTES = int(0.74 * GIB)
CPU_LAUNCHER_BASE_BYTES = int(0.45 * GIB)
"""The same two on a CPU-only run (no CUDA libraries): with the tiny model's tensors they add up to
the 1.23 GiB the repository's CPU run measured (metrics/train.json); the split is assumed."""
DS_SUB_GROUP_SIZE = 10**9
"""DeepSpeed's default zero_optimization.sub_group_size (ds_config does not set it): the optimizer
step and its fp32 gradient buffers work on groups of about this many parameter elements."""
OFFLOAD_MIN_BYTES = 1 << 20
"""offload.py (checkpointing cpu_offload) moves every saved tensor of at least this size that is
saved outside the checkpointed layers to pinned host memory."""
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
    attention: str = "sdpa"          # flash_attention_2 | sdpa | eager
    sdpa_backend: str = "default"    # default | flash | cudnn | efficient | math
    liger: bool = True
    checkpointing: str = "gpu"       # none | gpu | cpu_offload
    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = True
    grad_accum: int = 1
    packed: bool = False             # rows hold several documents: sdpa/eager get a [s x s] mask
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        p = []
        if self.micro_batch < 1 or self.seq_len < 1 or self.world_size < 1 or self.ranks_per_node < 1:
            p.append("micro_batch, seq_len, world_size and ranks_per_node must be >= 1")
        if self.device not in ("cuda", "cpu"):
            p.append(f"device {self.device!r} is not cuda or cpu")
        if self.precision not in ("bf16", "fp16", "fp32"):
            p.append(f"precision {self.precision!r} is not bf16, fp16 or fp32")
        if self.attention not in ("flash_attention_2", "sdpa", "eager"):
            p.append(f"attention {self.attention!r} is not flash_attention_2, sdpa or eager")
        if self.sdpa_backend not in ("default", "flash", "cudnn", "efficient", "math"):
            p.append(f"sdpa_backend {self.sdpa_backend!r} is not default, flash, cudnn, efficient or math")
        if self.checkpointing not in ("none", "gpu", "cpu_offload"):
            p.append(f"checkpointing {self.checkpointing!r} is not none, gpu or cpu_offload")
        if self.zero_stage not in (2, 3):
            p.append(f"zero_stage {self.zero_stage} is not 2 or 3")
        if self.offload_param and self.zero_stage != 3:
            p.append("offload_param needs zero_stage 3")
        return p


@dataclass(frozen=True)
class Item:
    name: str
    where: str                       # "gpu" (per rank) or "host" (per node)
    bytes: int
    phases: tuple[str, ...]          # GPU: the PHASES it is alive in; host: ("steady",)
    formula: str


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    items: tuple[Item, ...]
    gpu_phases: dict                 # phase -> bytes
    gpu_peak_phase: str
    gpu_allocated: int               # predicts torch.cuda.max_memory_allocated()
    gpu_reserved: int                # x RESERVED_FACTOR: predicts max_memory_reserved()
    gpu_nvml: int                    # + CUDA_CONTEXT_BYTES: predicts NVML device used
    host_rss: int                    # predicts process-tree RSS peak of one node

    def gpu_items(self) -> list[Item]:
        return [i for i in self.items if i.where == "gpu"]

    def host_items(self) -> list[Item]:
        return [i for i in self.items if i.where == "host"]


# ---------------------------------------------------------------- architecture


def _arch(arch: dict) -> dict:
    h, heads = int(arch["hidden_size"]), int(arch["num_attention_heads"])
    d = int(arch.get("head_dim") or h // heads)
    return {"h": h, "I": int(arch["intermediate_size"]), "L": int(arch["num_hidden_layers"]),
            "H": heads, "kv": int(arch.get("num_key_value_heads") or heads), "d": d,
            "V": int(arch["vocab_size"]), "tied": bool(arch.get("tie_word_embeddings")),
            # Qwen2 has q/k/v biases without saying so in its config.
            "qkv_bias": bool(arch.get("attention_bias")) or arch.get("model_type") == "qwen2"}


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linear_shapes(a: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each decoder-layer linear."""
    h, I, H, kv, d = a["h"], a["I"], a["H"], a["kv"], a["d"]
    return {"q_proj": (h, H * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (H * d, h),
            "gate_proj": (h, I), "up_proj": (h, I), "down_proj": (I, h)}


def layer_params(arch: dict) -> list[tuple[str, int]]:
    """(name, numel) of one decoder layer, in model.parameters() order (Llama/Mistral/Qwen2)."""
    a = _arch(arch)
    out = []
    for name, (i, o) in _linear_shapes(a).items():
        out.append((name, i * o))
        if a["qkv_bias"] and name in ("q_proj", "k_proj", "v_proj"):
            out.append((name + ".bias", o))
    return out + [("input_layernorm", a["h"]), ("post_attention_layernorm", a["h"])]


def param_numels(arch: dict) -> list[tuple[str, int]]:
    """(name, numel) of every parameter in model.parameters() order; a tied lm_head appears once."""
    a = _arch(arch)
    out = [("embed_tokens", a["V"] * a["h"])]
    for i in range(a["L"]):
        out += [(f"layers.{i}.{n}", k) for n, k in layer_params(arch)]
    out.append(("norm", a["h"]))
    if not a["tied"]:
        out.append(("lm_head", a["V"] * a["h"]))
    return out


def trainable_numels(arch: dict, s: Setup) -> list[int]:
    """Numels of the parameters the optimizer owns: all, or LoRA A and B of each target linear."""
    if s.lora_rank <= 0:
        return [n for _, n in param_numels(arch)]
    a = _arch(arch)
    out = []
    for _ in range(a["L"]):
        for name, (i, o) in _linear_shapes(a).items():
            if name in s.lora_targets:
                out += [s.lora_rank * i, o * s.lora_rank]
    return out


def sub_groups(numels: list[int], size: int = DS_SUB_GROUP_SIZE) -> list[int]:
    """Element counts of DeepSpeed ZeRO-3's optimizer sub-groups (stage3._create_fp16_sub_groups):
    parameters are appended in order until a group reaches `size`."""
    total = sum(numels)
    if size >= total:
        return [total]
    groups, cur = [], 0
    for i, n in enumerate(numels):
        cur += n
        if cur >= size or i == len(numels) - 1:
            groups.append(cur)
            cur = 0
    return groups


def pinned(n: int) -> int:
    """Bytes that a pinned host buffer of n bytes really takes: torch's CachingHostAllocator rounds
    every request up to a power of two and keeps freed blocks cached (resident) for reuse."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def pinned_pool(events: list[tuple[str, str, int]], rounding: bool = True
                ) -> tuple[dict[str, int], int]:
    """Replay pinned allocations through torch's host caching allocator.

    events: ("alloc", key, bytes) or ("free", key, 0). A request reuses a cached free block of the
    same power-of-two size, else takes a new one; blocks are never returned to the OS. Returns
    (rounded bytes of the blocks still allocated, by key) and the resident total (all blocks).
    rounding=False (a CPU run: pin_memory does nothing) keeps sizes and frees for real.
    """
    if not rounding:
        live = {}
        for op, key, n in events:
            if op == "alloc":
                live[key] = n
            else:
                live.pop(key)
        return live, sum(live.values())
    free: dict[int, int] = {}
    live: dict[str, int] = {}
    resident = 0
    for op, key, n in events:
        if op == "alloc":
            r = pinned(n)
            if free.get(r, 0) > 0:
                free[r] -= 1
            else:
                resident += r
            live[key] = r
        else:
            r = live.pop(key)
            free[r] = free.get(r, 0) + 1
    return live, resident


def zero_knobs(s: Setup, hidden_size: int) -> dict:
    """The DeepSpeed bucket and threshold numbers longft's ds_config writes for this setup."""
    from .config import Config, ZeroConfig
    from .ds_config import zero_section

    cfg = Config(zero=ZeroConfig(stage=s.zero_stage, overlap_comm=s.overlap_comm,
                                 offload_optimizer="cpu" if s.offload_optimizer else "none",
                                 offload_param="cpu" if s.offload_param else "none"))
    return zero_section(cfg, hidden_size)


# ---------------------------------------------------------------- activations


def layer_activation_bytes(arch: dict, s: Setup) -> dict[str, int]:
    """Bytes per token of one decoder layer: tensors saved for backward ("saved") and the largest
    moment of its backward ("peak", saved tensors + transients). See docs/estimator.md."""
    a = _arch(arch)
    h, I, H, kv, d = a["h"], a["I"], a["H"], a["kv"], a["d"]
    x = 4 if s.precision == "fp32" else 2          # activation bytes
    Hd, kvd = H * d, kv * d
    quadratic = s.attention == "eager" or (s.attention == "sdpa" and s.sdpa_backend == "math")
    # K/V heads repeated to H: eager, the efficient kernel (no enable_gqa) and any sdpa with a mask.
    expand = kv != H and (quadratic or (s.attention == "sdpa" and (
        s.sdpa_backend == "efficient" or s.packed)))
    k_saved = Hd if expand else kvd
    if s.liger:
        norms = 2 * x * h                                    # RMSNorm outputs (input is kept anyway)
        qk = x * (Hd + k_saved)                              # RoPE rotates q, k in place
        mlp = 3 * x * I                                      # gate, up, silu(gate)*up
        mlp_bwd = x * I                                      # d(silu*up); SwiGLU grads land in place
    else:
        norms = 2 * (4 * h + 2 * x * h)                      # fp32 upcast, normed, weight * normed
        qk = x * 3 * Hd + x * 3 * k_saved                    # q, rotate_half(q), q_embed; same for k
        mlp = 4 * x * I                                      # gate, act(gate), up, act*up
        mlp_bwd = 3 * x * I                                  # d(prod), d(act), d(up)
    v = x * k_saved
    attn_out = x * Hd                                        # kernel output = o_proj input (no copy)
    residual = x * h                                         # h1 = x + attn, post-norm input
    small = 2 * 4 + 4 * H                                    # rstd x2, log-sum-exp (fp32)
    # eager / math kernel: softmax output in fp32 and probabilities in x, H x seq per query token
    probs = H * s.seq_len * (4 + x) if quadratic else 0
    saved = norms + qk + v + attn_out + residual + mlp + small + probs
    dout = x * h                                             # gradient arriving at the layer output
    peak_mlp = saved + mlp_bwd + dout
    # attention backward: MLP tensors are gone; dq (+ fp32 accumulator), dk, dv (expanded for GQA)
    attn_alive = norms // 2 + qk + v + attn_out + small + probs + x * Hd + x * h  # + d_out, d_h1
    attn_tmp = x * Hd + 4 * Hd + 2 * x * kvd + (2 * x * Hd if kv != H else 0) + probs
    peak_attn = attn_alive + attn_tmp
    recompute = saved + 2 * x * h                            # end of recompute: down out + layer out
    return {"saved": saved, "peak": max(peak_mlp, peak_attn, recompute),
            "mlp_peak": peak_mlp, "attn_peak": peak_attn}


def reuse_layers(arch: dict, s: Setup, knobs: dict) -> int:
    """Decoder layers whose gathered ZeRO-3 parameters stay on the GPU besides the current one.

    A module's parameters are not released when the trace shows them used again within
    stage3_max_reuse_distance elements. Layer i's next use after its forward is its backward
    (2 layers of trace per later layer) or, with checkpointing, its recompute (3 per later layer).
    """
    per_layer = sum(n for _, n in layer_params(arch))
    per_step = (2 if s.checkpointing == "none" else 3) * per_layer
    k = max(0, math.ceil(knobs["stage3_max_reuse_distance"] / per_step) - 1)
    a = _arch(arch)
    live_cap = knobs["stage3_max_live_parameters"] // per_layer - 1
    return max(0, min(k, a["L"] - 1, live_cap))


# ---------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class _Numbers:
    """Derived sizes shared by the item builders below."""
    a: dict              # _arch(): h, I, L, H, kv, d, V, tied
    w: int               # bytes of a weight, gradient or activation element
    T: int               # tokens per micro-step: micro-batch x seq
    knobs: dict          # zero_knobs()
    params: list         # param_numels()
    trainable: list      # trainable_numels()
    P: int               # all parameters
    P_r: int             # a rank's share of them (each parameter padded to the world size)
    Pt_r: int            # a rank's share of the trainable ones
    groups: list         # optimizer sub-groups of the rank's trainable share
    layer: int           # parameters of one decoder layer
    biggest: int         # largest parameter of a decoder layer
    largest: int         # largest parameter of the model (the embedding)


def _share(n: int, world: int) -> int:
    """One rank's partition of a parameter of n elements (ZeRO pads it to a multiple of world)."""
    return -(-n // world)


def _numbers(arch: dict, s: Setup) -> _Numbers:
    a, N = _arch(arch), s.world_size
    params, trainable = param_numels(arch), trainable_numels(arch, s)
    per_layer = layer_params(arch)
    return _Numbers(
        a=a, w=4 if s.precision == "fp32" else 2, T=s.micro_batch * s.seq_len,
        knobs=zero_knobs(s, a["h"]), params=params, trainable=trainable,
        P=sum(n for _, n in params), P_r=sum(_share(n, N) for _, n in params),
        Pt_r=sum(_share(n, N) for n in trainable),
        groups=sub_groups([_share(n, N) for n in trainable]) if trainable else [0],
        layer=sum(n for _, n in per_layer), biggest=max(n for _, n in per_layer),
        largest=max(n for _, n in params))


ALL, FB = PHASES, ("loss", "backward")


def _gpu_state_items(arch: dict, s: Setup, n: _Numbers) -> list[Item]:
    """Weights, gathered ZeRO-3 parameters, gradients, optimizer states and step buffers."""
    out: list[Item] = []

    def gpu(name, b, phases, formula):
        out.append(Item(name, "gpu", int(b), tuple(phases), formula))

    w, N, k, z3 = n.w, s.world_size, n.knobs, s.zero_stage == 3
    h, V = n.a["h"], n.a["V"]
    if z3:
        if not s.offload_param:
            gpu("weights: partitions", w * n.P_r, ALL, f"{w} B x {n.P:,} params / {N} ranks")
        if s.offload_param or N > 1:            # a world of one without offload gathers nothing
            kept = reuse_layers(arch, s, k)
            thr = k["stage3_param_persistence_threshold"]
            persist = sum(m for _, m in n.params if m <= thr)
            gpu("weights: persistent small params", w * persist, ALL,
                f"{w} B x {persist:,} (params <= {thr:,} elements stay gathered)")
            gpu("weights: gathered decoder layers", w * n.layer * (1 + kept), ALL,
                f"{w} B x {n.layer:,} per layer x (1 current + {kept} kept by max_reuse_distance)")
            gpu("weights: gathered lm_head", w * V * h, FB if s.liger else ("loss",),
                f"{w} B x vocab {V:,} x h {h:,} (external param of the top module under Liger)"
                if s.liger else f"{w} B x vocab x h while lm_head runs")
            gpu("ZeRO-3 prefetch bucket", w * k["stage3_prefetch_bucket_size"], FB,
                f"{w} B x 0.9 h^2 = {k['stage3_prefetch_bucket_size']:,} elements")
    else:
        gpu("weights: full copy (ZeRO-2)", w * n.P, ALL, f"{w} B x {n.P:,} params on every rank")
    master = 0 if w == 4 else 4                 # fp32 runs update the weights themselves
    if not s.offload_optimizer:
        gpu("gradients: partitions", w * n.Pt_r, ALL,
            f"{w} B x {sum(n.trainable):,} trainable / {N}")
        gpu("optimizer: fp32 master + Adam m, v", (master + 8) * n.Pt_r, ALL,
            f"({master} + 4 + 4) B x {n.Pt_r:,} trainable per rank")
        g = max(n.groups) if z3 else n.Pt_r
        extra = w if w != 4 else 0
        gpu("step: fp32 gradient of the largest sub-group", (4 + extra) * g, ("step",),
            f"(4 + {extra}) B x {g:,} elements (flatten, .float())")
    elif not z3:
        gpu("gradient staging buffer (ZeRO-2 offload)", w * n.largest, ALL,
            f"{w} B x largest param {n.largest:,}")
    bufs = 1 if z3 or not s.overlap_comm else 2
    gpu("gradients: reduce bucket + one in flight",
        w * (bufs * k["reduce_bucket_size"] + n.biggest), ("backward",),
        f"{w} B x ({bufs} x reduce_bucket h^2 + largest layer param {n.biggest:,})")
    return out


def _gpu_activation_items(arch: dict, s: Setup, n: _Numbers) -> list[Item]:
    """Inputs, checkpoints, the recomputed layer, the loss and the tied lm_head gradient."""
    out: list[Item] = []

    def gpu(name, b, phases, formula):
        out.append(Item(name, "gpu", int(b), tuple(phases), formula))

    x, T, w = n.w, n.T, n.w
    h, L, V, d = n.a["h"], n.a["L"], n.a["V"], n.a["d"]
    act = layer_activation_bytes(arch, s)
    gpu("inputs + rotary cos/sin", T * (3 * 8 + 2 * x * d), FB,
        f"micro x seq x (3 int64 ids/labels/positions + 2 x {x} B x head_dim {d})")
    if s.packed and s.attention in ("sdpa", "eager"):
        mb = 1 if s.attention == "sdpa" else x
        gpu("attention mask (packed rows)", s.micro_batch * s.seq_len ** 2 * mb, FB,
            f"micro x seq^2 x {mb} B (block-diagonal mask, shared by the layers)")
    ckpt = T * x * h
    if s.checkpointing == "gpu":
        gpu("activation checkpoints (GPU)", L * ckpt, FB, f"L {L} x micro x seq x h {h} x {x} B")
    elif s.checkpointing == "cpu_offload":
        gpu("activation checkpoints: in use + prefetched", 2 * ckpt, FB,
            f"2 x micro x seq x h x {x} B (the rest in pinned host memory)")
    else:
        gpu("layer inputs (no checkpointing)", L * ckpt, FB, f"L {L} x micro x seq x h x {x} B")
    n_saved = L if s.checkpointing == "none" else 1
    gpu("saved tensors of " + ("all layers" if n_saved > 1 else "the recomputed layer"),
        n_saved * T * act["saved"], FB if n_saved > 1 else ("backward",),
        f"{n_saved} x micro x seq x {act['saved']:,} B/token")
    gpu("backward transients of one layer", T * (act["peak"] - act["saved"]), ("backward",),
        f"micro x seq x {act['peak'] - act['saved']:,} B/token (peak {act['peak']:,} B/token)")
    gpu("final layer output + norm output", 2 * ckpt, ("loss",), "2 x micro x seq x h x B")
    if s.liger:
        chunk = min(1 << (math.ceil(T / math.ceil(V / (LOSS_CHUNK_MEM * h))) - 1).bit_length(), T)
        gpu("fused loss: grads + logits chunk", ckpt + w * V * h + x * chunk * V + 4 * T, ("loss",),
            f"micro x seq x h x {x} + vocab x h x {w} + chunk {chunk:,} x vocab x {x} + 4 x tokens")
    else:
        gpu("logits: fp32 log-softmax + 2 fp32 grads", 12 * T * V, ("loss",),
            "micro x seq x vocab x (4 + 4 + 4) B")
    if n.a["tied"]:
        gpu("tied lm_head grad (held to embedding bwd)", w * V * h, ("backward",),
            f"vocab x h x {w} B")
    return out


def _host_items(arch: dict, s: Setup, n: _Numbers) -> list[Item]:
    """Per node: process baseline, pinned buffers (replayed through torch's host cache), CPU Adam."""
    R, w, N, z3 = s.ranks_per_node, n.w, s.world_size, s.zero_stage == 3
    cuda = s.device == "cuda"
    launcher, rank = ((LAUNCHER_BASE_BYTES, RANK_BASE_BYTES) if cuda
                      else (CPU_LAUNCHER_BASE_BYTES, CPU_RANK_BASE_BYTES))
    out = [Item("process baseline", "host", launcher + R * rank, ("steady",),
                f"launcher {launcher / GIB:.2f} GiB + {R} rank(s) x {rank / GIB:.2f} GiB")]
    events: list[tuple[str, str, int]] = []
    names: dict[str, str] = {}

    def alloc(key, b, name):
        events.append(("alloc", key, b))
        names[key] = name

    if s.offload_param:      # zero.Init pins each partition, then the optimizer moves them to one buffer
        for i, (_, m) in enumerate(n.params):
            alloc(f"init:{i}", w * _share(m, N), "")
        alloc("lp", w * n.P_r, "weights: partitions (pinned)")
        events += [("free", f"init:{i}", 0) for i in range(len(n.params))]
    if s.offload_optimizer and z3:
        for i, g in enumerate(n.groups):
            alloc(f"g32:{i}", 4 * g, "CPU Adam fp32 gradients (pinned)")
        alloc("g16", w * n.Pt_r, "gradients: partitions (pinned)")
    elif s.offload_optimizer:
        alloc("m32", 4 * n.Pt_r, "optimizer: fp32 master (pinned)")
        alloc("p16", w * n.Pt_r, "weights: bf16 staging (pinned)")
        alloc("tmp", w * n.largest, "gradients: staging (pinned)")
        alloc("g32", 4 * n.Pt_r, "CPU Adam fp32 gradients (pinned)")
        if s.grad_accum > 1:
            for i, m in enumerate(n.trainable):
                alloc(f"acc:{i}", w * _share(m, N), "gradient accumulation buffers (pinned)")
    if s.checkpointing == "cpu_offload":
        T, h, V = n.T, n.a["h"], n.a["V"]
        for i in range(n.a["L"]):
            alloc(f"ckpt:{i}", T * w * h, "activation checkpoints (pinned)")
        # the other tensors saved outside the checkpointed layers go too (offload.py)
        outer = [("final norm input", T * w * h), ("final norm rstd", T * 4), ("input ids", T * 8)]
        outer += ([("loss grad_input", T * w * h), ("loss grad_weight", w * V * h)] if s.liger
                  else [("lm_head input", T * w * h), ("log-softmax output", T * V * 4)])
        for key, b in outer:
            if b >= OFFLOAD_MIN_BYTES:
                alloc(f"outer:{key}", b, "other offloaded saved tensors (pinned)")
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
    if resident > sum(live.values()):
        out.append(Item("pinned blocks cached after zero.Init", "host",
                        R * (resident - sum(live.values())), ("steady",),
                        "per-parameter pinned partitions freed into torch's host cache, not reused"))
    if s.offload_optimizer:
        if z3:
            out.append(Item("optimizer: fp32 master", "host", R * 4 * n.Pt_r, ("steady",),
                            f"{R} x 4 B x {n.Pt_r:,}"))
        out.append(Item("optimizer: Adam m, v (CPU Adam)", "host", R * 8 * n.Pt_r, ("steady",),
                        f"{R} x 8 B x {n.Pt_r:,}"))
    return out


def estimate(arch: dict, s: Setup) -> Estimate:
    """Itemised peak GPU memory per rank and host memory per node (bytes) for `s` on `arch`."""
    bad = s.problems()
    if bad:
        raise ValueError("; ".join(bad))
    n = _numbers(arch, s)
    items = (_gpu_state_items(arch, s, n) + _gpu_activation_items(arch, s, n)
             + _host_items(arch, s, n))
    phases = {p: sum(i.bytes for i in items if i.where == "gpu" and p in i.phases) for p in PHASES}
    peak_phase = max(PHASES, key=lambda p: phases[p])
    alloc = phases[peak_phase]
    if s.device == "cpu":    # no GPU: the "gpu" items are the rank's tensors, held in host memory
        items.append(Item("rank tensors (the GPU items, in host RAM)", "host",
                          s.ranks_per_node * alloc, ("steady",),
                          f"{s.ranks_per_node} rank(s) x the {peak_phase} total of the GPU items"))
        alloc = 0
    reserved = int(alloc * RESERVED_FACTOR)
    return Estimate(setup=s, items=tuple(items), gpu_phases=phases, gpu_peak_phase=peak_phase,
                    gpu_allocated=alloc, gpu_reserved=reserved,
                    gpu_nvml=reserved + CUDA_CONTEXT_BYTES if s.device == "cuda" else 0,
                    host_rss=sum(i.bytes for i in items if i.where == "host"))


# ---------------------------------------------------------------- from params, to JSON, checks


def _value(resolved: dict, key: str, default):
    """A resolved choice as hardware.resolve returns it (Choice), as plan.json stores it
    ({"value", "reason"}) or plain."""
    v = resolved.get(key, default)
    if isinstance(v, dict):
        return v.get("value", default)
    return getattr(v, "value", v)


def setup_from_config(cfg, resolved: dict, world_size: int | None = None) -> Setup:
    """The Setup of a validated Config whose `auto` values were resolved (plan.json "resolved")."""
    ws = world_size or cfg.world_size
    micro = cfg.train.micro_batch_size
    return Setup(
        micro_batch=micro, seq_len=cfg.data.max_seq_length, world_size=ws,
        device=_value(resolved, "device", "cuda"),
        ranks_per_node=max(1, min(cfg.hardware.num_gpus, ws)),
        precision=_value(resolved, "precision", "bf16"),
        attention=_value(resolved, "attention", "sdpa"),
        sdpa_backend=_value(resolved, "sdpa_backend", "default"),
        liger=bool(_value(resolved, "liger", False)),
        checkpointing=_value(resolved, "checkpointing", "gpu"),
        zero_stage=cfg.zero.stage, offload_optimizer=cfg.zero.offload_optimizer == "cpu",
        offload_param=cfg.zero.offload_param == "cpu", overlap_comm=cfg.zero.overlap_comm,
        grad_accum=max(1, cfg.train.global_batch_size // (micro * ws)),
        # random rows are one document each; packed real data gets a block-diagonal mask
        packed=cfg.data.pack and cfg.data.source != "random",
        lora_rank=cfg.lora.rank, lora_targets=tuple(cfg.lora.target_modules))


def _gib(n: float) -> float:
    return round(n / GIB, 3)


def to_dict(est: Estimate) -> dict:
    """JSON-able form: bytes and GiB, every item with its formula."""
    def items(where):
        return [{"name": i.name, "bytes": i.bytes, "gib": _gib(i.bytes), "phases": list(i.phases),
                 "formula": i.formula} for i in est.items if i.where == where]
    return {
        "setup": dataclasses.asdict(est.setup),
        "gpu": {"allocated_bytes": est.gpu_allocated, "allocated_gib": _gib(est.gpu_allocated),
                "reserved_bytes": est.gpu_reserved, "reserved_gib": _gib(est.gpu_reserved),
                "nvml_bytes": est.gpu_nvml, "nvml_gib": _gib(est.gpu_nvml),
                "peak_phase": est.gpu_peak_phase,
                "phases_bytes": dict(est.gpu_phases), "items": items("gpu")},
        "host": {"rss_bytes": est.host_rss, "rss_gib": _gib(est.host_rss), "items": items("host")},
        "constants": {"reserved_factor": RESERVED_FACTOR, "cuda_context_bytes": CUDA_CONTEXT_BYTES,
                      "rank_base_bytes": RANK_BASE_BYTES, "launcher_base_bytes": LAUNCHER_BASE_BYTES},
        "per": "gpu: one rank (the largest); host: one node (launcher + its ranks)",
        "doc": "docs/estimator.md",
    }


def estimate_for_plan(cfg, arch: dict, resolved: dict, world_size: int) -> dict:
    """The memory estimate for artifacts/plan.json (JSON-able)."""
    return to_dict(estimate(arch, setup_from_config(cfg, resolved, world_size)))


def _measured(d: dict, *keys):
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d if isinstance(d, (int, float)) else None


def compare(predicted: dict, train_metrics: dict) -> dict:
    """Predicted vs measured peaks (GiB) and relative error (predicted - measured) / measured.

    predicted: estimate_for_plan()'s dict (or a dict holding it under "estimate");
    train_metrics: metrics/train.json. Measurements a run lacks (VRAM on CPU) give null errors.
    """
    est = predicted.get("estimate", predicted)
    rows = {
        "vram_max_allocated": (est["gpu"]["allocated_bytes"], ("peak_vram", "max_allocated_gib")),
        "vram_max_reserved": (est["gpu"]["reserved_bytes"], ("peak_vram", "max_reserved_gib")),
        "vram_nvml_used": (est["gpu"]["nvml_bytes"], ("peak_vram", "nvml_used_gib")),
        "dram_rss_tree": (est["host"]["rss_bytes"], ("peak_dram", "rss_tree_gib")),
    }
    out = {}
    for name, (pred, keys) in rows.items():
        meas = _measured(train_metrics, *keys)
        err = None if not meas else round((pred / GIB - meas) / meas, 4)
        out[name] = {"predicted_gib": _gib(pred), "measured_gib": meas, "rel_error": err}
    return out


@dataclass(frozen=True)
class Fit:
    gpu_ok: bool | None              # None: no GPU size to compare with
    host_ok: bool | None
    reasons: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.gpu_ok is not False and self.host_ok is not False


def fits(est: Estimate, gpu_mem_gib: float | None, host_mem_gib: float | None,
         vram_limit_gib: float | None = None) -> Fit:
    """Does it fit? GPU: the NVML-level prediction (reserved + context) against the card, and the
    reserved prediction against hardware.vram_limit_gib; host: predicted RSS against host RAM."""
    reasons, gpu_ok, host_ok = [], None, None
    if gpu_mem_gib is not None:
        gpu_ok = est.gpu_nvml <= gpu_mem_gib * GIB
        reasons.append(f"GPU: needs {est.gpu_nvml / GIB:.2f} GiB (allocated {est.gpu_allocated / GIB:.2f}"
                       f" x {RESERVED_FACTOR} + context {CUDA_CONTEXT_BYTES / GIB:.1f}) of "
                       f"{gpu_mem_gib:.1f} GiB")
    if vram_limit_gib is not None:
        ok = est.gpu_reserved <= vram_limit_gib * GIB
        gpu_ok = ok if gpu_ok is None else gpu_ok and ok
        reasons.append(f"GPU cap: reserved {est.gpu_reserved / GIB:.2f} GiB of "
                       f"hardware.vram_limit_gib {vram_limit_gib:.1f}")
    if host_mem_gib is not None:
        host_ok = est.host_rss <= host_mem_gib * GIB
        reasons.append(f"host: needs {est.host_rss / GIB:.2f} GiB of {host_mem_gib:.1f} GiB")
    return Fit(gpu_ok, host_ok, tuple(reasons))


def describe(s: Setup) -> str:
    """One line: what the estimate is for."""
    off = "+".join(n for n, on in (("optimizer", s.offload_optimizer), ("params", s.offload_param))
                   if on) or "none"
    attn = s.attention + (f"({s.sdpa_backend})" if s.attention == "sdpa" else "")
    where = "" if s.device == "cuda" else " on CPU (GPU items = the rank's tensors in host RAM)"
    return (f"seq {s.seq_len:,} x micro-batch {s.micro_batch}, {s.world_size} rank(s){where}, "
            f"{s.precision}, {attn}, Liger {'on' if s.liger else 'off'}, checkpointing "
            f"{s.checkpointing}, ZeRO-{s.zero_stage} offload {off}"
            + (f", LoRA r={s.lora_rank}" if s.lora_rank else ""))


def format_table(est: Estimate, fit: Fit | None = None) -> str:
    """The itemised table: GPU items (per rank) with the phases they live in, host items (per
    node), the totals per phase and the predicted torch/NVML/RSS peaks."""
    lines = [describe(est.setup), "",
             f"{'GPU, per rank':48s} {'GiB':>9s}  {'live in':18s} formula"]
    for i in est.gpu_items():
        if i.bytes:
            ph = "all" if i.phases == PHASES else ",".join(i.phases)
            lines.append(f"  {i.name:46s} {i.bytes / GIB:9.3f}  {ph:18s} {i.formula}")
    lines.append("  by phase: " + " | ".join(
        f"{p} {est.gpu_phases[p] / GIB:.3f}" + (" <- peak" if p == est.gpu_peak_phase else "")
        for p in PHASES))
    lines += [f"{'host, per node':48s} {'GiB':>9s}"]
    for i in est.host_items():
        lines.append(f"  {i.name:46s} {i.bytes / GIB:9.3f}  {'':18s} {i.formula}")
    lines += ["",
              f"peak VRAM (torch max allocated)   {est.gpu_allocated / GIB:9.3f} GiB  [{est.gpu_peak_phase}]",
              f"VRAM reserved (x {RESERVED_FACTOR})           {est.gpu_reserved / GIB:9.3f} GiB",
              f"VRAM used, NVML (+ context)       {est.gpu_nvml / GIB:9.3f} GiB",
              f"peak DRAM (process-tree RSS)      {est.host_rss / GIB:9.3f} GiB"]
    if fit is not None:
        lines.append("")
        lines += [f"{r}" for r in fit.reasons]
        verdict = {True: "fits", False: "does NOT fit", None: "not checked"}
        lines.append(f"verdict: GPU {verdict[fit.gpu_ok]}, host {verdict[fit.host_ok]}")
    return "\n".join(lines)
