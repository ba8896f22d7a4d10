"""What hardware is here, and what every `auto` in params.yaml resolves to on it, with the reason.

All hardware decisions happen here: one `resolve_<knob>()` per knob returns its `Choice` (the value
*and* why) and its problems, and `resolve()` calls them in order (kernels.packed_attention's, with
the kernels measured per GPU generation, in hardware/packed_policy.py). Impossible requests (bf16 or
FlashAttention-2 on a V100, a GPU asked for on a machine without one) are collected and raised
together as a `PlanError` before any model is built. What the CPU cannot take is written once, in
`longft.config.cpu_rules` (the config check applies it too). Tests pass a fake `Hardware`.
"""

from __future__ import annotations

from longft.config import cpu_rules, qlora
from longft.config.params import Config, ConfigError
from longft.config.plan import Choice
from longft.hardware import ulysses_rules
from longft.hardware.machine import Hardware
from longft.hardware.packed_policy import (
    LONGFT_KERNELS,
    flash_attn_4_auto,
    flash_attn_4_everywhere,
    flash_attn_4_problems,
    packed_rows,
    resolve_packed_attention,
)
from longft.hardware.step_policy import resolve_overlap_step

# Model families whose decoder layers Liger can patch (liger_kernel.transformers.monkey_patch).
LIGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral")
TILED_MLP_FROM = 65536
"""kernels.tiled_mlp auto turns on from this sequence length: below it the MLP intermediates are a
few GiB and tiling only costs time."""


class PlanError(ConfigError):
    """The request cannot run on this hardware; each problem says what to change."""

    def __init__(self, problems: list[str]):
        super().__init__(problems, "the params (checked against this hardware and model)")


def resolve(cfg: Config, hw: Hardware, model_type: str,
            softcap: float | None = None, heads: tuple[int, int] | None = None, *,
            window: int | None = None) -> dict[str, Choice]:
    """Resolve every knob for `hw`, in order; raise PlanError listing every problem at once.
    softcap: the model's attention logit softcapping (model.patches.attention_softcap), which
    the attention kernel must apply; heads: its (attention, key/value) head counts, which
    hardware.sequence_parallel must divide (hardware/ulysses_rules.py)."""
    out: dict[str, Choice] = {}
    problems: list[str] = []

    def put(key: str, resolved: tuple[Choice, list[str]]):
        out[key], found = resolved
        problems.extend(found)
        return out[key].value

    device = put("device", resolve_device(cfg, hw))
    problems.extend(check_num_gpus(cfg, hw, device))
    precision = put("precision", resolve_precision(cfg, hw, device))
    problems.extend(check_optimizer_states(cfg, precision))
    attention = put("attention", resolve_attention(cfg, hw, device, softcap, precision, window=window))
    put("sdpa_backend", resolve_sdpa_backend(cfg, hw, device, attention))
    packed = put("packed_attention", resolve_packed_attention(cfg, hw, device, attention, precision))
    problems.extend(ulysses_rules.problems(cfg, attention, packed, *(heads or (None, None))))
    put("liger", resolve_liger(cfg, hw, device, model_type))
    put("tiled_mlp", resolve_tiled_mlp(cfg))
    put("checkpointing", resolve_checkpointing(cfg, device))
    put("host_grad_buffer", resolve_host_grad_buffer(cfg, precision))
    put("quantize", resolve_quantize(cfg, precision))
    put("copy_back", resolve_copy_back(cfg, device, precision))
    put("overlap_step", resolve_overlap_step(cfg, device))
    problems.extend(check_optimizer(cfg))
    problems.extend(check_vram_limit(cfg, hw, device))
    if device == "cpu" and cfg.hardware.device == "auto":
        problems.extend(m + " (device auto found no CUDA GPU here)"
                        for m in cpu_rules.offload_ratio(cfg.zero.offload_ratio)
                        + cpu_rules.optimizer(cfg.optim.name))
    if problems:
        raise PlanError(problems)
    return out


def resolve_device(cfg: Config, hw: Hardware) -> tuple[Choice, list[str]]:
    """cuda or cpu; a GPU asked for on a machine without one is a problem (then cpu)."""
    h = cfg.hardware
    if h.device == "cuda" and hw.device != "cuda":
        return Choice("cpu", f"set in params ({h.device})"), [
            "hardware.device: cuda was asked for but no CUDA GPU is visible "
            "(check `nvidia-smi`, CUDA_VISIBLE_DEVICES, `docker run --gpus all`); "
            "set hardware.device: auto or cpu to run on the CPU"]
    if h.device == "auto":
        why = (f"a CUDA GPU is visible ({hw.gpu_name})" if hw.device == "cuda"
               else "no CUDA GPU visible; DeepSpeed CPU accelerator with gloo")
        return Choice(hw.device, f"auto: {why}"), []
    return Choice(h.device, f"set in params ({h.device})"), []


