# Source it: point DeepSpeed's async_io build and load at a carried libaio (bench/nvme/libaio.sh).
#   source bench/nvme/aio_env.sh [.aio]
# Where the system already has libaio (DeepSpeed's own check passes), nothing is changed.
# DeepSpeed 0.19.8 checks for libaio by compiling and linking a test program that calls io_submit
# (op_builder/builder.py has_function: CFLAGS and LDFLAGS from the environment, and -laio), but its
# JIT build (torch.utils.cpp_extension.load) reads neither: there gcc itself must find the header
# and the library, through CPATH and LIBRARY_PATH. The built op loads libaio.so.1 when the ranks
# start: LD_LIBRARY_PATH, exported before the launcher so that every rank inherits it.
_aio=$(cd "${1:-.aio}" 2>/dev/null && pwd) || { echo "aio_env.sh: no ${1:-.aio} (bench/nvme/libaio.sh)" >&2; return 1; }
if python3 -c "import sys
from deepspeed.ops.op_builder import AsyncIOBuilder
sys.exit(0 if AsyncIOBuilder().is_compatible() else 1)" >/dev/null 2>&1; then
  echo "aio_env.sh: DeepSpeed finds libaio on this system; ${1:-.aio} not used"
else
  export CFLAGS="-I$_aio/include ${CFLAGS:-}" LDFLAGS="-L$_aio/lib ${LDFLAGS:-}"
  export CPATH="$_aio/include${CPATH:+:$CPATH}" LIBRARY_PATH="$_aio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$_aio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "aio_env.sh: libaio from $_aio (CFLAGS/LDFLAGS for DeepSpeed's check, CPATH/LIBRARY_PATH for its build, LD_LIBRARY_PATH for the ranks)"
fi
unset _aio
