"""engine/param_copy_back.py: the ZeRO-3 step's copy of the updated fp32 master weights into the
16-bit partitions, through a few reused chunks. On the CPU the chunks are plain memory; the values
must be the very bits of DeepSpeed's own copy (test_gpu_host_copies.py has the GPU's asynchronous path)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from longft.engine.param_copy_back import ChunkedCopyBack, install
from longft.run.launch import free_port

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunks_give_the_bits_of_a_plain_copy_and_are_reused(dtype):
    torch.manual_seed(0)
    src = torch.randn(10_007) * 3                    # not a multiple of the chunk
    src[:4] = torch.tensor([1 + 2 ** -9, 1 + 3 * 2 ** -9, float("inf"), -0.0])  # ties, specials
    ref = torch.empty(10_007, dtype=dtype).copy_(src)
    out = torch.zeros(10_007, dtype=dtype)
    copier = ChunkedCopyBack(chunk=1000, chunks=3)
    copier.copy(out, src)
    copier.copy(out, src)                            # a second sub-group: the same three buffers
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert copier.copied == 2 * 10_007 and len(copier.bufs[dtype]) == 3


def test_a_partition_of_another_size_is_refused():
    with pytest.raises(ValueError, match="10 master values for a partition of 9"):
        ChunkedCopyBack(chunk=4).copy(torch.zeros(9, dtype=torch.bfloat16), torch.zeros(10))


def test_install_leaves_an_optimizer_it_does_not_know_alone():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert install(opt) is None and not hasattr(opt, "_reassign_or_swap_out_partitioned_parameters")


class _Zero3Like:
    """The attributes of DeepSpeed's ZeRO-3 optimizer that install() uses, recording the calls."""

    def __init__(self):
        self.fp16_partitioned_groups_flat = [torch.zeros(5, dtype=torch.bfloat16), None,
                                             torch.zeros(3, dtype=torch.bfloat16)]
        self.fp32_partitioned_groups_flat = [torch.arange(5.0) / 3, torch.zeros(4),
                                             torch.arange(3.0)]
        self.calls = []

    def _reassign_or_swap_out_partitioned_parameters(self, i):
        self.calls.append(("deepspeed", i))

    def _unflatten_partitioned_parameters(self, i):
        self.calls.append(("unflatten", i))

    def _post_step(self, timer_names):
        self.calls.append(("post_step", timer_names))


def test_install_takes_the_converting_sub_groups_and_keeps_the_rest_and_the_step_end():
    opt = _Zero3Like()
    copier = install(opt, devices=("cpu",))
    for i in range(3):
        opt._reassign_or_swap_out_partitioned_parameters(i)
    opt._post_step({"t"})
    assert opt.calls == [("unflatten", 0), ("deepspeed", 1), ("unflatten", 2), ("post_step", {"t"})]
    assert torch.equal(opt.fp16_partitioned_groups_flat[0], (torch.arange(5.0) / 3).bfloat16())
    assert copier.copied == 8
    assert install(_Zero3Like()) is None          # partitions on the host: DeepSpeed's own copy


WORKER = textwrap.dedent("""
    import json, sys
    import torch, deepspeed
    from longft.engine import param_copy_back
    param_copy_back.CHUNK_ELEMENTS = 1000            # several chunks a sub-group
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(4, 64)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True}, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                    "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3, "sub_group_size": 5000,
                                "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    # on the CPU the partitions are on the host too: let the chunked path take them
    copier = param_copy_back.install(engine.optimizer, devices=("cpu",)) if sys.argv[1] == "chunked" else None
    losses = []
    for _ in range(3):
        loss = engine(x.bfloat16()).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        bits = [p.detach().view(torch.int16).view(-1).tolist() for p in model.parameters()]
    print("RESULT " + json.dumps({"losses": losses, "bits": bits,
                                  "copied": copier.copied if copier else 0}))
""")


def _run(tmp_path, mode: str) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=env,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_deepspeed_steps_through_the_chunks_to_the_same_bits(tmp_path):
    """DeepSpeed's own ZeRO-3 step (clipping, CPU Adam, sub-groups, the parameters re-pointed at
    the new partitions) with the copy swapped: the same losses and weights, bit for bit."""
    own, chunked = _run(tmp_path, "deepspeed"), _run(tmp_path, "chunked")
    assert chunked["copied"] == 3 * sum(64 * 64 + 64 for _ in range(6))   # every step, every value
    assert len(set(own["losses"])) == 3                                   # the weights did move
    assert chunked["losses"] == own["losses"] and chunked["bits"] == own["bits"]
