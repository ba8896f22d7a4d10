"""GPU items of the estimate, per rank: one decoder layer's activation bytes per token, the ZeRO-3
layers kept gathered, and the two item builders (model states; activations and loss). Each item
says the PHASES it is alive in; docs/estimator.md derives every formula.
"""

from __future__ import annotations

import math

from longft.estimate.arch import Numbers, dims, layer_params
from longft.estimate.quantized import adam8_state_bytes, dequant_workspace_bytes
from longft.estimate.types import LOSS_CHUNK_MEM, PHASES, Item, Setup
from longft.model.tiled_mlp import tiles


def layer_activation_bytes(arch: dict, s: Setup) -> dict[str, int]:
    """Bytes per token of one decoder layer: tensors saved for backward ("saved") and the largest
    moment of its backward ("peak", saved tensors + transients). See docs/estimator.md."""
    a = dims(arch)
    h, I, H, kv, d = a["h"], a["I"], a["H"], a["kv"], a["d"]
    x = 4 if s.precision == "fp32" else 2          # activation bytes
    Hd, kvd = H * d, kv * d
    quadratic = s.attention == "eager" or (s.attention == "sdpa" and s.sdpa_backend == "math")
    # K/V heads repeated to H: eager, the efficient kernel (no enable_gqa) and any sdpa with a mask.
    expand = kv != H and (quadratic or (s.attention == "sdpa" and (
        s.sdpa_backend == "efficient" or s.block_mask)))
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
    mlp_tile = 0
    if s.tiled_mlp:
        # TiledMLP saves only its input (the norm output, counted above); its backward holds a
        # [tokens, h] input-grad buffer and one tile's intermediates at a time.
        tokens = s.local_tokens
        if tiles(tokens, s.tile_tokens) > 1:
            mlp_tile = int(s.tile_tokens / tokens * (mlp + mlp_bwd + 2 * x * h)) + x * h
            mlp, mlp_bwd = 0, 0
    v = x * k_saved
    attn_out = x * Hd                                        # kernel output = o_proj input (no copy)
    residual = x * h                                         # h1 = x + attn, post-norm input
    small = 2 * 4 + 4 * H                                    # rstd x2, log-sum-exp (fp32)
    # eager / math kernel: softmax output in fp32 and probabilities in x, H x seq per query token
    probs = H * s.seq_len * (4 + x) if quadratic else 0
    saved = norms + qk + v + attn_out + residual + mlp + small + probs
    a2a = ulysses_bytes(arch, s)
    saved += a2a["saved"]
    dout = x * h                                             # gradient arriving at the layer output
    peak_mlp = saved + mlp_bwd + dout + mlp_tile
    # attention backward: MLP tensors are gone; dq (+ fp32 accumulator), dk, dv (expanded for GQA)
    attn_alive = norms // 2 + qk + v + attn_out + small + probs + x * Hd + x * h  # + d_out, d_h1
    attn_tmp = x * Hd + 4 * Hd + 2 * x * kvd + (2 * x * Hd if kv != H else 0) + probs
    peak_attn = attn_alive + a2a["saved"] + attn_tmp + a2a["buffers"]
    # end of recompute: down out + layer out; LLM.int8 linears hold their int8 / int32 products then
    recompute = saved + max(2 * x * h, int8_forward_bytes(arch, s))
    return {"saved": saved, "peak": max(peak_mlp, peak_attn, recompute),
            "mlp_peak": peak_mlp, "attn_peak": peak_attn}


FROZEN_BASE_SURPLUS_H = 4.9
"""The measured surplus over the itemised estimate, per token in units of `x·h` (the activation
dtype's bytes times the hidden size), fitted on the emulated 24 GiB QLoRA row at 32K; not yet
attributed. The NF4 base's figure; a bf16 base has more (FROZEN_BASE_SURPLUS_BF16_H). Where it is
counted: `frozen_base_surplus`; the rows behind it: docs/estimator.md, "Measured surplus"."""

FROZEN_BASE_SURPLUS_BF16_H = {"lora": 6.0, "sparse": 7.7}
"""The same surplus over a frozen base in the training dtype (not quantized) under checkpoint
offload, by method: the largest per-token figure its measured rows showed (the 24 GiB rows of
2026-12-05: LoRA r16 5.4 and 6.0 `x·h` at micro-batch 1 and 2, block-sparse 7.7 and 7.6), so the
estimate is on the safe side of every one."""


