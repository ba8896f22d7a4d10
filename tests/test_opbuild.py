"""A DeepSpeed op that cannot be JIT-built (no C++ compiler, no ninja, no CUDA toolkit) ends the run
with one message (which op, the likely cause, the fixes) instead of a long traceback."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from longft.engine.opbuild import diagnose


@pytest.fixture
def cpu_adam():
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    return CPUAdamBuilder()


def failure_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test looks at whatever DeepSpeed raised
        return e
    raise AssertionError("no exception")


def test_ninja_missing(monkeypatch, cpu_adam):
    import torch.utils.cpp_extension as ce

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions (pip install ninja to get it)")

    monkeypatch.setattr(ce, "verify_ninja_availability", no_ninja)
    e = failure_of(lambda: cpu_adam.jit_load(verbose=False))
    assert "ninja not being installed" in str(e)  # DeepSpeed's own wording
    f = diagnose(e)
    assert f.op == "cpu_adam" and f.build_var == "DS_BUILD_CPU_ADAM"
    msg = f.message()
    assert "could not build its `cpu_adam` op" in msg and "ninja is not installed" in msg
    assert "pip install ninja" in msg and "DS_BUILD_CPU_ADAM=1 pip install" in msg
    assert "zero.offload_optimizer: none" in msg


@pytest.mark.parametrize("how", ["torch", "deepspeed"])
def test_cuda_toolkit_missing(monkeypatch, how):
    import torch.utils.cpp_extension as ce
    from deepspeed.ops.op_builder import builder as ds_builder
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setattr(ce, "CUDA_HOME", None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")  # no GPU here to probe
    # What building a CUDA op hits first without a toolkit: torch's OSError (nvcc path) or
    # DeepSpeed's MissingCUDAException (CUDA version probe), both raised by the real functions.
    real = {"torch": lambda *a, **k: ce._join_cuda_home("bin", "nvcc"),
            "deepspeed": lambda *a, **k: ds_builder.installed_cuda_version()}[how]
    monkeypatch.setattr(ce, "load", real)
    e = failure_of(lambda: FusedAdamBuilder().jit_load(verbose=False))
    assert type(e).__name__ == {"torch": "OSError", "deepspeed": "MissingCUDAException"}[how]
    msg = diagnose(e).message()
    assert "`fused_adam` op" in msg and "no CUDA toolkit" in msg
    assert "set CUDA_HOME" in msg and "DS_BUILD_FUSED_ADAM=1" in msg
    assert "offload_optimizer: none" not in msg  # that alternative is cpu_adam's only


def test_compiler_error_shows_the_compiler_lines(monkeypatch, cpu_adam):
    import torch.utils.cpp_extension as ce

    def failed_build(*a, **k):
        try:
            raise subprocess.CalledProcessError(1, ["ninja", "-v"])
        except subprocess.CalledProcessError as cpe:
            raise RuntimeError("Error building extension 'cpu_adam': [1/3] c++ -O3 cpu_adam.cpp\n"
                               "cpu_adam.cpp:1:10: fatal error: omp.h: No such file or directory\n"
                               "ninja: build stopped: subcommand failed.") from cpe

    monkeypatch.setenv("CXX", sys.executable)  # a compiler that exists
    monkeypatch.setattr(ce, "load", failed_build)
    f = diagnose(failure_of(lambda: cpu_adam.jit_load(verbose=False)))
    assert f.cause.startswith(f"the compiler `{sys.executable}` failed")
    assert f.evidence == ("cpu_adam.cpp:1:10: fatal error: omp.h: No such file or directory",)


def test_other_errors_are_left_alone():
    assert diagnose(failure_of(lambda: 1 / 0)) is None
    assert diagnose(RuntimeError("CUDA error: an illegal memory access")) is None


def test_worker_prints_one_message_and_exits_2(monkeypatch, tmp_path, capsys, cpu_adam):
    import torch.utils.cpp_extension as ce

    from longft.config.params import Config, to_dict
    from longft.engine import worker

    monkeypatch.setattr(ce, "verify_ninja_availability", lambda: (_ for _ in ()).throw(
        RuntimeError("Ninja is required to load C++ extensions")))
    from test_plan_file import plan_dict  # tests/ is on sys.path under pytest

    monkeypatch.setattr(worker, "train", lambda *a, **k: cpu_adam.load())
    (tmp_path / "p.json").write_text(json.dumps(plan_dict()))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(to_dict(Config())))
    code = worker.main(["--params", str(params), "--plan", str(tmp_path / "p.json"),
                        "--ds-config", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("longft train: DeepSpeed could not build its `cpu_adam` op")
    assert "Traceback" not in err


def _no_compiler_path(farm):
    """A PATH with every program of this one except C/C++ compilers (symlinks)."""
    farm.mkdir()
    compiler = re.compile(r"(^|-)(c\+\+|g\+\+|gcc|cc|clang\+\+|clang)(-[\d.]+)?$")
    for d in os.environ["PATH"].split(os.pathsep):
        if os.path.isdir(d):
            for name in os.listdir(d):
                if not compiler.search(name) and not os.path.lexists(farm / name):
                    (farm / name).symlink_to(os.path.join(d, name))
    return str(farm)


def test_training_without_a_compiler_explains_the_cpu_adam_build(tmp_path):
    """A real run (ZeRO-3, zero.offload_optimizer: cpu) with no C++ compiler on PATH and an empty
    op build folder: DeepSpeed must JIT-build cpu_adam and cannot."""
    from longft.config.params import Config, merge, to_dict
    from longft.run.launch import environment
    from longft.run.pipeline import run_all, stage_commands

    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler to build the CPU comm op this test keeps")
    params = merge(to_dict(Config()),
                   {"data": {"num_samples": 4, "max_seq_length": 1024},
                    "train": {"iterations": 2, "warmup_iterations": 1},
                    "zero": {"offload_optimizer": "cpu"},
                    "output": {"save_checkpoint": False, "export": False}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch"))

    # The fresh build folder keeps only DeepSpeed's CPU all-reduce op (built on CPU at
    # init_distributed, before the optimizer), so that cpu_adam is the op that has to be compiled.
    ext = tmp_path / "torch_extensions"
    ext.mkdir()
    usual = environment("cpu", dict(os.environ))["TORCH_EXTENSIONS_DIR"]
    shm = os.path.join(usual, "deepspeed_shm_comm")
    if os.path.isdir(shm):
        shutil.copytree(shm, ext / "deepspeed_shm_comm")
    else:
        subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder.cpu import "
                        "ShareMemCommBuilder as B; B().load()"], check=True,
                       env={**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu"})
    env = {**os.environ, "PATH": _no_compiler_path(tmp_path / "bin"),
           "TORCH_EXTENSIONS_DIR": str(ext)}
    env.pop("CXX", None)
    p = subprocess.run(stage_commands(tmp_path / "params.yaml", tmp_path)["train"], env=env,
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert ("longft train: DeepSpeed could not build its `cpu_adam` op (compiled on first use into "
            f"{ext / 'cpu_adam'}): no C++ compiler: `c++` is not on PATH.") in out, out[-3000:]
    assert re.search(r"build output: .*c\+\+: (command )?not found", out)
    assert "apt-get install build-essential" in out and "DS_BUILD_CPU_ADAM=1" in out
    assert "zero.offload_optimizer: none" in out
    assert "Traceback" not in out
    rows = [json.loads(x) for x in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()] \
        if (tmp_path / "run" / "rank0.jsonl").is_file() else []
    assert not any(r.get("status") == "complete" for r in rows)
