"""The launcher command and the ranks' environment (pure functions), and the rendezvous port:
hardware.master_port auto takes a free one at launch, a pinned one that is taken is refused."""

import json
import runpy
import socket
import sys
from pathlib import Path

import pytest
import yaml

from longft.config.params import Config, from_dict, merge, to_dict
from longft.run.launch import LaunchError, command, environment, master_port, port_free

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--params", "p.yaml"]
PORT = 29500


def test_deepspeed_single_node_gpu():
    cmd = command(from_dict({"hardware": {"num_gpus": 2}, "train": {"global_batch_size": 2}}),
                  "cuda", ARGS, PORT)
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert cmd[cmd.index("--master_port") + 1] == str(PORT)
    assert cmd[cmd.index("--num_gpus") + 1] == "2"
    assert cmd[cmd.index("--num_nodes") + 1] == "1"
    assert "--no_local_rank" in cmd
    assert cmd[cmd.index("--module") + 1] == "longft.engine.worker"
    assert cmd[-2:] == ARGS


def test_deepspeed_multi_node_uses_hostfile():
    cfg = from_dict({"hardware": {"num_gpus": 8, "num_nodes": 2, "hostfile": "hosts"},
                     "train": {"global_batch_size": 16}})
    cmd = command(cfg, "cuda", ARGS, PORT)
    assert cmd[cmd.index("--hostfile") + 1] == "hosts"
    assert cmd[cmd.index("--num_nodes") + 1] == "2"


def test_cpu_run_leaves_slots_to_launcher():
    cmd = command(from_dict({}), "cpu", ARGS, PORT)
    assert "--num_gpus" not in cmd


def test_several_cpu_workers_are_asked_for():
    # DeepSpeed's CPU slot count is the number of NUMA nodes: 2 workers must be asked for
    cmd = command(from_dict({"hardware": {"num_gpus": 2}, "train": {"global_batch_size": 2}}),
                  "cpu", ARGS, PORT)
    assert cmd[cmd.index("--num_gpus") + 1] == "2"


def test_torchrun():
    cmd = command(from_dict({"hardware": {"launcher": "torchrun", "num_gpus": 2},
                             "train": {"global_batch_size": 2}}), "cuda", ARGS, PORT)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    assert cmd[cmd.index("--master_port") + 1] == str(PORT)
    with pytest.raises(LaunchError, match="hostfile"):
        command(from_dict({"hardware": {"launcher": "torchrun", "num_nodes": 2, "hostfile": "h"},
                           "train": {"global_batch_size": 2}}), "cuda", ARGS, PORT)


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


def listening(port: int = 0) -> socket.socket:
    """A socket listening on `port` (0: one the OS picks), as another run's rendezvous would."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds
    s.bind(("", port))
    s.listen()
    return s


def test_auto_takes_a_port_that_is_free():
    port, why = master_port(from_dict({}))
    assert 1024 <= port <= 65535 and "auto" in why
    assert port_free(port)
    listening(port).close()  # a rendezvous can listen on it


def test_two_launches_with_auto_get_different_ports():
    cfg = from_dict({"hardware": {"master_port": "auto"}})
    first, _ = master_port(cfg)
    with listening(first):  # the first run holds its port
        second, _ = master_port(cfg)
        assert second != first and port_free(second) and not port_free(first)


def test_a_pinned_port_is_used_as_it_is_or_refused_while_taken():
    with listening() as s:
        taken = s.getsockname()[1]
        with pytest.raises(LaunchError) as e:
            master_port(from_dict({"hardware": {"master_port": taken}}))
        assert f"hardware.master_port: port {taken} is in use on this machine" in str(e.value)
        assert "hardware.master_port: auto" in str(e.value)  # the fix
        # several nodes: the port is opened on the hostfile's first host, not checked here
        two = from_dict({"hardware": {"master_port": taken, "num_nodes": 2, "hostfile": "h"},
                         "train": {"global_batch_size": 2}})
        assert master_port(two) == (taken, "hardware.master_port, pinned")
    assert master_port(from_dict({"hardware": {"master_port": taken}}))[0] == taken


def test_train_stage_refuses_a_taken_pinned_port_before_touching_anything(tmp_path, monkeypatch,
                                                                           capsys):
    from longft.run.pipeline import run_all, stage_commands

    with listening() as s:
        taken = s.getsockname()[1]
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump(merge(to_dict(Config()),
                                               {"hardware": {"master_port": taken}})))
        run_all(params, tmp_path, ("patch",))  # plan.json; the data is only looked at
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "meta.json").write_text(json.dumps(
            {"max_seq_length": 4096, "num_rows": 259, "source": "jsonl"}))
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "rank0.jsonl").write_text("an earlier run's\n")
        monkeypatch.setattr(sys, "argv", stage_commands(params, tmp_path)["train"][1:])
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(REPO / "stages" / "train.py"), run_name="__main__")
    assert e.value.code == 2
    said = capsys.readouterr()
    err = said.err
    assert f"longft train: hardware.master_port: port {taken} is in use" in err
    # before it, the start lines: the demo's 12 steps leave most of a file's rows out (run/coverage)
    assert "train: note: 12 steps of 2 rows cover 9 % of the 259 prepared rows" in said.out
    assert "Traceback" not in err
    assert (tmp_path / "run" / "rank0.jsonl").read_text() == "an earlier run's\n"
    assert not (tmp_path / "checkpoints").exists()


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