def frozen_base_surplus(s: Setup) -> float:
    """The surplus counted, in `x·h` bytes per token (0.0: none): NF4 QLoRA, and a frozen base
    (LoRA, block-sparse; quantized or not) under checkpoint offload, where the measured rows show
    it. A frozen base with checkpoints on the GPU (the q3 LoRA rows) and full finetuning with
    checkpoints offloaded (h200-1b-32k-packed-cpuckpt) measured none."""
    if not (s.quantize == "nf4" or (s.frozen_base and s.checkpointing == "cpu_offload")):
        return 0.0
    if s.quantize != "none":   # measured over NF4; int8 has no measured row and takes NF4's
        return FROZEN_BASE_SURPLUS_H
    return FROZEN_BASE_SURPLUS_BF16_H["sparse" if s.sparse_blocks else "lora"]


def int8_forward_bytes(arch: dict, s: Setup) -> int:
    """Bytes per token that an LLM.int8 linear's forward (and recompute) holds besides its input
    and output: the input in int8 and the product as int32 and as fp16 before the cast to the
    training dtype (in + 4 out + 2 out), for the largest linear; the MLP's over one tile when the
    tiled MLP tiles. 0 unless quantize is int8."""
    if s.quantize != "int8":
        return 0
    a = dims(arch)
    h, I, Hd = a["h"], a["I"], a["H"] * a["d"]
    attn = max(h + 6 * Hd, Hd + 6 * h)                       # q (k, v are narrower), o
    mlp = max(h + 6 * I, I + 6 * h)                          # gate / up, down
    if s.tiled_mlp and tiles(s.local_tokens, s.tile_tokens) > 1:
        mlp = int(mlp * s.tile_tokens / s.local_tokens)
    return max(attn, mlp)


def ulysses_bytes(arch: dict, s: Setup) -> dict[str, int]:
    """Bytes per local token that DeepSpeed's Ulysses attention adds to a layer (sequence_parallel
    N > 1; 0 without). Each rank holds seq / N tokens with all heads; the all-to-all turns q, k, v
    into the whole sequence with heads / N (k, v replicated when N > K/V heads), the same bytes
    per local token. "saved": the exchanged q, k, v and the kernel's output before the way back,
    kept for backward besides the layer's own q, k, v; "buffers": the contiguous send copy and the
    receive buffer of the largest exchange in flight (forward and backward alike)."""
    n = s.sequence_parallel
    if n <= 1:
        return {"saved": 0, "buffers": 0}
    a = dims(arch)
    x, H, kv, d = 4 if s.precision == "fp32" else 2, a["H"], a["kv"], a["d"]
    kv_eff = max(kv, n)  # replicated up to N heads when N > kv
    qkv = x * d * (H + 2 * kv_eff)
    return {"saved": qkv + x * H * d, "buffers": 2 * qkv}


def reuse_layers(arch: dict, s: Setup, knobs: dict) -> int:
    """Decoder layers whose gathered ZeRO-3 parameters stay on the GPU besides the current one.

    A module's parameters are not released when the trace shows them used again within
    stage3_max_reuse_distance elements. Layer i's next use after its forward is its backward
    (2 layers of trace per later layer) or, with checkpointing, its recompute (3 per later layer).
    """
    per_layer = sum(n for _, n in layer_params(arch))
    per_step = (2 if s.checkpointing == "none" else 3) * per_layer
    k = max(0, math.ceil(knobs["stage3_max_reuse_distance"] / per_step) - 1)
    a = dims(arch)
    live_cap = knobs["stage3_max_live_parameters"] // per_layer - 1
    return max(0, min(k, a["L"] - 1, live_cap))


ALL, FB = PHASES, ("loss", "backward")