def check_num_gpus(cfg: Config, hw: Hardware, device: str) -> list[str]:
    """hardware.num_gpus against the GPUs (one node) or the cores (CPU workers) that are here."""
    h = cfg.hardware
    if device == "cuda" and h.num_nodes == 1 and h.num_gpus > hw.gpu_count:
        return [f"hardware.num_gpus: {h.num_gpus} asked for but only {hw.gpu_count} GPU(s) "
                f"visible; set hardware.num_gpus <= {hw.gpu_count}"]
    if device == "cpu" and h.num_gpus > hw.cpu_count:
        return [f"hardware.num_gpus: {h.num_gpus} CPU workers asked for on {hw.cpu_count} "
                f"cores; set hardware.num_gpus <= {hw.cpu_count}"]
    return []


def resolve_precision(cfg: Config, hw: Hardware, device: str) -> tuple[Choice, list[str]]:
    """auto: bf16 on CPU and on compute capability >= 8.0, fp16 (dynamic loss scaling) below."""
    p = cfg.precision
    if device == "cpu":
        if p == "auto":
            return Choice("bf16", "auto: bf16 on CPU (fp16 has no CPU kernels)"), []
        return Choice(p, "set in params"), cpu_rules.precision(p)
    bf16_ok = hw.ampere
    if p == "auto":
        why = "supports bf16" if bf16_ok else "< 8.0 has no bf16; fp16 with dynamic loss scaling"
        return Choice("bf16" if bf16_ok else "fp16",
                      f"auto: compute capability {hw.capability_text} {why}"), []
    if p == "bf16" and not bf16_ok:
        return Choice(p, "set in params"), [
            f"precision: bf16 needs compute capability >= 8.0 but {hw.gpu_name} "
            f"is {hw.capability_text}; use fp16 (dynamic loss scaling) or auto"]
    return Choice(p, "set in params"), []


def resolve_attention(cfg: Config, hw: Hardware, device: str, softcap: float | None = None,
                      precision: str = "bf16", *, window: int | None = None) -> tuple[Choice, list[str]]:
    """auto: flash-attn-4 where it is installed on Hopper (flash_attn_4_everywhere); FlashAttention-2
    where flash-attn is installed on compute capability >= 8.0; else SDPA.
    A model that softcaps its attention logits (Gemma 2: attn_logit_softcapping) needs a kernel
    that applies the cap, which SDPA (and longft's packed attention over it) cannot: auto takes
    FlashAttention-2 where it runs, else eager, and says so; a pinned sdpa is refused."""
    a, cap_s = cfg.kernels.attention, hw.capability_text
    fa2 = device == "cuda" and hw.ampere and hw.flash_attn
    if softcap:
        cap = f"the model softcaps attention logits (attn_logit_softcapping {softcap:g})"
        if a == "auto" and fa2:
            return Choice("flash_attention_2", f"auto: {cap}, which SDPA ignores; "
                          "FlashAttention-2 applies it"), []
        if a == "auto":
            return Choice("eager", f"auto: {cap}, which SDPA ignores; eager attention applies it "
                          "(it builds [seq x seq] scores, so memory grows with the square of the "
                          "sequence: flash-attn on compute capability >= 8.0 avoids that)"), []
        if a in ("sdpa", "flash_attn_4"):
            return Choice(a, "set in params"), [
                f"kernels.attention: {a} cannot apply this model's attention logit softcapping "
                f"(attn_logit_softcapping {softcap:g}): it would train a different model; set "
                "kernels.attention: auto, eager or flash_attention_2"]
    if a == "auto":
        pinned = cfg.kernels.packed_attention
        if flash_attn_4_everywhere(cfg, hw, device, precision, window=window):
            return Choice("flash_attn_4", f"auto: capability {cap_s}, flash-attn-4 installed: its "
                          "kernels for every row (H200, forward + backward: 1.13-1.23x cuDNN SDPA "
                          "at 16K-128K; W2 40,213 tok/s against 38,009)"), []
        if fa2 and packed_rows(cfg) and pinned in LONGFT_KERNELS:
            return Choice("sdpa", f"auto: kernels.packed_attention {pinned} is longft's attention "
                          "function, which takes the place of SDPA"), []
        if fa2 and flash_attn_4_auto(cfg, hw, precision)[0]:
            return Choice("sdpa", f"auto: capability {cap_s}, flash-attn-4 installed and rows that "
                          "pack several documents: SDPA, so that packed rows run flash-attn-4's "
                          "varlen kernel (H200: 21 % faster than FlashAttention-2's varlen kernels "
                          "inside torch) and single documents cuDNN"), []
        if device == "cuda" and hw.ampere and hw.flash_attn:
            return Choice("flash_attention_2",
                          f"auto: flash-attn installed, capability {cap_s} >= 8.0"), []
        if device == "cuda" and hw.ampere:
            return Choice("sdpa", "auto: flash-attn not installed; PyTorch SDPA"), []
        if device == "cuda":
            return Choice("sdpa", f"auto: capability {cap_s} < 8.0 cannot run FlashAttention-2; "
                                  "PyTorch SDPA (memory-efficient kernel)"), []
        return Choice("sdpa", "auto: CPU; PyTorch SDPA"), []
    problems: list[str] = []
    if a == "flash_attn_4":
        problems = flash_attn_4_problems(hw, device, precision, "kernels.attention")
        if window and window < cfg.data.max_seq_length:
            problems.append(f"kernels.attention: flash_attn_4 cannot apply the model's sliding window "
                            f"({window} tokens) to rows of {cfg.data.max_seq_length} tokens: it would "
                            "train a different model; set kernels.attention: sdpa (or auto)")
    elif a == "flash_attention_2":
        if device != "cuda":
            problems = cpu_rules.attention(a)
        elif hw.capability is not None and hw.capability < (8, 0):
            problems = [f"kernels.attention: flash_attention_2 needs compute capability >= 8.0 "
                        f"but {hw.gpu_name} is {cap_s}; use sdpa (or auto)"]
        elif not hw.flash_attn:
            problems = ["kernels.attention: flash_attention_2 asked for but flash-attn is not "
                        "installed; `pip install longft[flash]` (the Ampere image has it) or use sdpa"]
    return Choice(a, "set in params"), problems


