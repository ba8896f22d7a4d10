"""bitsandbytes' 4-bit layers on the CPU (the tests' and a laptop trial's QLoRA): bitsandbytes 0.50's
CPU kernels blocked a weight whose rows are not whole 64-blocks row by row; longft dequantizes
through the flat shape in its dequantization and its forward (model/quantize.py), so training's
forward, its backward, the evaluator and the merged export use one weight."""

import pytest
import torch

from longft.model.quantize import quantize_linears
from test_qlora import TARGETS, _tiny

bnb = pytest.importorskip("bitsandbytes")


def test_cpu_dequantization_is_exact_for_rows_that_are_not_whole_blocks():
    """bitsandbytes 0.50's AVX-512 CPU kernel blocks a 2-D weight row by row: rows of 176 (not a
    multiple of 64, the tiny model's down_proj) came back with ~0.25 relative error. longft asks for
    the flat shape (model/quantize.py): the result is the flat dequantization, reshaped."""
    import bitsandbytes.functional as F

    from longft.model.quantize import _bnb

    _bnb()
    assert F.dequantize_4bit._longft_flat_on_cpu  # (a CPU without AVX-512 is exact either way)
    torch.manual_seed(0)
    w = (torch.randn(64, 176) * 0.02).to(torch.bfloat16)
    q, state = F.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
    got = F.dequantize_4bit(q, state)
    flat = F.quantize_4bit(w.reshape(-1), quant_type="nf4", compress_statistics=True)
    assert got.shape == w.shape and torch.equal(got.reshape(-1), F.dequantize_4bit(*flat).reshape(-1))
    assert ((got.float() - w.float()).norm() / w.float().norm()) < 0.12


@pytest.mark.parametrize("grad", [True, False])
def test_the_cpu_4bit_forward_uses_the_exact_weight_on_rows_that_are_not_whole_blocks(grad):
    """bitsandbytes 0.50's 4-bit forward (its gemm_4bit op, with and without grad) dequantized the
    2-D weight row by row on the CPU: a 176-wide layer's output was 1.9 % off the exact weight its
    backward and the merged export use. longft's CPU kernel makes them one weight."""
    from longft.model.quantize import dequantized_weight

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(176, 64), torch.nn.Linear(128, 64))
    quantize_linears(m, ("0", "1"), "nf4", torch.float32, "cpu")
    for layer, width in zip(m, (176, 128)):
        x = torch.randn(3, width, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            y = layer(x)
        want = torch.nn.functional.linear(x, dequantized_weight(layer, torch.float32), layer.bias)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_an_eval_forward_without_grad_matches_the_training_forward():
    """The evaluator's forward (eval mode, no grad): on an AVX512-BF16 CPU bitsandbytes repacked the
    weights for its gemv, which failed on the tiny model's widths; longft keeps the dequantize path."""
    model = _tiny()
    quantize_linears(model, TARGETS, "nf4", torch.bfloat16, "cpu")
    ids = torch.randint(1, 250, (1, 32))
    with torch.no_grad():
        trained = model.train()(ids).logits
        evaluated = model.eval()(ids).logits
        again = model.train()(ids).logits
    assert torch.isfinite(evaluated).all()
    assert torch.equal(evaluated, trained) and torch.equal(again, trained)
