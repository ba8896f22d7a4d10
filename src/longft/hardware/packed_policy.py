"""How attention runs over rows that pack several documents (kernels.packed_attention), and where
flash-attn-4 runs (it also takes rows of one document: kernels.attention flash_attn_4), by GPU
generation and by what was measured (BENCHMARKS.md; bench/LOG.md, "Packed rows"); the kernels are in
model/packed_attention.py and model/flash_attn_4_op.py. hardware/policy.py calls it in its knob order."""

from __future__ import annotations

from longft.config.params import Config
from longft.config.plan import Choice
from longft.config.sections import LONGFT_PACKED_KERNELS
from longft.hardware.machine import Hardware


def packed_rows(cfg: Config) -> bool:
    """Whether rows can hold several documents (random rows and unpacked data hold one)."""
    return cfg.data.pack and cfg.data.source != "random"


PER_DOCUMENT_FROM = 32768
"""On Hopper without flash-attn-4, packed rows of at least this many tokens run cuDNN SDPA per
document (on cuDNN's ragged path, model/packed_attention.py); shorter ones run torch's varlen_attn.
The boundary is where per document overtook varlen end to end on the H200; with flash-attn-4
installed, auto takes its kernel at every length instead. The measurements: BENCHMARKS.md and
bench/LOG.md ("Packed rows of real-shaped documents")."""


def flash_attn_4_auto(cfg: Config, hw: Hardware, precision: str) -> tuple[bool, str | None]:
    """(whether auto runs packed rows on flash-attn-4, why not where it is installed on a GPU of
    compute capability >= 9.0 but passed by: None otherwise). auto takes it on Hopper (9.x, where
    it was measured; Blackwell takes it when asked), in bf16 or fp16, on rows that pack several
    documents."""
    if not (packed_rows(cfg) and hw.device == "cuda" and hw.flash_attn_4 and hw.capability is not None
            and hw.capability >= (9, 0) and cfg.kernels.packed_attention in ("auto", "flash_attn_4")):
        return False, None
    if precision not in ("bf16", "fp16"):
        return False, f"it runs bf16 / fp16, not {precision}"
    if hw.capability[0] != 9:
        return False, f"auto takes it on Hopper, where it was measured; set it for {hw.capability_text}"
    return True, None


FA4_MEASURED = ("H200, 1B: 49,447 tok/s at 16K against 40,872 with varlen_attn; 18,311 at 128K "
                "against 14,575 with cuDNN per document")
"""What auto's choice of flash-attn-4 for packed rows stands on (BENCHMARKS.md)."""


LONGFT_KERNELS = LONGFT_PACKED_KERNELS
"""kernels.packed_attention values that are longft's attention function (model/packed_attention.py)."""


def flash_attn_4_everywhere(cfg: Config, hw: Hardware, device: str, precision: str, *,
                            window: int | None = None) -> bool:
    """Whether kernels.attention auto runs every row on flash-attn-4: installed on Hopper (9.x,
    where it was measured; Blackwell takes it when asked), in bf16 / fp16, unless SDPA's backend or
    packed rows' kernel is pinned, or the model's sliding window is shorter than a row (longft's
    attention function does not apply it). Measured: bench/results/attention-kernel-probe.json."""
    pinned = cfg.kernels.packed_attention
    return (device == "cuda" and hw.flash_attn_4 and hw.capability is not None
            and hw.capability[0] == 9 and precision in ("bf16", "fp16")
            and cfg.kernels.sdpa_backend == "auto"
            and not (window and window < cfg.data.max_seq_length)
            and (not packed_rows(cfg) or pinned in ("auto", "flash_attn_4")))


def flash_attn_4_problems(hw: Hardware, device: str, precision: str,
                          key: str = "kernels.packed_attention") -> list[str]:
    """Why flash-attn-4's kernels cannot run here ([] = they can); `key` is the knob that asked."""
    out = []
    if precision not in ("bf16", "fp16"):
        out.append(f"{key}: flash_attn_4 runs bf16 or fp16, not {precision}; "
                   f"set precision: auto (bf16) or {key}: auto")
    if device != "cuda" or hw.capability is None or hw.capability < (9, 0):
        where = "no CUDA GPU" if device != "cuda" else f"{hw.gpu_name} is {hw.capability_text}"
        out.append(f"{key}: flash_attn_4 needs a Hopper or Blackwell GPU "
                   f"(compute capability >= 9.0; {where}); use auto")
    elif not hw.flash_attn_4:
        out.append(f"{key}: flash_attn_4 needs the flash-attn-4 package "
                   "(pip install flash-attn-4; flash_attn.cute is not importable here); use auto")
    return out


