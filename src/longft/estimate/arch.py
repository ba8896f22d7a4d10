"""Parameter counts and ZeRO partitioning for the estimator: the decoder's shapes, the numels in
model.parameters() order, the trainable (LoRA) subset, DeepSpeed's optimizer sub-groups and
bucket sizes, and the derived sizes (`Numbers`) that the GPU and host item builders share.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from longft.config import qlora
from longft.estimate.quantized import quantized_weight_bytes
from longft.estimate.types import DS_SUB_GROUP_SIZE, Setup
from longft.model.architecture import attention_dims, is_lora_target


def dims(arch: dict) -> dict:
    """The architecture numbers the formulas use, under short names (h, I, L, H, kv, d, V), and
    which linears have a bias."""
    h, heads = int(arch["hidden_size"]), int(arch["num_attention_heads"])
    d, kv = attention_dims(h, heads, arch.get("head_dim"), arch.get("num_key_value_heads"))
    return {"h": h, "I": int(arch["intermediate_size"]), "L": int(arch["num_hidden_layers"]),
            "H": heads, "kv": kv, "d": d,
            "V": int(arch["vocab_size"]), "tied": bool(arch.get("tie_word_embeddings")),
            "biased": biased_linears(arch)}


def biased_linears(arch: dict) -> tuple[str, ...]:
    """The decoder linears that have a bias, as transformers builds them: Qwen2 has q/k/v biases
    without saying so in its config, Mistral none; Llama-style configs put `attention_bias` on
    q/k/v/o and `mlp_bias` on the MLP's three."""
    kind = arch.get("model_type")
    if kind == "qwen2":
        return ("q_proj", "k_proj", "v_proj")
    if kind == "mistral":
        return ()
    return ((("q_proj", "k_proj", "v_proj", "o_proj") if arch.get("attention_bias") else ())
            + (("gate_proj", "up_proj", "down_proj") if arch.get("mlp_bias") else ()))


