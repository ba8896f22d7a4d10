"""engine/clip_scale.py: DeepSpeed ZeRO-3's gradient rescaling pass is skipped when its factor is
exactly 1, and the result is DeepSpeed's own, bit for bit, whatever the norm, scale and clipping."""

import types

import pytest
import torch

from longft.engine import clip_scale
from zero3_cpu import run_zero3

Stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3").DeepSpeedZeroOptimizer_Stage3


def _zero3_like(loss_scale: float, clip_grad: float, grad: torch.Tensor, groups: int = 1):
    """An object with what DeepSpeed's own `unscale_and_clip_grads` reads (`groups` sub-groups,
    each with a copy of `grad`), that method bound to it and counting its calls."""
    opt = types.SimpleNamespace(loss_scale=loss_scale, clip_grad=clip_grad, passes=0,
                                fp32_partitioned_groups_flat=[])
    for _ in range(groups):
        flat = torch.zeros(grad.numel())
        flat.grad = grad.clone()
        opt.fp32_partitioned_groups_flat.append(flat)
    own = types.MethodType(Stage3.unscale_and_clip_grads, opt)

    def counted(sub_group_id, total_norm):
        opt.passes += 1
        return own(sub_group_id, total_norm)
    opt.unscale_and_clip_grads = counted
    return opt


NORMS = [0.0, 0.25, 1.0 - 2e-6, 1.0 - 1e-6, 1.0 - 5e-7, 1.0, 1.0 + 1e-7, 1.5, 1e4, float("inf")]


@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
@pytest.mark.parametrize("clip_grad", [0.0, 1.0, 0.5])
def test_the_same_bits_as_deepspeeds_pass_and_no_pass_when_the_factor_is_one(loss_scale, clip_grad):
    torch.manual_seed(0)
    grad = torch.randn(4099)
    grad[:3] = torch.tensor([float("nan"), -0.0, float("inf")])
    for norm in NORMS:
        case = (norm, loss_scale, clip_grad)
        total = torch.tensor(norm * loss_scale, dtype=torch.float32)   # DeepSpeed's norm is scaled
        own = _zero3_like(loss_scale, clip_grad, grad)
        own.unscale_and_clip_grads(0, total)
        expected = own.fp32_partitioned_groups_flat[0].grad.view(torch.int32)
        patched = _zero3_like(loss_scale, clip_grad, grad, groups=2)
        assert clip_scale.install(patched)
        for sub_group in (0, 1):                      # the sub-groups of a step share its norm
            patched.unscale_and_clip_grads(sub_group, total)
            assert torch.equal(patched.fp32_partitioned_groups_flat[sub_group].grad.view(torch.int32),
                               expected), case
        factor_one = loss_scale == 1.0 and (clip_grad == 0.0 or norm + 1e-6 <= clip_grad)
        assert patched.passes == (0 if factor_one else 2), case
        if factor_one:                                # DeepSpeed's pass would have changed nothing
            assert torch.equal(expected, grad.view(torch.int32)), case


def test_install_leaves_an_optimizer_it_does_not_know_alone():
    opt = types.SimpleNamespace(unscale_and_clip_grads=lambda *a: None)   # no flat groups, no clip
    assert clip_scale.install(opt) is False
    assert clip_scale.install(object()) is False


@pytest.mark.slow
@pytest.mark.parametrize("clipping", [1e6, 1e-3])
def test_deepspeed_zero3_trains_the_same_bits_with_the_pass_skipped(tmp_path, clipping):
    """DeepSpeed's own ZeRO-3 step with CPU Adam: with a limit no norm reaches, no rescaling pass
    runs and the weights are the very bits of DeepSpeed's; with a limit every norm passes, each
    sub-group is rescaled as before."""
    own = run_zero3(tmp_path, clip="own", clipping=clipping)
    skip = run_zero3(tmp_path, clip="skip", clipping=clipping)
    assert own["passes"] > 0 and len(set(own["losses"])) == 3
    assert skip["passes"] == (0 if clipping > 1 else own["passes"])
    assert skip["losses"] == own["losses"] and skip["bits"] == own["bits"]
