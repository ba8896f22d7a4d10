"""Start the training ranks through DeepSpeed's own launcher (or torchrun), never a home-made one.

`command()` is a pure function of the config (tested on CPU); `launch_ranks()` starts it with a
host-memory sampler watching the whole process tree (launcher and every rank). The launcher runs in
a session of its own; `launch_ranks()` passes SIGINT/SIGTERM on to the ranks (a graceful stop,
stop.py) and a guard process kills the launcher's group if this process dies first.

The ranks' stderr passes through `launch_ranks()` (a pseudo-terminal when ours is one, so progress
bars stay as they are), which watches it for the rendezvous port being taken (EADDRINUSE) between
`master_port()`'s check and the ranks' bind: with hardware.master_port auto the launch is retried
on a fresh port; a pinned port gets a message instead of the ranks' tracebacks alone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from longft.atomic import write_json
from longft.config.params import Config
from longft.engine.opbuild import extensions_dir
from longft.engine.stop import Relay, exit_code
from longft.errors import UserError


class LaunchError(UserError, RuntimeError):
    """The ranks cannot be launched as params ask (launcher, hostfile, nodes, host RAM)."""


def command(cfg: Config, device: str, worker_args: list[str], port: int) -> list[str]:
    """The launcher command line, with rendezvous port `port` (from `master_port()`)."""
    h = cfg.hardware
    if h.launcher == "torchrun":
        if h.num_nodes > 1:
            raise LaunchError("hardware.launcher: torchrun here runs one node; use the deepspeed "
                              "launcher with hardware.hostfile for several nodes")
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(h.num_gpus),
                "--master_port", str(port), "-m", "longft.engine.worker", *worker_args]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if h.hostfile:
        cmd += ["--hostfile", h.hostfile, "--num_nodes", str(h.num_nodes)]
    else:
        # Without a hostfile the launcher runs on localhost only.
        cmd += ["--num_nodes", "1"]
    if device == "cuda" or h.hostfile or h.num_gpus > 1:
        # On CPU the launcher's own slot count is the number of NUMA nodes (often 1): several CPU
        # workers must be asked for, or it starts one and the worker refuses the world size.
        cmd += ["--num_gpus", str(h.num_gpus)]
    if h.bind_cores:   # each rank on its share of the cores (numactl), OMP_NUM_THREADS to match
        if shutil.which("numactl") is None:
            raise LaunchError("hardware.bind_cores: true binds ranks to cores through numactl, which "
                              "is not installed: `apt-get install numactl`, or set bind_cores: false")
        cmd += ["--bind_cores_to_rank"]
    cmd += ["--master_port", str(port), "--no_local_rank", "--module", "longft.engine.worker",
            *worker_args]
    return cmd


def environment(device: str, base: dict | None = None, expandable_segments: bool = False) -> dict:
    """The ranks' environment: the accelerator pinned, a DeepSpeed-parsable arch list and (if asked,
    unless the user set their own) torch's expandable-segments CUDA allocator."""
    env = dict(os.environ if base is None else base)
    env["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
    arch = env.get("TORCH_CUDA_ARCH_LIST")
    if arch:
        # DeepSpeed's op builder int()-parses each entry; '9.0a' (set by some CUDA images) breaks it.
        env["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", arch)
    if device == "cuda" and expandable_segments:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # One JIT-build folder per Python environment (opbuild.extensions_dir, where set-up builds them)
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def drop_shm_buffers(port: int, shm: Path = Path("/dev/shm")) -> None:
    """Remove DeepSpeed's CPU all-reduce buffers of runs on `port` (a killed run leaves them)."""
    for f in shm.glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        f.unlink(missing_ok=True)


PORT_TAKEN = re.compile(rb"EADDRINUSE|[Aa]ddress already in use")
"""How torch's TCPStore (c10d rendezvous) reports a master port another process holds."""
PORT_RETRIES = 3


class _Tee:
    """The launcher's stderr: copied to ours as it comes (through a pseudo-terminal when ours is
    a terminal, so the ranks' progress bars still draw), its last 64 KiB kept to be searched."""

    def __init__(self):
        self.out = getattr(sys.stderr, "buffer", None)
        tty = False
        try:
            tty = sys.stderr.isatty()
        except (AttributeError, ValueError):
            pass
        if tty:
            import pty

            self.fd, self.child_fd = pty.openpty()
            _copy_winsize(sys.stderr.fileno(), self.child_fd)
        else:
            self.fd, self.child_fd = os.pipe()
        self.tail = b""
        self.closed = False
        self.thread = threading.Thread(target=self._pump, name="longft-stderr", daemon=True)

    def started(self) -> None:
        """After the launcher is started: our copy of its end closed, the copying begun."""
        os.close(self.child_fd)
        self.thread.start()

    def _pump(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: a pty's other side closed
                break
            if not chunk:
                break
            if self.closed:   # finish() gave up on us: stop reading, the fd is ours to close
                break
            self.tail = (self.tail + chunk)[-65536:]
            try:
                if self.out is not None:
                    self.out.write(chunk)
                    self.out.flush()
                else:
                    sys.stderr.write(chunk.decode(errors="replace"))
                    sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def finish(self) -> bytes:
        self.thread.join(timeout=10)  # a straggler rank may hold the pipe: do not hang on it
        self.closed = True
        if not self.thread.is_alive():
            os.close(self.fd)
        # else the pump still blocks in os.read on a pipe a straggler holds: the fd stays open (a
        # closed number could be reused by the next launch's tee while the old thread reads it)
        return self.tail


def _copy_winsize(src: int, dst: int) -> None:
    try:
        import fcntl
        import termios

        fcntl.ioctl(dst, termios.TIOCSWINSZ, fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8))
    except (OSError, ImportError):
        pass


def _with_port(cmd: list[str], port: int) -> list[str]:
    """cmd with the value after --master_port replaced."""
    i = cmd.index("--master_port")
    return [*cmd[:i + 1], str(port), *cmd[i + 2:]]


def _port_of(cmd: list[str]) -> int | None:
    try:
        return int(cmd[cmd.index("--master_port") + 1])
    except (ValueError, IndexError):
        return None


def launch_ranks(cmd: list[str], env: dict, run_dir: Path, port: int | None = None,
                 auto_port: bool = False, swap_root: Path | None = None) -> int:
    """Run the launcher with the host-memory sampler; return its exit code. `port`: drop the
    CPU all-reduce buffers of that port before and after. When the ranks fail because their
    --master_port was taken after it was found free: auto_port (hardware.master_port auto)
    launches again on a fresh port (up to PORT_RETRIES times), else the exit status is 2 with
    a message that says what to do. swap_root: the NVMe swap root (offload_optimizer nvme): the
    sampler also watches this launch's own run-<master port> below it (its bytes and the disk's
    free space), none of another run's."""
    from longft.measure.monitor import HostSampler

    sampler = HostSampler(root_pid=os.getpid(), csv_path=run_dir / "memory.csv")
    sampler.start()
    follow_parent()
    try:
        for attempt in range(PORT_RETRIES + 1):
            if swap_root is not None:
                sampler.watch_disk(_own_swap_dir(swap_root, _port_of(cmd)))
            code, taken, signalled = _launch(cmd, env, port)
            master = _port_of(cmd)
            if not (code and taken) or signalled:
                break
            if not auto_port:
                print(f"longft train: the ranks could not bind master port {master}: another "
                      "process took it after the train stage found it free (a second run on "
                      "this machine?). Set hardware.master_port: auto (a free port, retried if "
                      "taken) or pin a port that is free", file=sys.stderr, flush=True)
                return 2
            if attempt == PORT_RETRIES:
                print(f"longft train: master port taken {PORT_RETRIES + 1} times in a row "
                      "(something on this machine takes free ports as fast as they are found); "
                      "pin hardware.master_port to a port reserved for longft",
                      file=sys.stderr, flush=True)
                return 2
            new = free_port(0)
            print(f"train: master port {master} was taken before the ranks bound it (another "
                  f"run started in between?); launching again on port {new} "
                  "(hardware.master_port auto)", flush=True)
            cmd = _with_port(cmd, new)
            port = new if port is not None else None
    finally:
        write_json(run_dir / "monitor.json", sampler.stop())
    if signalled and code != 0:
        return exit_code(signalled)  # 130 / 143 whatever the launcher makes of the ranks' exit
    return code


def _own_swap_dir(root: Path, master: int | None) -> Path:
    """This launch's swap directory (the ranks name it by their master port, engine/trainer.py),
    emptied first: one that exists is a killed run's on the same port (the port is free, so no
    live run owns it), and DeepSpeed would write over its files in place."""
    from longft.engine.ds_config import nvme_run_path

    own = Path(nvme_run_path(str(root), master))
    if own.exists():
        print(f"train: removing {own}, swap files a killed run left on this port", flush=True)
        shutil.rmtree(own, ignore_errors=True)
    return own


def _launch(cmd: list[str], env: dict, port: int | None) -> tuple[int, bool, int | None]:
    """One launch: (exit code, whether the ranks said their port was taken, the signal passed on
    to them or None)."""
    if port is not None:
        drop_shm_buffers(port)

    if cmd[1:3] == ["-m", "deepspeed.launcher.runner"] and shutil.which("ninja") is None:
        print("longft: note: ninja not on PATH; DeepSpeed may fail to JIT-compile its CPU Adam op",
              file=sys.stderr)
    tee = _Tee()
    try:
        # A session of its own: a terminal's Ctrl-C reaches the ranks once, through the Relay, and
        # never DeepSpeed's launch.py (which would SIGKILL them 30 s later). See stop.py.
        try:
            proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=tee.child_fd)
        finally:
            tee.started()
        guard, pipe = _guard(proc.pid)
        with Relay(proc) as relay:
            code = proc.wait()
        os.write(pipe, b"done")  # the launcher ended by itself: the guard leaves its group alone
        os.close(pipe)
        guard.wait()
    finally:
        tail = tee.finish()
        if port is not None:
            drop_shm_buffers(port)
    return code, bool(code and PORT_TAKEN.search(tail)), relay.signum