def gpu_state_items(arch: dict, s: Setup, n: Numbers) -> list[Item]:
    """Weights, gathered ZeRO-3 parameters, gradients, optimizer states and step buffers."""
    out: list[Item] = []

    def gpu(name, b, phases, formula):
        out.append(Item(name, "gpu", int(b), tuple(phases), formula))

    w, N, k, z3 = n.w, s.world_size, n.knobs, s.zero_stage == 3
    h, V = n.a["h"], n.a["V"]
    if z3:
        if not s.offload_param:
            gpu("weights: partitions", w * n.P_r, ALL, f"{w} B x {n.P:,} params / {N} ranks")
            if n.adapters:
                gpu(f"weights: {_trained(s)} (partitions)", w * n.Pt_r, ALL,
                    f"{w} B x {n.adapters:,} adapter params / {N} ranks")
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
                f"{w} B x {'0.9 h^2' if s.prefetch_bucket_size is None else 'zero.prefetch_bucket_size'}"
                f" = {k['stage3_prefetch_bucket_size']:,} elements")
    else:
        out.extend(zero2_weight_items(s, n))
    ms = n.ms
    kind = "bf16" if ms == 2 else "fp32"
    if not s.offload_optimizer:
        # fp32 runs, and bf16 master weights, update the training weights themselves
        master = 0 if w == 4 or ms == w else 4
        gpu("gradients: partitions", w * n.Pt_r, ALL,
            f"{w} B x {sum(n.trainable):,} trainable / {N}")
        if s.optimizer == "adamw":
            gpu(f"optimizer: {kind} master + Adam m, v", (master + 2 * ms) * n.Pt_r, ALL,
                f"({master} + {ms} + {ms}) B x {n.Pt_r:,} trainable per rank")
        else:
            out.extend(adam8_items(s, n, master, kind))
        g = max(n.groups) if z3 else n.Pt_r
        extra = w if w != ms else 0
        gpu(f"step: {kind} gradient of the largest sub-group", (ms + extra) * g, ("step",),
            f"({ms} + {extra}) B x {g:,} elements (flatten, .{kind}())")
    elif z3 and n.gpu_groups:                   # offload_ratio < 1: these groups step on the GPU
        G = sum(n.gpu_groups)
        gpu(f"optimizer on GPU: {kind} master, grad, m, v", 4 * ms * G, ALL,
            f"4 x {ms} B x {G:,} elements ({len(n.gpu_groups)} of {len(n.groups)} sub-groups: "
            f"offload_ratio {s.offload_ratio:g})")
        g = max(n.gpu_groups)
        gpu("step: AdamW temporary of the largest GPU sub-group", ms * g, ("step",),
            f"{ms} B x {g:,} elements (torch AdamW's sqrt(v) buffer)")
    elif not z3:
        gpu("gradient staging buffer (ZeRO-2 offload)", w * n.largest, ALL,
            f"{w} B x largest param {n.largest:,}")
    bufs = 1 if z3 or not s.overlap_comm else 2
    gpu("gradients: reduce bucket + one in flight",
        w * (bufs * k["reduce_bucket_size"] + n.biggest), ("backward",),
        f"{w} B x ({bufs} x reduce_bucket {k['reduce_bucket_size']:,} + largest layer param {n.biggest:,})")
    if s.sparse_blocks:
        out.append(_sparse_warmup(arch, s))
    return out


def zero2_weight_items(s: Setup, n: Numbers) -> list[Item]:
    """ZeRO-2: every rank holds the whole model; over a quantized base (QLoRA, block-sparse over
    nf4 / int8) the targeted decoder linears in bitsandbytes' blocks (and one dequantized at a
    time), the rest in the training dtype."""
    w, out = n.w, []
    if n.Pq:
        q = s.quantize
        per = "(1/2 + 1/64 + 4/(64 x 256)) B" if q == "nf4" else "(1 B + 4 B per output row)"
        out.append(Item(f"weights: base linears in {q} (bitsandbytes)", "gpu", n.quant_bytes, ALL,
                        f"{n.Pq:,} params x {per}, plus constants"))
        out.append(Item("weights: embeddings, lm_head, norms (ZeRO-2)", "gpu", w * (n.P - n.Pq), ALL,
                        f"{w} B x {n.P - n.Pq:,} params not quantized"))
        out.append(Item("dequantized weight of one linear (transient)", "gpu",
                        dequant_workspace_bytes(q, n.biggest_q, w), ("backward",),
                        f"{w} B x largest quantized weight {n.biggest_q:,}"
                        + (" + fp32 absmax" if q == "nf4" else "")))
    else:
        out.append(Item("weights: full copy (ZeRO-2)", "gpu", w * n.P, ALL,
                        f"{w} B x {n.P:,} params on every rank"))
    if n.adapters:
        out.append(Item(f"weights: {_trained(s)}", "gpu", w * n.adapters, ALL,
                        f"{w} B x {n.adapters:,} {'block' if s.sparse_blocks else 'adapter'} "
                        "params on every rank"))
    return out


def _trained(s: Setup) -> str:
    return "trained blocks" if s.sparse_blocks else "LoRA adapters"


def _sparse_warmup(arch: dict, s: Setup) -> Item:
    """Block-sparse's warm-up (engine/block_warmup.py), before the first step: one target's full
    fp32 gradient dy^T x at a time, and every target's fp32 block-mass buffer."""
    from longft.estimate.arch import _linear_shapes, dims, largest_target

    a, b = dims(arch), s.sparse_block_size
    masses = a["L"] * sum(i * o for n, (i, o) in _linear_shapes(a).items()
                          if n in s.sparse_targets) // (b * b)
    big = largest_target(arch, s.sparse_targets)
    return Item("sparse warm-up: fp32 gradient of the largest target + block masses", "gpu",
                4 * (big + masses), ("backward",),
                f"4 B x ({big:,} + {masses:,} blocks); before the first step only")


