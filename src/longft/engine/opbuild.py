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

Set-up builds the ops a CPU run compiles once, with a notice and progress, into the folder the ranks
use (`extensions_dir()`), so that no first run or first test compiles them silently:

    python -m longft.engine.opbuild          # scripts/setup.sh runs it

torch's JIT build holds `<op folder>/lock` while it compiles, and every other process waits, without
a word and without end, until that file is gone: a build killed half-way leaves it behind.
`watch_build_locks()` (each rank, before DeepSpeed builds anything) removes a lock whose process is
gone, with a note, and makes a wait on a live one say whose build it waits for, with progress.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import threading
import time
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


def extensions_dir() -> str:
    """The ranks' JIT-build folder ($TORCH_EXTENSIONS_DIR unless set): one per Python environment,
    since two venvs sharing ~/.cache/torch_extensions keep rebuilding each other's DeepSpeed ops
    (their build files differ)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path.home() / ".cache" / "longft" / "torch_extensions"
        / hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])


def _say(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # only rank 0 prints; every rank waits the same
        print(f"longft: {msg}", file=sys.stderr, flush=True)


def lock_holders(lock: Path) -> list[int] | None:
    """The processes that hold `lock` open (torch's FileBaton keeps its file open while it builds),
    or None where that cannot be known (no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(lock)
    out = []
    for pid in filter(str.isdigit, os.listdir(proc)):
        try:
            fds = os.listdir(proc / pid / "fd")
        except OSError:  # gone meanwhile, or another user's (whose builds use their own folder)
            continue
        for fd in fds:
            try:
                if os.readlink(proc / pid / "fd" / fd) == target:
                    out.append(int(pid))
                    break
            except OSError:
                continue
    return out


def _remove_stale(lock: Path, grace_s: float = 1.0) -> bool:
    """Remove `lock` when no process holds it, now and `grace_s` later (torch's FileBaton closes
    its file a moment before it removes it: that is a release, not a stale lock); say so. True if
    this removed it."""
    if lock_holders(lock) != []:
        return False
    time.sleep(grace_s)
    if not lock.exists() or lock_holders(lock) != []:
        return False
    try:
        lock.unlink()
    except FileNotFoundError:
        return False
    _say(f"removed a stale build lock {lock} (the process that held it is gone: a build killed "
         f"half-way); `{lock.parent.name}` is built again now")
    return True


def clear_stale_locks(ext_dir: str | Path) -> list[Path]:
    """Remove every `<ext_dir>/<op>/lock` that no process holds; return those removed."""
    return [lock for lock in sorted(Path(ext_dir).glob("*/lock")) if _remove_stale(lock)]


def wait_for_lock(lock: Path, every_s: float = 10.0, poll_s: float = 0.2) -> None:
    """Wait until `lock` is gone, saying whose build it is and, every `every_s`, how long it has
    been; a lock whose process is gone (or ends without removing it) is removed (`_remove_stale`)."""
    holders = lock_holders(lock)
    if holders:
        _say(f"waiting for process {', '.join(map(str, holders))} to finish building DeepSpeed's "
             f"`{lock.parent.name}` op (lock {lock}) ...")
    elif holders is None:
        _say(f"waiting for another process to finish building DeepSpeed's `{lock.parent.name}` "
             f"op (lock {lock}; delete it if no build is running) ...")
    t0 = time.monotonic()
    next_say = t0 + every_s
    while lock.exists():
        if _remove_stale(lock):
            return
        time.sleep(poll_s)
        if time.monotonic() >= next_say:
            _say(f"  still waiting for `{lock.parent.name}`: {time.monotonic() - t0:.0f} s")
            next_say += every_s
    if holders:
        _say(f"`{lock.parent.name}` built by the other process after {time.monotonic() - t0:.0f} s")


def watch_build_locks(ext_dir: str | Path | None = None) -> None:
    """Before DeepSpeed builds its ops in this process: clear stale locks in `ext_dir` (default
    extensions_dir()), and make torch's wait on a build lock `wait_for_lock` (message, progress,
    a lock left by a killed build removed) instead of a silent spin."""
    from torch.utils import file_baton

    clear_stale_locks(ext_dir or extensions_dir())
    if getattr(file_baton.FileBaton.wait, "_longft", False):
        return

    def wait(self) -> None:
        wait_for_lock(Path(self.lock_file_path))

    wait._longft = True
    file_baton.FileBaton.wait = wait


SETUP_OPS = {"cpu": ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder"),
             "cuda": ("CPUAdamBuilder", "FusedAdamBuilder")}
"""What a first run would JIT-build, per device: CPU Adam (zero.offload_optimizer: cpu, the default),
fused Adam (the optimizer where it stays on the device: offload none, which `longft placement`
picks wherever it fits; ~2 minutes on 2 cores, silent and counted in that run's host RAM when a
run built it) and, with DeepSpeed's CPU accelerator, its shared-memory all-reduce."""


def _ticking(what: str, every_s: float = 10.0):
    """A thread that says every `every_s` how long `what` has taken; set() the returned event to
    stop it."""
    stop, t0 = threading.Event(), time.monotonic()

    def tick():
        while not stop.wait(every_s):
            print(f"  ... {what}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    threading.Thread(target=tick, daemon=True).start()
    return stop


def build_ops(device: str | None = None) -> int:
    """Build SETUP_OPS[device] into extensions_dir() (a no-op for ops already built); 0, or 1 with
    diagnose()'s message for an op that cannot be built."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.environ["DS_ACCELERATOR"] = device
    os.environ["TORCH_EXTENSIONS_DIR"] = ext = extensions_dir()
    watch_build_locks(ext)
    from deepspeed.accelerator import get_accelerator

    for name in SETUP_OPS[device]:
        builder = get_accelerator().create_op_builder(name)
        so = Path(ext) / builder.NAME / f"{builder.NAME}.so"
        before = so.stat().st_mtime_ns if so.is_file() else None
        if before is None:
            print(f"longft: building DeepSpeed's `{builder.NAME}` op once, into {ext} (a minute or "
                  "so; every later run loads it) ...", file=sys.stderr, flush=True)
        # with a .so there, ninja still rebuilds it when its inputs changed (a venv made anew at
        # the same path, other compiler flags): the ticker then says so after 10 s
        t0 = time.monotonic()
        stop = _ticking(f"building {builder.NAME}" if before is None else
                        f"{builder.NAME}: its build inputs changed, DeepSpeed rebuilds it")
        try:
            builder.load(verbose=False)
        except Exception as e:  # noqa: BLE001 - explained below, or re-raised
            failure = diagnose(e)
            if failure is None:
                raise
            print(f"longft: {failure.message()}", file=sys.stderr, flush=True)
            return 1
        finally:
            stop.set()
        after = so.stat().st_mtime_ns if so.is_file() else None
        took = f"{time.monotonic() - t0:.0f} s"
        done = (f"built in {took}" if before is None else "already built" if after == before
                else f"rebuilt in {took} (its build inputs had changed since the last build)")
        print(f"longft: DeepSpeed's `{builder.NAME}` op {done} ({ext})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(build_ops(sys.argv[1] if len(sys.argv) > 1 else None))