def resolve_sdpa_backend(cfg: Config, hw: Hardware, device: str,
                         attention: str) -> tuple[Choice, list[str]]:
    """The kernel SDPA tries first (only meaningful when attention is sdpa). auto: cuDNN on
    Hopper, flash on Ampere, memory-efficient below, PyTorch's own choice on CPU."""
    sb, cap, cap_s = cfg.kernels.sdpa_backend, hw.capability, hw.capability_text
    if attention != "sdpa":
        return Choice("default", f"attention is {attention}, not sdpa"), []
    if sb == "auto":
        if device != "cuda":
            return Choice("default", "auto: CPU; PyTorch's own choice"), []
        if cap is not None and cap >= (9, 0):
            return Choice("cudnn", f"auto: capability {cap_s}: cuDNN attention is "
                                   "1.6-1.9x faster than the flash kernel on Hopper"), []
        if hw.ampere:
            return Choice("flash", f"auto: capability {cap_s}: the flash kernel"), []
        return Choice("efficient", f"auto: capability {cap_s} < 8.0 has no flash "
                                   "or cuDNN kernel; memory-efficient kernel, K/V heads expanded"), []
    problems: list[str] = []
    if device != "cuda":
        problems = cpu_rules.sdpa_backend(sb)
    elif sb in ("flash", "cudnn") and cap is not None and cap < (8, 0):
        problems = [f"kernels.sdpa_backend: {sb} needs compute capability >= 8.0 but "
                    f"{hw.gpu_name} is {cap_s}; use efficient (or auto)"]
    return Choice(sb, "set in params"), problems


def resolve_liger(cfg: Config, hw: Hardware, device: str, model_type: str) -> tuple[Choice, list[str]]:
    """auto: on with CUDA, liger-kernel installed and a model family Liger can patch."""
    lg = cfg.kernels.liger
    family_ok = model_type in LIGER_FAMILIES
    if lg == "auto":
        if device != "cuda":
            return Choice(False, "auto: off on CPU (Liger kernels are Triton GPU kernels)"), []
        if not hw.liger:
            return Choice(False, "auto: liger-kernel is not installed"), []
        if not family_ok:
            return Choice(False, f"auto: model_type {model_type!r} has no Liger patch"), []
        return Choice(True, f"auto: CUDA and Liger supports {model_type!r}"), []
    if lg == "off":
        return Choice(False, "set in params"), []
    problems: list[str] = []
    if device != "cuda":
        problems = cpu_rules.liger(lg)
    elif not hw.liger:
        problems = ["kernels.liger: on but liger-kernel is not installed; `pip install liger-kernel`"]
    elif not family_ok:
        problems = [f"kernels.liger: on but model_type {model_type!r} has no Liger patch "
                    f"(supported: {', '.join(LIGER_FAMILIES)}); set off"]
    return Choice(True, "set in params"), problems


