"""Offloaded checkpoints: the hooks' bookkeeping on CPU (a stand-in 'device'), gradients identical
to plain checkpointing, and the prefetch order. The CUDA path is in tests/test_gpu.py."""

import pytest
import torch

from longft.model.checkpoint_offload import OffloadHooks


class CpuHooks(OffloadHooks):
    """Treat CPU tensors as 'device' tensors so the mechanics run without a GPU."""

    def __init__(self, prefetch: bool = True, slabs=None):
        super().__init__(min_bytes=1024, pin_memory=False, prefetch=prefetch, slabs=slabs)
        self.stream = None
        self.unpacked = []

    def _offloadable(self, t):
        return not isinstance(t, torch.nn.Parameter) and t.numel() * t.element_size() >= self.min_bytes

    def _unpack(self, packed):
        if isinstance(packed, int):
            self.unpacked.append(packed)
        return super()._unpack(packed)


def tiny_model():
    from transformers import AutoModelForCausalLM

    from longft.config.params import ModelConfig
    from longft.model.loading import load_model_config

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(load_model_config(ModelConfig()), dtype=torch.float32,
                                         attn_implementation="sdpa")
    m.config.use_cache = False
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m


def grads(model, ids, hooks=None):
    model.zero_grad(set_to_none=True)
    if hooks is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with hooks:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradients_identical_to_plain_checkpointing():
    model = tiny_model()
    ids = torch.randint(1, 300, (1, 256))
    loss_ref, g_ref = grads(model, ids)
    hooks = CpuHooks()
    loss, g = grads(model, ids, hooks)
    assert torch.equal(loss, loss_ref)
    for n in g_ref:
        assert torch.equal(g[n], g_ref[n]), n
    # Each decoder layer's input [1, 256, 64] fp32 = 64 KiB went to the host and came back.
    assert hooks.offloaded_bytes >= 2 * 256 * 64 * 4
    assert hooks.host == {} and hooks.prefetched == {}  # everything handed back, nothing leaked


def test_backward_unpacks_in_reverse_and_prefetches_the_previous_tensor():
    model = tiny_model()
    hooks = CpuHooks()
    grads(model, torch.randint(1, 300, (1, 256)), hooks)
    keys = hooks.unpacked
    n = len(keys)
    assert sorted(keys) == list(range(n))  # every saved tensor came back exactly once
    assert keys[0] >= n - 2 and keys[-1] == 0  # backward walks the layers from last to first
    assert hooks.prefetch_hits >= n // 2  # most tensors were already on their way back


def test_small_tensors_and_parameters_stay_put():
    hooks = OffloadHooks(min_bytes=1 << 20, pin_memory=False)
    p = torch.nn.Parameter(torch.zeros(1024, 1024))
    small = torch.zeros(8)
    assert hooks._pack(p) is p
    assert hooks._pack(small) is small
    assert hooks.offloaded_bytes == 0


def test_only_large_device_tensors_are_offloaded_and_the_defaults_follow_the_machine():
    """A tensor off the host of at least min_bytes moves; a smaller one, or one already on the
    host, stays. By default the hooks prefetch, and pin and copy on a side stream only with CUDA."""
    from longft.model.checkpoint_offload import OFFLOAD_MIN_BYTES

    hooks = OffloadHooks()
    assert hooks.min_bytes == OFFLOAD_MIN_BYTES and hooks.prefetch is True
    assert hooks.pin is torch.cuda.is_available()
    assert (hooks.stream is None) is not torch.cuda.is_available()
    elements = OFFLOAD_MIN_BYTES // 4  # fp32
    assert hooks._offloadable(torch.empty(elements, device="meta"))
    assert not hooks._offloadable(torch.empty(elements - 1, device="meta"))
    assert not hooks._offloadable(torch.empty(elements))  # already on the host


