"""The warm-up of block-sparse finetuning (`sparse.*`, model/block_sparse.py): before the first
step of a fresh run, `sparse.warmup_steps` micro-batches of full gradients, with no update, pick
each target matrix's `sparse.blocks` blocks of largest summed |gradient|.

The micro-batches are the first of this rank's share at epoch 0 (the rows the first steps train on),
read straight from the prepared data so the loader's order and the RNG are not touched. The forward
and backward run through the DeepSpeed engine's model (ZeRO-3 gathers the weights as in training,
activation checkpoints are offloaded as in training). On ZeRO-2 (a quantized base), where each rank
holds the whole model, they run through the module itself: the engine's forward hooks the loss so
that its backward reduces the gradients, and ZeRO-2's reduction fails when there is no gradient to
reduce (DeepSpeed 0.19: IndexError in reduce_ipg_grads). The frozen weights' gradients (over a
quantized base: none exist) are never stored: each target linear adds the block sums of |dy^T x| to
an fp32 [out/b x in/b] buffer. The buffers are summed over the ranks, so every rank picks the same
blocks; ties go to the lower block index, so the choice depends on the seed (which rows) and the
data alone. The chosen blocks live in each linear's `sparse_index` buffer, saved with every
checkpoint: a resumed run loads them and skips the warm-up.
"""

from __future__ import annotations

import time

from longft.config.params import Config
from longft.engine.batches import doc_kwargs
from longft.model import block_sparse


def warmup_rows(n_rows: int, rank: int, world: int, seed: int, count: int) -> list[int]:
    """The first `count` rows of this rank's share at epoch 0 (the trainer's DistributedSampler
    order), cycled when the share is shorter."""
    from torch.utils.data import DistributedSampler

    class _Len:
        def __len__(self):
            return n_rows

    s = DistributedSampler(_Len(), num_replicas=world, rank=rank, shuffle=True, seed=seed,
                           drop_last=True)
    s.set_epoch(0)
    order = list(s)
    return [order[i % len(order)] for i in range(count)]


def choose(engine, cfg: Config, dataset, *, rank: int, world: int, pad_id: int, packed: bool,
           offloader=None) -> dict:
    """Run the warm-up and set every target linear's `sparse_index`; returns a summary for the
    run log (targets, blocks, seconds)."""
    import torch.distributed as dist
    from torch.utils.data import default_collate

    s, micro = cfg.sparse, cfg.train.micro_batch_size
    model = engine.module
    forward = engine if cfg.zero.stage == 3 else model  # ZeRO-2: no gradient reduction to run
    mods = [m for _, m in block_sparse.targets(model, s.target_modules)]
    rows = warmup_rows(len(dataset), rank, world, cfg.train.seed, s.warmup_steps * micro)
    t0 = time.perf_counter()
    # the embeddings' output requires grad, so the backward reaches every linear although no
    # parameter in the graph trains (the blocks are left out while probing)
    grad_in = model.get_input_embeddings().register_forward_hook(
        lambda _m, _i, out: out.requires_grad_(True))
    was_training = model.training
    model.train()
    try:
        with block_sparse.probing(mods):
            for i in range(s.warmup_steps):
                cpu = default_collate([dataset[j] for j in rows[i * micro:(i + 1) * micro]])
                b = {k: v.to(engine.device) for k, v in cpu.items()}
                docs, _ = doc_kwargs(cpu, pad_id, engine.device, packed)
                if offloader is not None:
                    offloader.new_step()
                loss = forward(input_ids=b["input_ids"], labels=b["labels"],
                               position_ids=b["position_ids"], **docs).loss
                loss.backward()
            masses = [getattr(m, block_sparse.MASS) for m in mods]
            if dist.is_initialized() and world > 1:
                for mass in masses:
                    dist.all_reduce(mass)
            for m, mass in zip(mods, masses):
                getattr(m, block_sparse.INDEX).copy_(block_sparse.top_blocks(mass, s.blocks))
    finally:
        grad_in.remove()
        model.train(was_training)
    return {"targets": len(mods), "blocks_per_target": s.blocks, "block_size": s.block_size,
            "micro_batches": s.warmup_steps, "seconds": round(time.perf_counter() - t0, 3)}