def _linear_shapes(a: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each decoder-layer linear."""
    h, I, H, kv, d = a["h"], a["I"], a["H"], a["kv"], a["d"]
    return {"q_proj": (h, H * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (H * d, h),
            "gate_proj": (h, I), "up_proj": (h, I), "down_proj": (I, h)}


def linear_shapes(arch: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each decoder-layer linear of an architecture dict."""
    return _linear_shapes(dims(arch))


def layer_params(arch: dict) -> list[tuple[str, int]]:
    """(name, numel) of one decoder layer, in model.parameters() order (Llama/Mistral/Qwen2)."""
    a = dims(arch)
    out = []
    for name, (i, o) in _linear_shapes(a).items():
        out.append((name, i * o))
        if name in a["biased"]:
            out.append((name + ".bias", o))
    return out + [("input_layernorm", a["h"]), ("post_attention_layernorm", a["h"])]


def param_numels(arch: dict) -> list[tuple[str, int]]:
    """(name, numel) of every parameter in model.parameters() order; a tied lm_head appears once."""
    a = dims(arch)
    out = [("embed_tokens", a["V"] * a["h"])]
    for i in range(a["L"]):
        out += [(f"layers.{i}.{n}", k) for n, k in layer_params(arch)]
    out.append(("norm", a["h"]))
    if not a["tied"]:
        out.append(("lm_head", a["V"] * a["h"]))
    return out


def trainable_numels(arch: dict, s: Setup) -> list[int]:
    """Numels of the parameters the optimizer owns: all, LoRA A and B of each target linear, or
    the blocks of each target linear (block-sparse: sparse_blocks x sparse_block_size^2)."""
    if s.sparse_blocks > 0:
        block = s.sparse_blocks * s.sparse_block_size ** 2
        names = [n for n in _linear_shapes(dims(arch)) if n in s.sparse_targets]
        return [block] * (len(names) * dims(arch)["L"])
    if s.lora_rank <= 0:
        return [n for _, n in param_numels(arch)]
    a = dims(arch)
    out = []
    for _ in range(a["L"]):
        for name, (i, o) in _linear_shapes(a).items():
            if is_lora_target(name, s.lora_targets):
                out += [s.lora_rank * i, o * s.lora_rank]
    return out


def quantized_linears(arch: dict, s: Setup) -> list[tuple[int, int]]:
    """(in_features, out_features) of every decoder linear a quantized base holds in bitsandbytes'
    blocks: the LoRA targets (QLoRA) or the sparse targets (block-sparse), config/qlora.py's
    quantized_targets, as model/quantize.py does (none without a quantized base)."""
    if not qlora.quantized_base(s.lora_rank, s.quantize, s.sparse_blocks):
        return []
    names = qlora.quantized_targets(s.lora_targets, s.sparse_blocks, s.sparse_targets)
    shapes = [io for name, io in _linear_shapes(dims(arch)).items() if is_lora_target(name, names)]
    return shapes * dims(arch)["L"]


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


def optimizer_split(s: Setup, groups: list[int]) -> tuple[list[int], list[int]]:
    """(sub-groups stepped on the GPU, sub-groups stepped by CPU Adam). With offload_optimizer,
    DeepSpeed keeps the first int((1 - ratio) x groups) on the GPU (stage3._create_fp32_partitions:
    the same float expression, so the same count); without it all stay on the GPU."""
    if not s.offload_optimizer:
        return list(groups), []
    k = int((1 - s.offload_ratio) * len(groups))
    return list(groups[:k]), list(groups[k:])


def zero_knobs(s: Setup, hidden_size: int) -> dict:
    """The DeepSpeed bucket and threshold numbers longft's ds_config writes for this setup: the
    engine's own builder (ds_config.zero_section), with zero.overlap_step as resolved."""
    from longft.config.params import Config, ZeroConfig
    from longft.engine.ds_config import zero_section

    cfg = Config(zero=ZeroConfig(stage=s.zero_stage, overlap_comm=s.overlap_comm,
                                 offload_optimizer="cpu" if s.offload_optimizer else "none",
                                 offload_param="cpu" if s.offload_param else "none",
                                 reduce_bucket_size=s.reduce_bucket_size,
                                 prefetch_bucket_size=s.prefetch_bucket_size,
                                 param_persistence_threshold=s.param_persistence_threshold,
                                 max_live_parameters=s.max_live_parameters))
    return zero_section(cfg, hidden_size, overlap_step=s.overlap_step)


@dataclass(frozen=True)
class Numbers:
    """Derived sizes shared by the GPU (estimate_gpu) and host (estimate_host) item builders."""
    a: dict              # dims(): h, I, L, H, kv, d, V, tied
    w: int               # bytes of a weight, gradient or activation element
    T: int               # tokens per micro-step on a rank: micro-batch x seq / sequence_parallel
    knobs: dict          # zero_knobs()
    params: list         # param_numels()
    trainable: list      # trainable_numels()
    P: int               # all parameters
    P_r: int             # a rank's share of them (each parameter padded to the world size)
    Pt_r: int            # a rank's share of the trainable ones
    groups: list         # optimizer sub-groups of the rank's trainable share
    gpu_groups: list     # the sub-groups whose optimizer states stay on the GPU (offload_ratio)
    host_groups: list    # the sub-groups CPU Adam steps (on the host, or swapped from NVMe)
    ms: int              # bytes of a master weight, its gradient and each Adam moment (4, bf16: 2)
    layer: int           # parameters of one decoder layer
    biggest: int         # largest parameter of a decoder layer
    largest: int         # largest trainable parameter (the embedding; LoRA: an adapter matrix)
    adapters: int        # LoRA adapter parameters (0 without LoRA)
    Pq: int              # base parameters held quantized (QLoRA; else 0)
    quant_bytes: int     # their bytes in bitsandbytes' blocks (quantized.py)
    biggest_q: int       # the largest quantized weight (numel): one is dequantized at a time


def share(n: int, world: int) -> int:
    """One rank's partition of a parameter of n elements (ZeRO pads it to a multiple of world)."""
    return -(-n // world)


def numbers(arch: dict, s: Setup) -> Numbers:
    """The derived sizes of `s` on `arch`."""
    sizes = _sizes(_arch_key(arch), s.world_size, s.lora_rank, s.lora_targets, s.quantize,
                   s.sub_group_size, sparse=(s.sparse_blocks, s.sparse_block_size, s.sparse_targets))
    on_gpu, on_host = optimizer_split(s, list(sizes["groups"]))
    return Numbers(
        w=4 if s.precision == "fp32" else 2, T=s.local_tokens,
        knobs=dict(_zero_knobs(stage=s.zero_stage, overlap=s.overlap_comm,
                               off_opt=s.offload_optimizer, off_param=s.offload_param,
                               reduce=s.reduce_bucket_size, prefetch=s.prefetch_bucket_size,
                               persist=s.param_persistence_threshold, live=s.max_live_parameters,
                               overlap_step=s.overlap_step, h=sizes["a"]["h"])),
        gpu_groups=on_gpu, host_groups=on_host, ms=2 if s.optimizer_states == "bf16" else 4,
        **{k: list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v
           for k, v in sizes.items()})


def _arch_key(arch: dict) -> tuple:
    """The scalar entries of an architecture dict, hashable (what dims() and the counts read)."""
    return tuple(sorted((k, v) for k, v in arch.items()
                        if v is None or isinstance(v, (bool, int, float, str))))


@functools.lru_cache(maxsize=512)
def _sizes(key: tuple, N: int, lora_rank: int, targets: tuple, quantize: str,
           sub_group_size: int, *, sparse: tuple) -> dict:
    """numbers()'s parameter counts, which the search asks for many times over (cached)."""
    arch = dict(key)
    s = Setup(1, 1, world_size=N, lora_rank=lora_rank, lora_targets=targets, quantize=quantize,
              sub_group_size=sub_group_size, sparse_blocks=sparse[0], sparse_block_size=sparse[1],
              sparse_targets=sparse[2])
    params, trainable = param_numels(arch), trainable_numels(arch, s)
    per_layer = layer_params(arch)
    groups = sub_groups([share(n, N) for n in trainable], sub_group_size) if trainable else [0]
    quant = quantized_linears(arch, s)
    return dict(
        a=dims(arch), params=tuple(params), trainable=tuple(trainable),
        P=sum(n for _, n in params), P_r=sum(share(n, N) for _, n in params),
        Pt_r=sum(share(n, N) for n in trainable), groups=tuple(groups),
        layer=sum(n for _, n in per_layer), biggest=max(n for _, n in per_layer),
        largest=max(trainable, default=0), adapters=sum(trainable) if s.frozen_base else 0,
        Pq=sum(i * o for i, o in quant),
        quant_bytes=sum(quantized_weight_bytes(quantize, i, o) for i, o in quant),
        biggest_q=max((i * o for i, o in quant), default=0))


@functools.lru_cache(maxsize=512)
def _zero_knobs(*, stage, overlap, off_opt, off_param, reduce, prefetch, persist, live, overlap_step,
                h) -> dict:
    return zero_knobs(Setup(1, 1, zero_stage=stage, overlap_comm=overlap, offload_optimizer=off_opt,
                            offload_param=off_param, reduce_bucket_size=reduce,
                            prefetch_bucket_size=prefetch, param_persistence_threshold=persist,
                            max_live_parameters=live, overlap_step=overlap_step), h)


def largest_target(arch: dict, names: tuple[str, ...]) -> int:
    """Elements of the largest decoder linear among `names` (0 if none)."""
    return max((i * o for n, (i, o) in _linear_shapes(dims(arch)).items() if n in names), default=0)