@pytest.mark.parametrize("mode", ["cpu_offload"])
def test_plan_accepts_cpu_offload_on_a_gpu(mode):
    from longft.config.params import from_dict
    from longft.hardware import Hardware, resolve

    h200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                    gpu_mem_gib=139.8, liger=True)
    r = resolve(from_dict({"checkpointing": {"mode": mode}}), h200, "llama")
    assert r["checkpointing"].value == "cpu_offload"


def _decoder_layers(model):
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


@pytest.mark.parametrize("gpu_layers", [0, 1])
def test_checkpoint_offload_moves_only_the_layer_inputs(gpu_layers):
    from longft.model.checkpoint_offload import CheckpointOffload

    model = tiny_model()
    ids = torch.randint(1, 300, (1, 256))
    loss_ref, g_ref = grads(model, ids)
    off = CheckpointOffload(_decoder_layers(model), gpu_layers=gpu_layers, hooks=CpuHooks)
    hooks = off.new_step()
    loss, g = grads(model, ids)  # the hooks act from inside the layers' checkpoint calls
    assert torch.equal(loss, loss_ref)
    for n in g_ref:
        assert torch.equal(g[n], g_ref[n]), n
    # exactly the inputs of the offloaded layers ([1, 256, 64] fp32 each): nothing saved outside
    # the layers (final norm input, logits) and nothing of the last gpu_layers layers
    n_layers = len(_decoder_layers(model))
    assert hooks.offloaded_bytes == (n_layers - gpu_layers) * 256 * 64 * 4
    assert sorted(hooks.unpacked) == list(range(n_layers - gpu_layers))
    assert hooks.prefetch_hits == n_layers - gpu_layers - 1  # all but the first unpack prefetched
    assert hooks.host == {} and hooks.prefetched == {}


def test_checkpoint_offload_needs_checkpointing_and_bounds_gpu_layers():
    from longft.model.checkpoint_offload import CheckpointOffload
    from longft.model.patches import offload_checkpoints

    model = tiny_model()
    with pytest.raises(ValueError, match="gpu_layers is 9 but the model has 2 decoder layers"):
        offload_checkpoints(model, gpu_layers=9)
    model.gradient_checkpointing_disable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        CheckpointOffload(_decoder_layers(model))


class Event:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_slabs_are_the_exact_size_and_reused_only_after_their_copy():
    from longft.model.pinned_slabs import PinnedSlabs

    slabs = PinnedSlabs(pin=False)
    a = slabs.take((3, 1000), torch.bfloat16)
    assert a.shape == (3, 1000) and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert slabs.allocated_bytes == 6000               # not 8192: no power-of-two rounding
    copy = Event()
    slabs.give(a, copy)
    b = slabs.take((1500,), torch.float32)             # the same bytes, another shape and dtype
    assert b.data_ptr() == a.data_ptr() and copy.waited == 1
    c = slabs.take((3, 1000), torch.bfloat16)          # b is out: a new slab
    assert c.data_ptr() != b.data_ptr() and slabs.allocated_bytes == 12000
    slabs.give(b)
    assert slabs.take((2, 10), torch.float32).data_ptr() != b.data_ptr()   # sizes never mix


def test_offloaded_checkpoints_reuse_their_host_buffers_from_step_to_step():
    from longft.model.checkpoint_offload import CheckpointOffload
    from longft.model.pinned_slabs import PinnedSlabs

    model = tiny_model()
    ids = torch.randint(1, 300, (1, 256))
    slabs = PinnedSlabs(pin=False)
    layers = _decoder_layers(model)
    off = CheckpointOffload(layers, hooks=lambda: CpuHooks(slabs=slabs))
    one_step = len(layers) * 256 * 64 * 4                # each layer's fp32 input, exactly
    for _ in range(3):
        off.new_step()
        grads(model, ids)
        assert slabs.allocated_bytes == one_step         # made in the first step, then reused
    off.new_step()
    model(input_ids=ids, labels=ids)                     # a forward that no backward follows
    off.new_step()                                       # gives its buffers back
    grads(model, ids)
    assert slabs.allocated_bytes == one_step