def resolve_tiled_mlp(cfg: Config) -> tuple[Choice, list[str]]:
    """auto: on from max_seq_length TILED_MLP_FROM, never with LoRA dropout."""
    tm = cfg.kernels.tiled_mlp
    # TiledMLP recomputes the MLP tile by tile in backward without restoring the RNG state: LoRA
    # dropout would draw other masks than the forward's, and the gradients would be wrong.
    dropout = cfg.lora.rank > 0 and cfg.lora.dropout > 0
    if tm == "on" and dropout:
        return Choice(True, "set in params"), [
            f"kernels.tiled_mlp: on cannot run with lora.dropout {cfg.lora.dropout} "
            "(its backward recomputes the MLP with new dropout masks); set "
            "lora.dropout: 0 or kernels.tiled_mlp: off"]
    if tm == "auto" and dropout:
        return Choice(False, "auto: off (lora.dropout > 0: the tiled backward would "
                             "draw new dropout masks)"), []
    if tm == "auto":
        long = cfg.data.max_seq_length >= TILED_MLP_FROM
        return Choice(long, f"auto: {'on' if long else 'off'} (max_seq_length "
                            f"{cfg.data.max_seq_length} {'>=' if long else '<'} {TILED_MLP_FROM})"), []
    return Choice(tm == "on", "set in params"), []


def resolve_checkpointing(cfg: Config, device: str) -> tuple[Choice, list[str]]:
    """auto: gpu (recompute each decoder layer; cpu_offload needs a GPU to offload from)."""
    m = cfg.checkpointing.mode
    if m == "auto":
        return Choice("gpu", "auto: recompute each decoder layer in backward, layer inputs kept "
                             "on the device"), []
    return Choice(m, "set in params"), cpu_rules.checkpointing(m) if device != "cuda" else []


def resolve_host_grad_buffer(cfg: Config, precision: str) -> tuple[Choice, list[str]]:
    """auto: shared where one host slot is exact (why_not_shared_grad_buffer), else full."""
    hb, z = cfg.zero.host_grad_buffer, cfg.zero
    # micro-steps of a step: with sequence_parallel N each loaded row is N of them
    micro_steps = cfg.grad_accum_steps * cfg.hardware.sequence_parallel
    why_not = why_not_shared_grad_buffer(z.stage, z.offload_optimizer, micro_steps,
                                         precision)
    if hb == "auto":
        return Choice("full" if why_not else "shared",
                      f"auto: full ({why_not[0]})" if why_not else
                      "auto: shared (ZeRO-3 offload, one micro-step per step)"), []
    if hb == "shared" and why_not:
        return Choice(hb, "set in params"), [
            f"zero.host_grad_buffer: shared cannot run here: {'; '.join(why_not)}. "
            "Set it to auto or full"]
    return Choice(hb, "set in params"), []


def resolve_copy_back(cfg: Config, device: str, precision: str) -> tuple[Choice, list[str]]:
    """zero.copy_back: chunked (engine/param_copy_back.py) only where the ZeRO-3 step converts fp32
    master weights on the host into 16-bit GPU partitions; auto = chunked there (measured), else
    DeepSpeed's own copy."""
    z = cfg.zero
    stage = z.stage  # QLoRA runs on ZeRO-2 (config/qlora.py refuses it on 3)
    why_not = why_not_chunked_copy_back(device, stage, z.offload_optimizer, z.offload_param,
                                        precision, z.optimizer_states)
    if z.copy_back == "chunked":
        if why_not:
            return Choice("chunked", "set in params"), [
                f"zero.copy_back: chunked converts fp32 master weights on the host into 16-bit "
                f"partitions on a GPU, and needs {', '.join(why_not)}"
                + (" (a quantized base runs on ZeRO-2)" if qlora.quantized(cfg) else "")
                + ". Set zero.copy_back: auto"]
        return Choice("chunked", "set in params: " + CHUNKED_WHY), []
    if z.copy_back == "deepspeed":
        return Choice("deepspeed", "set in params"), []
    if not why_not:
        return Choice("chunked", "auto: " + CHUNKED_WHY), []
    return Choice("deepspeed", "auto: DeepSpeed's own copy (no fp32 master on the host to convert "
                  f"into GPU partitions here: chunked needs {', '.join(why_not)})"), []