def adam8_items(s: Setup, n: Numbers, master: int, kind: str) -> list[Item]:
    """bitsandbytes' 8-bit AdamW on the GPU: DeepSpeed's master weights as usual, Adam's m and v in
    8-bit blocks over each tensor the optimizer steps (ZeRO-3: the sub-groups; ZeRO-2: the rank's
    flat partition). Paged states may spill to the host under pressure; they are counted here."""
    tensors = n.groups if s.zero_stage == 3 else [n.Pt_r]
    out = []
    if master:
        out.append(Item(f"optimizer: {kind} master", "gpu", master * n.Pt_r, ALL,
                        f"{master} B x {n.Pt_r:,} trainable per rank"))
    paged = " (paged: counted on the GPU)" if s.optimizer.startswith("paged") else ""
    out.append(Item("optimizer: Adam m, v in 8-bit blocks" + paged, "gpu",
                    sum(adam8_state_bytes(t) for t in tensors), ALL,
                    f"(2 B + 2 x 4 B per 256) x {n.Pt_r:,} trainable per rank"))
    return out


def gpu_activation_items(arch: dict, s: Setup, n: Numbers) -> list[Item]:
    """Inputs, checkpoints, the recomputed layer, the loss and the tied lm_head gradient."""
    out: list[Item] = []

    def gpu(name, b, phases, formula):
        out.append(Item(name, "gpu", int(b), tuple(phases), formula))

    x, T, w = n.w, n.T, n.w
    h, L, V, d = n.a["h"], n.a["L"], n.a["V"], n.a["d"]
    act = layer_activation_bytes(arch, s)
    gpu("inputs + rotary cos/sin", T * (3 * 8 + 2 * x * d), FB,
        f"micro x seq x (3 int64 ids/labels/positions + 2 x {x} B x head_dim {d})")
    if s.block_mask and s.attention in ("sdpa", "eager"):
        mb = 1 if s.attention == "sdpa" else x
        gpu("attention mask (packed rows)", s.micro_batch * s.seq_len ** 2 * mb, FB,
            f"micro x seq^2 x {mb} B (block-diagonal mask, shared by the layers)")
    ckpt = T * x * h
    if s.checkpointing == "gpu":
        gpu("activation checkpoints (GPU)", L * ckpt, FB, f"L {L} x micro x seq x h {h} x {x} B")
    elif s.checkpointing == "cpu_offload":
        # The kept layers' inputs are freed by their backward before the first offloaded one comes
        # back, so at most max(gpu_layers, 2) checkpoints are on the GPU at a time.
        if s.gpu_layers:
            gpu("activation checkpoints kept on the GPU", s.gpu_layers * ckpt, FB,
                f"gpu_layers {s.gpu_layers} x micro x seq x h x {x} B")
        back = 2 if s.ckpt_prefetch else 1   # in use (+ the next one prefetched)
        if s.gpu_layers < back:
            k = back - s.gpu_layers
            gpu("activation checkpoints: in use + prefetched" if s.ckpt_prefetch
                else "activation checkpoints: in use (no prefetch)", k * ckpt, FB,
                f"{k} x micro x seq x h x {x} B (the rest in pinned host memory)")
    else:
        gpu("layer inputs (no checkpointing)", L * ckpt, FB, f"L {L} x micro x seq x h x {x} B")
    if s.keep_attention and s.checkpointing != "none":
        H = n.a["H"]
        k = min(s.keep_attention, L)
        per = T * H * (d * x + 4)
        f = f"micro x seq x heads {H} x (head_dim x {x} B + 4 B log-sum-exp)"
        gpu("attention outputs kept (keep_attention)", k * per, ("loss",), f"keep_attention {k} x {f}")
        if k > 1:  # in backward the recomputed layer's kept output is one of its saved tensors
            gpu("attention outputs kept, besides the recomputed layer's", (k - 1) * per,
                ("backward",), f"(keep_attention {k} - 1) x {f}")
    n_saved = L if s.checkpointing == "none" else 1
    gpu("saved tensors of " + ("all layers" if n_saved > 1 else "the recomputed layer"),
        n_saved * T * act["saved"], FB if n_saved > 1 else ("backward",),
        f"{n_saved} x micro x seq x {act['saved']:,} B/token")
    gpu("backward transients of one layer", T * (act["peak"] - act["saved"]), ("backward",),
        f"micro x seq x {act['peak'] - act['saved']:,} B/token (peak {act['peak']:,} B/token)")
    if surplus := frozen_base_surplus(s):
        gpu("frozen base: measured surplus, not itemised", T * round(surplus * x * h),
            ("backward",), f"micro x seq x {surplus} x h x {x} B (the 24 GiB rows, "
            "docs/estimator.md)")
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