def resolve_packed_attention(cfg: Config, hw: Hardware, device: str, attention: str,
                             precision: str = "bf16") -> tuple[Choice, list[str]]:
    """How attention runs over rows that pack several documents (model/packed_attention.py).
    auto, by measurement (PER_DOCUMENT_FROM): on Hopper flash-attn-4's varlen kernel where it is
    installed, else cuDNN SDPA per document from 32K-token rows and torch's varlen_attn below; varlen_attn on Ampere
    (its flash kernel is the fast one there; unmeasured on an Ampere card); SDPA per document on a
    V100 (the memory-efficient kernel; varlen_attn needs >= 8.0) and on CPU."""
    pa, cap_s = cfg.kernels.packed_attention, hw.capability_text
    seq = cfg.data.max_seq_length
    if not packed_rows(cfg):
        why = "data.pack is false" if not cfg.data.pack else "random rows"
        return Choice("none", f"{why}: one document a row, the single-sequence kernel"), []
    if attention == "flash_attn_4":
        if pa == "flash_attn_4":
            return Choice(pa, "set in params"), []
        if pa == "auto":
            return Choice("flash_attn_4", "kernels.attention flash_attn_4: its varlen kernel, from "
                          f"the document boundaries ({FA4_MEASURED})"), []
        return Choice(pa, "set in params"), [
            f"kernels.packed_attention: {pa} with kernels.attention flash_attn_4, which runs packed "
            "rows with its own varlen kernel; set kernels.packed_attention: auto or "
            "kernels.attention: sdpa"]
    if attention == "flash_attention_2":
        if pa in LONGFT_KERNELS:
            return Choice("flash_attention_2", "set in params"), [
                f"kernels.packed_attention: {pa} is longft's attention function (in SDPA's place), but "
                "kernels.attention is flash_attention_2, which runs packed rows with flash-attn's "
                "variable-length kernel itself; set kernels.packed_attention: auto or kernels.attention: sdpa"]
        return Choice("flash_attention_2", "flash-attn's variable-length kernel, from the "
                      "document boundaries (no mask)") if pa != "mask" else Choice("mask", "set in params"), []
    if attention == "eager":
        if pa in LONGFT_KERNELS:
            return Choice(pa, "set in params"), [
                f"kernels.packed_attention: {pa} needs kernels.attention sdpa (eager computes "
                "the full score matrix itself); set kernels.attention: sdpa or packed_attention: auto"]
        return Choice("mask", "eager attention: transformers' block mask (eager builds "
                      "[seq x seq] scores anyway; use sdpa for long rows)"), []
    varlen_ok = device == "cuda" and hw.ampere and hw.varlen_attn
    if pa == "auto":
        if device != "cuda":
            return Choice("per_document", "auto: CPU; SDPA once per document"), []
        hopper = hw.capability is not None and hw.capability >= (9, 0)
        fa4, passed_by = flash_attn_4_auto(cfg, hw, precision)
        if fa4:
            return Choice("flash_attn_4", f"auto: capability {cap_s}, flash-attn-4 installed: its "
                          f"varlen kernel ({FA4_MEASURED})"), []
        passed = f" (flash-attn-4 is installed, but {passed_by})" if passed_by else ""
        if hopper and (seq >= PER_DOCUMENT_FROM or not varlen_ok):
            return Choice("per_document", f"auto: capability {cap_s}, rows of {seq:,} tokens: "
                          "cuDNN SDPA per document, ragged plans (H200, 128K: 14,575 tok/s "
                          "against 11,695 with varlen_attn; 32K: 34,598 against 33,008)" + passed), []
        if hopper:
            return Choice("varlen", f"auto: capability {cap_s}, rows of {seq:,} < "
                          f"{PER_DOCUMENT_FROM:,} tokens: torch's varlen_attn (H200, 16K: 39,669 "
                          "tok/s against 38,114 with cuDNN per document)" + passed), []
        if varlen_ok:
            return Choice("varlen", f"auto: capability {cap_s}: torch's varlen_attn (the flash "
                          "kernel, one call for every document)"), []
        return Choice("per_document", f"auto: capability {cap_s}: SDPA per document"
                      + ("" if hw.ampere else " (memory-efficient kernel; varlen_attn needs >= 8.0)")
                      + ("" if not hw.ampere or hw.varlen_attn else
                         " (this torch has no varlen_attn)")), []
    if pa == "flash_attn_4":
        return Choice(pa, "set in params"), flash_attn_4_problems(hw, device, precision)
    if pa == "varlen" and not varlen_ok:
        why = ("a CUDA GPU" if device != "cuda" else f"compute capability >= 8.0 ({hw.gpu_name} "
               f"is {cap_s})" if not hw.ampere else "torch >= 2.10 (torch.nn.attention.varlen)")
        return Choice(pa, "set in params"), [
            f"kernels.packed_attention: varlen needs {why}; use per_document (or auto)"]
    return Choice(pa, "set in params"), []
