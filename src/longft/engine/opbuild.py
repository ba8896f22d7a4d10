"""Explain a DeepSpeed op that could not be built, instead of a 60-line traceback.

DeepSpeed compiles some of its ops on first use (JIT, through torch.utils.cpp_extension and ninja,
into $TORCH_EXTENSIONS_DIR): `cpu_adam` (zero.offload_optimizer: cpu), `fused_adam` (the GPU
optimizer), and on CPU `deepspeed_shm_comm`. Without a C++ compiler, ninja or (for CUDA ops) a CUDA
toolkit, that fails with one of:

- RuntimeError "Unable to JIT load the <op> op due to ninja not being installed." (DeepSpeed's
  OpBuilder.jit_load, from torch's verify_ninja_availability);
- RuntimeError "Error building extension '<op>': <ninja output>" (torch's _run_ninja_build, from a
  subprocess.CalledProcessError: compiler missing, or a compile/link error);
- MissingCUDAException "CUDA_HOME does not exist, unable to compile CUDA op(s)" (DeepSpeed's CUDA
  builders), or OSError "CUDA_HOME environment variable is not set" (torch, building a CUDA op);
- RuntimeError "Unable to JIT load the <op> op due to it not being compatible ..." (is_compatible);
- ImportError / OSError while importing the built module (a stale or broken build).

`diagnose(exc)` recognises any exception raised inside DeepSpeed's op builder (it walks the
traceback for an OpBuilder frame, which also gives the op's name and its DS_BUILD_* variable) and
returns one message: which op, the likely cause, and the fixes.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

_BUILDER_DIR = os.path.join("deepspeed", "ops", "op_builder")


@dataclass(frozen=True)
class OpFailure:
    op: str
    build_var: str | None
    cause: str
    evidence: tuple[str, ...]
    cuda: bool
    stale: bool = False

    def message(self) -> str:
        ext = os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions"
        lines = [f"DeepSpeed could not build its `{self.op}` op (compiled on first use into "
                 f"{Path(ext) / self.op}): {self.cause}."]
        lines += [f"  build output: {e}" for e in self.evidence]
        fixes = ["install a C++ compiler and ninja: `apt-get install build-essential` (g++) and "
                 "`pip install ninja`, then run again"]
        if self.stale:
            fixes = [f"delete {Path(ext) / self.op} so that it is rebuilt"]
        if self.cuda:
            fixes.append("CUDA op: set CUDA_HOME to a CUDA toolkit that has nvcc (e.g. "
                         "/usr/local/cuda), or run in a CUDA -devel image (Dockerfile.*)")
        var = self.build_var or "DS_BUILD_OPS"
        fixes.append(f"or prebuild it into DeepSpeed on a machine with the compiler: `{var}=1 pip "
                     f"install --no-build-isolation --force-reinstall --no-deps deepspeed` (the "
                     f"Docker images do this)")
        if self.op == "cpu_adam":
            fixes.append("or do without it: zero.offload_optimizer: none (the optimizer states "
                         "and the Adam step stay on the GPU)")
        lines.append("Fixes: " + "; ".join(fixes) + ".")
        return "\n".join(lines)


def _builder(chain: list[BaseException]):
    """The outermost OpBuilder instance in the tracebacks of an exception chain (_chain)."""
    for e in chain:
        tb = e.__traceback__
        while tb is not None:
            f = tb.tb_frame
            if _BUILDER_DIR in f.f_code.co_filename:
                obj = f.f_locals.get("self")
                if obj is not None and hasattr(obj, "NAME") and hasattr(obj, "jit_load"):
                    return obj
            tb = tb.tb_next
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen, e = [], set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _evidence(text: str, limit: int = 3) -> tuple[str, ...]:
    """The lines of a build log that say what went wrong."""
    pat = re.compile(r"not found|No such file|error:|fatal error|command not found|cannot find",
                     re.IGNORECASE)
    hits = []
    for line in text.splitlines():
        line = line.strip()
        if pat.search(line) and line not in hits:
            hits.append(line if len(line) <= 200 else line[:197] + "...")
    return tuple(hits[:limit])


def diagnose(exc: BaseException) -> OpFailure | None:
    """An OpFailure when exc comes from DeepSpeed's op builder (JIT build or load), else None."""
    chain = _chain(exc)
    builder = _builder(chain)
    names = {type(e).__name__ for e in chain}
    text = "\n".join(str(e) for e in chain)
    m = re.search(r"Error building extension '(\w+)'|Unable to JIT load the (\w+) op", text)
    if builder is None and m is None and "MissingCUDAException" not in names:
        return None
    op = getattr(builder, "NAME", None) or (m and (m.group(1) or m.group(2))) or "unknown"
    build_var = getattr(builder, "BUILD_VAR", None)
    cuda = "CUDAOpBuilder" in {c.__name__ for c in type(builder).__mro__} if builder else False
    cuda = cuda and not getattr(builder, "build_for_cpu", False)
    evidence: tuple[str, ...] = ()
    stale = False
    if "MissingCUDAException" in names or "CUDA_HOME" in text:
        cause = ("no CUDA toolkit: CUDA_HOME is not set or has no nvcc "
                 f"(CUDA_HOME={os.environ.get('CUDA_HOME') or 'unset'})")
        cuda = True
    elif "ninja not being installed" in text or "Ninja is required" in text:
        cause = "ninja is not installed (not on PATH)"
    elif "Error building extension" in text:
        cxx = os.environ.get("CXX", "c++")
        evidence = _evidence(text)
        if shutil.which(cxx) is None:
            cause = (f"no C++ compiler: `{cxx}` is not on PATH"
                     + (" (from $CXX)" if "CXX" in os.environ else ""))
        elif cuda and shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
            cause = "nvcc (CUDA toolkit) not found"
        else:
            cause = f"the compiler `{cxx}` failed (see the build output)"
    elif "not being compatible" in text:
        cause = "DeepSpeed reports the op as incompatible with this system: " + \
            text.split("hardware/software issue.", 1)[-1].strip()[:300]
    elif names & {"ImportError", "ModuleNotFoundError", "OSError"}:
        cause = f"the built module could not be loaded ({type(chain[-1]).__name__}: {chain[-1]})"
        stale = True
    else:
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return OpFailure(op=op, build_var=build_var, cause=cause, evidence=evidence, cuda=cuda,
                     stale=stale)
