"""Third-party warnings that say nothing to a longft user, filtered out of longft's own output in
one place (`quiet`); every other warning stays. Each entry names why it is harmless.

- bitsandbytes' CPU backend, on import (peft imports it for every LoRA run, quantized or not),
  tries the optional `kernels` package for a faster CPU gemm_4bit and logs "Failed to load CPU
  gemm_4bit_forward from kernels-community: No module named 'kernels'" when it is absent; it then
  uses its own CPU kernel. longft does not install `kernels`, so the line is always printed.
- DeepSpeed 0.19 calls c10d collectives that torch 2.13 marks deprecated, once per call.
"""

from __future__ import annotations

import logging
import warnings

HARMLESS_LOGS = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}
"""logger name -> the start of a message it logs that is dropped (only that one)."""


class _Drop(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet() -> None:
    """Install the filters (idempotent); call before importing peft or bitsandbytes."""
    for name, prefix in HARMLESS_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_Drop(prefix))
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+.* is deprecated",
                            category=FutureWarning)