CHUNKED_WHY = "the step's fp32 master weights go to the GPU through pinned chunks (engine/param_copy_back.py)"


def why_not_chunked_copy_back(device: str, stage: int, offload_optimizer: bool | str,
                              offload_param: bool | str, precision: str,
                              optimizer_states: str) -> list[str]:
    """What zero.copy_back: chunked needs that this setup lacks ([] = it applies): the one rule
    that resolve and the planner apply. offload_optimizer / offload_param: "none" | "cpu" | "nvme"
    (or a bool: cpu or not); stage: the ZeRO stage that runs (QLoRA's is 2)."""
    def name(v):
        return ("cpu" if v else "none") if isinstance(v, bool) else v
    return [why for why, bad in (
        ("a GPU", device != "cuda"), ("zero.stage 3", stage != 3),
        ("zero.offload_optimizer: cpu", name(offload_optimizer) != "cpu"),
        ("zero.offload_param: none", name(offload_param) != "none"),
        ("bf16 or fp16", precision == "fp32"),
        ("zero.optimizer_states: fp32", optimizer_states != "fp32")) if bad]


def check_optimizer_states(cfg: Config, precision: str) -> list[str]:
    """zero.optimizer_states bf16 keeps master weights in the training dtype: bf16 only (precision
    auto may resolve to fp16 on a V100 or fp32 on a CPU)."""
    if cfg.zero.optimizer_states == "bf16" and precision != "bf16":
        return [f"zero.optimizer_states: bf16 needs precision bf16, and precision resolved to "
                f"{precision} here; set precision: bf16 (Ampere or newer, or CPU) or "
                "optimizer_states: fp32"]
    return []


def check_vram_limit(cfg: Config, hw: Hardware, device: str) -> list[str]:
    """hardware.vram_limit_gib cannot be more than the GPU has, and means nothing without one
    (also when device auto found none: the cap would be silently ignored)."""
    v = cfg.hardware.vram_limit_gib
    if device == "cpu" and cfg.hardware.device == "auto":
        return [m + " (device auto found no CUDA GPU here)" for m in cpu_rules.vram_limit(v)]
    if device == "cuda" and v is not None and hw.gpu_mem_gib is not None and v > hw.gpu_mem_gib:
        return [f"hardware.vram_limit_gib: {v} is more than the "
                f"{hw.gpu_mem_gib} GiB of {hw.gpu_name}; lower it or set null"]
    return []


def why_not_shared_grad_buffer(stage: int, offload_optimizer: bool | str, grad_accum: int,
                               precision: str) -> list[str]:
    """Why a shared slot would not be exact for this setup ([] = it is): the one rule that
    resolve, the estimator and the planner apply. offload_optimizer: "none" | "cpu" | "nvme" (or a
    bool: cpu or not); the slot is proven for cpu only (NVMe swaps gradients through its own
    buffers)."""
    off = offload_optimizer
    if isinstance(off, bool):
        off = "cpu" if off else "none"
    return [why for why, bad in (
        (f"zero.stage is {stage}", stage != 3),
        (f"zero.offload_optimizer is {off}", off != "cpu"),
        (f"gradients accumulate over {grad_accum} micro-steps "
         "(train.global_batch_size > micro_batch_size x GPUs)", grad_accum > 1),
        ("precision is fp16 (DeepSpeed's overflow check reads every partition's host copy)",
         precision == "fp16")) if bad]


def _bitsandbytes_missing(what: str) -> list[str]:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return [f"{what} needs bitsandbytes, which is not installed here: pip install "
                f"'longft[qlora]' (or pip install bitsandbytes)"]
    return []


def resolve_quantize(cfg: Config, precision: str) -> tuple[Choice, list[str]]:
    """lora.quantize: what the frozen base is stored in, under what, and on which ZeRO stage."""
    q = cfg.lora.quantize
    if not qlora.quantized(cfg):
        return Choice("none", "base weights in the training dtype"), []
    what = {"nf4": "4-bit NF4 with double quantization", "int8": "8-bit (LLM.int8)"}[q]
    return (Choice(q, f"set in params: base weights in {what} under {qlora.trained_beside(cfg)}, "
                      f"computing in {precision}; {qlora.STAGE_REASON}"),
            _bitsandbytes_missing(f"lora.quantize: {q}"))


def check_optimizer(cfg: Config) -> list[str]:
    """optim.name: bitsandbytes' 8-bit AdamW needs bitsandbytes."""
    if cfg.optim.name in qlora.EIGHT_BIT:
        return _bitsandbytes_missing(f"optim.name: {cfg.optim.name}")
    return []
