"""The launcher command and the ranks' environment (pure functions)."""

import sys

import pytest

from longft.config.params import from_dict
from longft.run.launch import LaunchError, command, environment

ARGS = ["--params", "p.yaml"]


def test_deepspeed_single_node_gpu():
    cmd = command(from_dict({"hardware": {"num_gpus": 2}, "train": {"global_batch_size": 2}}),
                  "cuda", ARGS)
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert cmd[cmd.index("--num_gpus") + 1] == "2"
    assert cmd[cmd.index("--num_nodes") + 1] == "1"
    assert "--no_local_rank" in cmd
    assert cmd[cmd.index("--module") + 1] == "longft.engine.worker"
    assert cmd[-2:] == ARGS


def test_deepspeed_multi_node_uses_hostfile():
    cfg = from_dict({"hardware": {"num_gpus": 8, "num_nodes": 2, "hostfile": "hosts"},
                     "train": {"global_batch_size": 16}})
    cmd = command(cfg, "cuda", ARGS)
    assert cmd[cmd.index("--hostfile") + 1] == "hosts"
    assert cmd[cmd.index("--num_nodes") + 1] == "2"


def test_cpu_run_leaves_slots_to_launcher():
    cmd = command(from_dict({}), "cpu", ARGS)
    assert "--num_gpus" not in cmd


def test_several_cpu_workers_are_asked_for():
    # DeepSpeed's CPU slot count is the number of NUMA nodes: 2 workers must be asked for
    cmd = command(from_dict({"hardware": {"num_gpus": 2}, "train": {"global_batch_size": 2}}),
                  "cpu", ARGS)
    assert cmd[cmd.index("--num_gpus") + 1] == "2"


def test_torchrun():
    cmd = command(from_dict({"hardware": {"launcher": "torchrun", "num_gpus": 2},
                             "train": {"global_batch_size": 2}}), "cuda", ARGS)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    with pytest.raises(LaunchError, match="hostfile"):
        command(from_dict({"hardware": {"launcher": "torchrun", "num_nodes": 2, "hostfile": "h"},
                           "train": {"global_batch_size": 2}}), "cuda", ARGS)


def test_environment_fixes_arch_suffix_and_pins_accelerator():
    env = environment("cuda", {"TORCH_CUDA_ARCH_LIST": "8.0 9.0a"})
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0 9.0"
    assert env["DS_ACCELERATOR"] == "cuda"
    assert environment("cpu", {})["DS_ACCELERATOR"] == "cpu"


def test_free_port_avoids_a_taken_port():
    import socket

    from longft.run.launch import free_port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert free_port(taken) != taken


def test_each_python_environment_gets_its_own_op_build_folder():
    env = environment("cpu", {})
    assert "torch_extensions" in env["TORCH_EXTENSIONS_DIR"]
    assert environment("cpu", {"TORCH_EXTENSIONS_DIR": "/x"})["TORCH_EXTENSIONS_DIR"] == "/x"


def test_stale_cpu_allreduce_buffers_of_a_port_are_removed(tmp_path):
    from longft.run.launch import drop_shm_buffers
    mine = tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_29511_0"
    other = tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_29600_0"
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    drop_shm_buffers(29511, tmp_path)
    assert not mine.exists() and other.exists()
