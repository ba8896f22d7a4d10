"""Block-sparse finetuning (`sparse.blocks > 0`): each target linear trains only k blocks of its
weight, of block_size x block_size each, picked by the warm-up (engine/block_warmup.py).

The linear keeps its frozen weight W; it gets a trainable `sparse_delta` [k, b, b] (in the training
dtype, zeros at first) and a buffer `sparse_index` [k, 2] (row block, column block of each trained
block; saved in every checkpoint with the model's state). A forward hook adds x @ D^T, where D is
the [out x in] matrix that holds the k blocks at their places and zeros elsewhere, without ever
building D: `BlockDelta` gathers the input's column blocks, multiplies them by the k blocks and adds
the results into the output's row blocks. Its backward computes exactly the gradients of the k
blocks (block (r, c) of dy^T x) and of the input, and saves nothing but x (which the linear itself
keeps for its own backward). So the optimizer owns k x b^2 parameters per matrix and holds states
for them alone; W stays frozen in the training dtype, or quantized: over a quantized base
(lora.quantize) the linear is bitsandbytes' Linear4bit / Linear8bitLt (model/quantize.py, before
`attach`), and the hook adds x @ D^T after its quantized matmul. Nothing here reads W.

During the warm-up (`probing`) the hook instead records, for every block of W, the summed |dy^T x|
of its entries: the gradient W would get if it trained (`Probe`), without storing it as a gradient.
It is computed from the linear's input x and output gradient dy alone, so a quantized W, which has
no gradient, is probed the same way. `merged_state_dict` folds the blocks into W for the export:
W + D, a plain Hugging Face state dict (over a quantized base engine/export.py de-quantizes W first).
"""

from __future__ import annotations

from contextlib import contextmanager

DELTA = "sparse_delta"
INDEX = "sparse_index"
MASS = "_sparse_mass"


