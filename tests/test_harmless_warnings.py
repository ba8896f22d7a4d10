"""Harmless third-party lines are filtered out of longft's output, the others stay (issue 48):
bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" on every LoRA run and
`longft generate`, quantized or not."""

import logging
import subprocess
import sys

from longft.engine.harmless_warnings import quiet


def test_the_kernels_community_line_is_dropped_and_the_others_stay(caplog):
    quiet()
    quiet()   # twice: one filter
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert len(log.filters) == 1
    with caplog.at_level(logging.WARNING):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make "
                    "sure you already `pip install kernels`", ModuleNotFoundError("kernels"))
        log.warning("something real")
        logging.getLogger("bitsandbytes").warning("Failed to load CPU gemm_4bit_forward elsewhere")
    assert [r.getMessage() for r in caplog.records] == [
        "something real", "Failed to load CPU gemm_4bit_forward elsewhere"]


def test_importing_bitsandbytes_after_quiet_prints_no_such_line():
    """(peft imports bitsandbytes; on a CPU with AVX512-BF16 its import logs the line)"""
    code = ("import logging; logging.basicConfig()\n"
            "from longft.engine.harmless_warnings import quiet; quiet()\n"
            "try:\n    import bitsandbytes\nexcept ImportError:\n    pass\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "kernels-community" not in p.stdout + p.stderr