def _guard(pgid: int) -> tuple[subprocess.Popen, int]:
    """Start a watcher, outside this process group, that SIGKILLs process group `pgid` when this
    process dies without saying "done" first (even by SIGKILL): `kill -9 -<pgid of the stage>`
    still takes the launcher and every rank with it. Returns it and the pipe's write end."""
    r, w = os.pipe()
    code = ("import os,sys\nif not sys.stdin.buffer.read():\n try: os.killpg(%d, 9)\n"
            " except OSError: pass\n" % pgid)
    guard = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=r, start_new_session=True)
    os.close(r)
    return guard, w


def follow_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: get `sig` when the parent process dies (e.g. `kill` of `dvc repro`, which does not
    pass SIGTERM on to its stage), so the ranks stop gracefully instead of running on orphaned."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def master_port(cfg: Config) -> tuple[int, str]:
    """The ranks' rendezvous port for this launch, and why.

    auto: a port the OS reports free on this machine now, so two runs on one machine (a second
    experiment, the tests beside a run) never collide with EADDRINUSE. An int is used as it is; on
    one node a taken one is refused now (LaunchError) rather than failing the ranks' rendezvous
    later. (On several nodes the port is opened on the hostfile's first host, which may not be
    this one: a pinned port is not checked, and auto's is only known to be free here.)"""
    h = cfg.hardware
    if h.master_port == "auto":
        return free_port(0), "hardware.master_port auto: free on this machine at launch"
    if h.num_nodes == 1 and not port_free(h.master_port):
        raise LaunchError(f"hardware.master_port: port {h.master_port} is in use on this machine "
                          "(another run?); set hardware.master_port: auto to take a free one, or "
                          "pin a port that is free")
    return h.master_port, "hardware.master_port, pinned"


def port_free(port: int) -> bool:
    """Whether TCP `port` can be listened on here (on every address). A finished run's TIME_WAIT
    connections do not count: torch's TCPStore binds with SO_REUSEADDR, and so does this probe."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(preferred: int = 0) -> int:
    """`preferred` if it is free here (`port_free`), else (or for 0) a free port the OS picks.
    Free when asked: nothing holds it for the caller, whose listener must bind it soon."""
    if preferred and port_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