def _blocks(t, b: int):
    """[..., n] -> [N, n // b, b] (all leading dims flattened into N)."""
    return t.reshape(-1, t.shape[-1] // b, b)


def _block_delta_class():
    import torch

    class BlockDelta(torch.autograd.Function):
        """x @ D^T for the block matrix D of (delta, index); out_features: the width of the result."""

        @staticmethod
        def forward(ctx, x, delta, index, out_features: int):
            b = delta.shape[-1]
            xb = _blocks(x, b).index_select(1, index[:, 1])                  # [N, k, b]
            yb = torch.einsum("nki,koi->nko", xb, delta.to(x.dtype))         # [N, k, b]
            y = x.new_zeros(xb.shape[0], out_features // b, b).index_add_(1, index[:, 0], yb)
            ctx.save_for_backward(x, delta, index)
            return y.reshape(*x.shape[:-1], out_features)

        @staticmethod
        def backward(ctx, dy):
            x, delta, index = ctx.saved_tensors
            b = delta.shape[-1]
            dyb = _blocks(dy, b).index_select(1, index[:, 0])                # [N, k, b]
            g_delta = g_x = None
            if ctx.needs_input_grad[1]:
                xb = _blocks(x, b).index_select(1, index[:, 1])
                g_delta = torch.einsum("nko,nki->koi", dyb, xb).to(delta.dtype)
            if ctx.needs_input_grad[0]:
                gxb = torch.einsum("nko,koi->nki", dyb, delta.to(dy.dtype))
                g_x = dy.new_zeros(gxb.shape[0], x.shape[-1] // b, b).index_add_(
                    1, index[:, 1], gxb).reshape(x.shape)
            return g_x, g_delta, None, None

    return BlockDelta


def _probe_class():
    import torch

    class Probe(torch.autograd.Function):
        """Identity on the linear's output y; its backward adds the block sums of |dy^T x| (the
        gradient of the frozen weight) to the linear's mass buffer."""

        @staticmethod
        def forward(ctx, y, x, module):
            ctx.save_for_backward(x)
            ctx.module = module
            return y.view_as(y)

        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensors
            m = ctx.module
            mass = getattr(m, MASS)
            b = mass_block_size(m)
            g = dy.reshape(-1, dy.shape[-1]).t().float() @ x.reshape(-1, x.shape[-1]).float()
            rows, cols = mass.shape
            mass += g.abs_().view(rows, b, cols, b).sum(dim=(1, 3))
            return dy, None, None

    return Probe


_CLASSES: dict = {}


def _fn(name: str):
    if name not in _CLASSES:
        _CLASSES.update(BlockDelta=_block_delta_class(), Probe=_probe_class())
    return _CLASSES[name]


def mass_block_size(m) -> int:
    return m.sparse_block_size  # a plain attribute: ZeRO-3 leaves the partitioned delta 1-D


def _hook(module, inputs, output):
    x = inputs[0]
    if getattr(module, MASS, None) is not None:   # the warm-up: record, add nothing (D is zero)
        return _fn("Probe").apply(output, x, module)
    return output + _fn("BlockDelta").apply(x, getattr(module, DELTA), getattr(module, INDEX),
                                            output.shape[-1])


def targets(model, names: tuple[str, ...]) -> list[tuple[str, object]]:
    """(name, module) of every nn.Linear whose last name part is in `names`, in model order
    (bitsandbytes' quantized linears are nn.Linear subclasses: they are found too)."""
    import torch

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in names]


def attach(model, names: tuple[str, ...], blocks: int, block_size: int, dtype) -> list[str]:
    """Freeze every parameter of `model`, give each target linear its trainable blocks (zeros) and
    index (the first `blocks` blocks until the warm-up picks), and the hook that adds them.
    Returns the target names. Before deepspeed.initialize (ZeRO-3 partitions the blocks there)."""
    import torch

    for p in model.parameters():
        p.requires_grad_(False)
    found = targets(model, names)
    for _, m in found:
        rows = m.out_features // block_size
        idx = torch.arange(blocks)
        m.register_parameter(DELTA, torch.nn.Parameter(
            torch.zeros(blocks, block_size, block_size, dtype=dtype, device=m.weight.device)))
        m.register_buffer(INDEX, torch.stack([idx % rows, idx // rows], 1).to(m.weight.device))
        m.sparse_block_size = block_size
        m.register_forward_hook(_hook)
    return [n for n, _ in found]


@contextmanager
def probing(modules: list):
    """Within: the target linears record their block gradient mass (fp32 [out/b, in/b] each, zeroed
    on entry) instead of adding their blocks; on exit the mass buffers are dropped."""
    import torch

    for m in modules:
        b = mass_block_size(m)
        setattr(m, MASS, torch.zeros(m.out_features // b, m.in_features // b,
                                     device=getattr(m, INDEX).device))
    try:
        yield
    finally:
        for m in modules:
            setattr(m, MASS, None)


def top_blocks(mass, k: int):
    """The k blocks of largest mass as [k, 2] (row block, column block), in ascending block order.
    A stable sort: equal masses go to the lower flat index, so the choice depends on nothing but
    the mass."""
    import torch

    flat = mass.flatten()
    order = torch.sort(-flat, stable=True).indices[:k]
    order = torch.sort(order).values
    cols = mass.shape[1]
    return torch.stack([order // cols, order % cols], 1)


def delta_matrix(delta, index, out_features: int, in_features: int):
    """The dense [out x in] matrix D of the blocks (fp32), for the export and the tests."""
    import torch

    b = delta.shape[-1]
    d = torch.zeros(out_features // b, in_features // b, b, b, dtype=torch.float32)
    d[index[:, 0].cpu(), index[:, 1].cpu()] = delta.detach().float().cpu()
    return d.permute(0, 2, 1, 3).reshape(out_features, in_features)


def merged_state_dict(sd: dict) -> dict:
    """A state dict with blocks -> the plain model's: W' = W + D (summed in fp32, cast back to W's
    dtype); the blocks and their index are left out."""
    out = {}
    for k, v in sd.items():
        if k.endswith("." + DELTA) or k.endswith("." + INDEX):
            continue
        mod = k[:-len(".weight")] if k.endswith(".weight") else None
        if mod is not None and f"{mod}.{DELTA}" in sd:
            d = delta_matrix(sd[f"{mod}.{DELTA}"], sd[f"{mod}.{INDEX}"], v.shape[0], v.shape[1])
            v = (v.float() + d).to(v.dtype)
        out[k] = v
    return out


def has_blocks(model) -> bool:
    return any(hasattr(m, DELTA) for m in model.modules())
