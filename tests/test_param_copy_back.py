"""engine/param_copy_back.py: the ZeRO-3 step's copy of the updated fp32 master weights into the
16-bit partitions, through a few reused chunks. On the CPU the chunks are plain memory; the values
must be the very bits of DeepSpeed's own copy (test_gpu_host_copies.py has the GPU's asynchronous path)."""

import pytest
import torch

from longft.engine.param_copy_back import ChunkedCopyBack, install
from zero3_cpu import run_zero3


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




@pytest.mark.slow
def test_deepspeed_steps_through_the_chunks_to_the_same_bits(tmp_path):
    """DeepSpeed's own ZeRO-3 step (clipping, CPU Adam, sub-groups, the parameters re-pointed at
    the new partitions) with the copy swapped: the same losses and weights, bit for bit."""
    own, chunked = run_zero3(tmp_path, "deepspeed"), run_zero3(tmp_path, "chunked")
    assert chunked["copied"] == 3 * sum(64 * 64 + 64 for _ in range(6))   # every step, every value
    assert len(set(own["losses"])) == 3                                   # the weights did move
    assert chunked["losses"] == own["losses"] and chunked["bits"] == own["bits"]
