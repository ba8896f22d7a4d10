"""Frozen base weights in 4 or 8 bits for QLoRA (`lora.quantize`), with bitsandbytes.

`quantize_linears` swaps the LoRA-targeted `nn.Linear` layers of the decoder for bitsandbytes'
`Linear4bit` (NF4, double quantization: QLoRA) or `Linear8bitLt` (LLM.int8), computing in the
training dtype. Each layer is quantized as it is moved to `device`, so the full-precision model never
has to sit on the GPU. Embeddings, norms and the LM head stay in the training dtype: the LM head is
what Liger's fused loss reads, and the input embeddings are small next to the decoder.

peft then wraps the quantized layers with its bitsandbytes LoRA layers. `dequantized_state_dict`
turns them back into plain weights of the training dtype for a merged export that
`from_pretrained` loads without bitsandbytes.
"""

from __future__ import annotations

import re

from longft.compat import bitsandbytes as bnb_compat
from longft.model.architecture import is_lora_target

KINDS = ("nf4", "int8")


def _bnb():
    try:
        import bitsandbytes
    except ImportError as e:  # the config check refuses earlier; this is the last word
        from longft.errors import UserError
        raise UserError(f"lora.quantize needs bitsandbytes ({e}); pip install 'longft[qlora]' or "
                        "set lora.quantize: none") from None
    _dequantize_flat_on_cpu(bitsandbytes.functional)
    bnb_compat.register_cpu_gemm_4bit(_gemm_4bit_flat_on_cpu)
    return bitsandbytes


def _dequantize_flat_on_cpu(F) -> None:
    """Make bitsandbytes' 4-bit dequantization exact on the CPU for every weight shape (once).

    bitsandbytes 0.50's compiled CPU kernel (used where the CPU has AVX-512) takes the absmax blocks
    row by row, while quantize_4bit blocks the flat tensor: a weight whose rows are not a multiple of
    the blocksize (64) comes back wrong (a relative error of about 0.25 instead of 0.09, e.g. a
    down_proj with 176 inputs), in training and in the merged export alike. Asked for the flat
    shape, the same kernel is exact; the result is reshaped. GPUs and other shapes are untouched.
    bitsandbytes' matmul and layers, peft's merge and this module look `dequantize_4bit` up on the
    module at each call, so the wrapper serves them (a call with `out=` keeps the original)."""
    import copy
    import math

    import torch

    def flat_on_cpu(original):
        def dequantize_4bit(A, quant_state=None, *args, **kwargs):
            qs = quant_state
            if (qs is None or A.device.type != "cpu" or len(qs.shape) < 2 or args or "out" in kwargs
                    or qs.shape[-1] % qs.blocksize == 0):
                return original(A, quant_state, *args, **kwargs)
            flat = copy.copy(qs)
            flat.shape = torch.Size([math.prod(qs.shape)])
            return original(A, flat, *args, **kwargs).reshape(qs.shape)
        return dequantize_4bit

    bnb_compat.replace_dequantize_4bit(F, flat_on_cpu)


def _gemm_4bit_flat_on_cpu(A, B, shapeB, absmax, blocksize: int, quant_type: str, *optional):
    """bitsandbytes::gemm_4bit on the CPU: x @ W^T + bias with W dequantized through the flat shape.

    bitsandbytes 0.50's own kernel (device-independent) dequantizes W with its 2-D shape, so on the
    CPU the row-by-row blocks above make the 4-bit layers' forward (training and evaluation) differ
    from the exact weight their backward and every merged export use (1.9 % of the output of a
    176-wide layer). This is that kernel with the flat shape; GPUs keep bitsandbytes' own."""
    import math

    import torch

    # the op's schema passes these by position: bias, absmax_8bit, absmax_code, absmax_offset
    bias, absmax_8bit, absmax_code, absmax_offset = (*optional, None, None, None, None)[:4]
    ops = torch.ops.bitsandbytes
    if absmax_8bit is not None:   # nested statistics: absmax in 8 bits, blocks of 256
        absmax = ops.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256,
                                                  torch.float32) + absmax_offset
    w = ops.dequantize_4bit.default(B, absmax, blocksize, quant_type, [math.prod(shapeB)], A.dtype)
    return torch.nn.functional.linear(A, w.reshape(shapeB), bias)


def targets(model, names: tuple[str, ...]) -> list[tuple[str, object]]:
    """(qualified name, module) of every nn.Linear whose last name part is in `names` (LoRA's
    target_modules), except the LM head."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [(n, m) for n, m in model.named_modules()
            if type(m) is torch.nn.Linear and is_lora_target(n, names) and m is not head]


def quantize_linears(model, names: tuple[str, ...], kind: str, compute_dtype, device) -> int:
    """Replace the targeted Linear layers by bitsandbytes' quantized ones on `device`, layer by
    layer (each is quantized as it moves there); returns how many were replaced. The weights
    become frozen (requires_grad False): QLoRA trains only the adapters."""
    bnb = _bnb()
    count = 0
    for name, lin in targets(model, names):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        w = lin.weight.data
        bias = lin.bias is not None
        if kind == "nf4":
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=bias,
                                  compute_dtype=compute_dtype, compress_statistics=True,
                                  quant_type="nf4", device="meta")
            q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4")
            # On an AVX512-BF16 CPU, bitsandbytes repacks the weight in place for a no-grad eval
            # forward (the evaluator's) and its gemv then fails on widths that are not whole
            # blocks; the plain dequantize path serves training and evaluation alike.
            bnb_compat.no_cpu_repack(q)
        elif kind == "int8":
            q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=bias,
                                    has_fp16_weights=False, threshold=6.0, device="meta")
            q.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
        else:
            raise ValueError(f"lora.quantize: {kind!r} is not one of {KINDS}")
        if bias:
            q.bias = type(lin.bias)(lin.bias.data.to(compute_dtype), requires_grad=False)
        setattr(parent, child, q.to(device))  # Params4bit / Int8Params quantize on this move
        del lin, w
        count += 1
    return count


def has_quantized_layers(model) -> bool:
    """Whether any layer of `model` is a bitsandbytes quantized one (without importing it)."""
    return any(type(m).__module__.startswith("bitsandbytes.") for m in model.modules())


def is_quantized(module) -> bool:
    bnb = _bnb()
    return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def dequantized_weight(module, dtype):
    """The full weight of a quantized Linear, in `dtype` (on the module's device)."""
    import bitsandbytes.functional as F

    bnb = _bnb()
    w = module.weight
    if isinstance(module, bnb.nn.Linear4bit):
        return F.dequantize_4bit(w.data, w.quant_state).to(dtype)
    if isinstance(module, bnb.nn.Linear8bitLt):
        scb = w.SCB if getattr(w, "SCB", None) is not None else module.state.SCB
        return (w.data.float() * scb.float().unsqueeze(1) / 127.0).to(dtype)
    raise TypeError(f"{type(module).__name__} is not a bitsandbytes quantized Linear")


_QUANT_STATE_KEY = re.compile(r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|"
                              r"quant_state\..*)$|\.(SCB|weight_format)$")


def dequantized_state_dict(model, sd: dict, dtype) -> dict:
    """`sd` (model.state_dict() of a model with quantized layers) with every quantized weight
    replaced by its de-quantized `dtype` tensor (on the CPU) and bitsandbytes' quantization-state
    entries dropped, so that it loads into the plain architecture."""
    out = {k: v for k, v in sd.items() if not _QUANT_STATE_KEY.search(k)}
    for name, m in model.named_modules():
        if is_quantized(m):
            out[f"{name}.weight"] = dequantized_weight(m, dtype).cpu().contiguous()
    return out
