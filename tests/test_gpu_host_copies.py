"""GPU tests of longft's own host <-> GPU copies (`pytest -m gpu`; scripts/gpu_suite.sh runs them):
the exact-size pinned slabs of offloaded checkpoints (model/pinned_slabs.py) and the chunked copy
of the updated weights back to the GPU (engine/param_copy_back.py)."""

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_pinned_slabs_are_page_locked_and_copy_both_ways_asynchronously():
    from longft.model.pinned_slabs import PinnedSlabs

    slabs = PinnedSlabs(pin=True)
    host = slabs.take((3, 1000, 999), torch.bfloat16)         # 5.99 MB: not a power of two
    assert host.is_pinned() and slabs.registered and slabs.allocated_bytes == 3 * 1000 * 999 * 2
    gpu = torch.randn(3, 1000, 999, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(gpu, non_blocking=True)
        back = torch.empty_like(gpu)
        back.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    slabs.give(host, done)
    again = slabs.take((2997000,), torch.float16)             # the same slab, after the copy
    assert again.data_ptr() == host.data_ptr() and done.query()
    torch.cuda.synchronize()
    assert torch.equal(back, gpu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_copy_back_to_the_gpu_gives_deepspeeds_bits_in_stream_order(dtype):
    """engine/param_copy_back.py on the GPU: pinned chunks copied on a side stream, bit for bit
    what DeepSpeed's own blocking copy_ gives. torch.cuda._sleep holds one stream back so that each
    ordering the module promises would fail the test without it."""
    from longft.engine.param_copy_back import ChunkedCopyBack

    torch.manual_seed(0)
    n, hold = 2_000_003, 200_000_000          # GPU clock cycles: ~0.1 s
    srcs = [torch.randn(n) * 3 for _ in range(3)]
    refs = [torch.zeros(n, dtype=dtype, device="cuda").copy_(x) for x in srcs]  # DeepSpeed's copy

    def bits(t):
        return t.view(torch.int16)

    out = torch.zeros(n, dtype=dtype, device="cuda")
    copier = ChunkedCopyBack(chunk=300_000, chunks=3)
    # 1. the copies wait for what the compute stream queued before them (it may read the
    # partition), and the compute stream's next work waits for the copies
    torch.cuda._sleep(hold)
    out.fill_(7)
    copier.copy(out, srcs[0])
    assert torch.equal(bits(out), bits(refs[0]))
    # 2. a chunk is refilled only once the copy reading it is done (7 chunks, 3 buffers), with the
    # side stream held back
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(hold)
    copier.copy(out, srcs[1])
    assert torch.equal(bits(out), bits(refs[1]))
    # 3. after wait() another stream, one that never waits for the compute stream (ZeRO-3's
    # all-gather stream), reads the new values
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(hold)
    copier.copy(out, srcs[2])
    copier.wait()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        seen = out.clone()
    other.synchronize()
    assert torch.equal(bits(seen), bits(refs[2]))
    ring = copier.bufs[dtype]
    assert len(ring) == 3 and all(buf.is_pinned() for buf, _ in ring)
