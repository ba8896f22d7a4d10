"""The micro-batches a rank trains on: the resumable epoch-after-epoch stream, the count of real
(non-padding) tokens, the document boundaries handed to the attention, and how optimizer steps and
passes over the data (epochs) relate.

Each rank sees its share of the prepared rows through a DistributedSampler (drop_last: the
`rows % world` rows left over are not trained in that epoch; the shuffle differs every epoch, so
they are other rows each time). An epoch is `ceil((rows // world) / micro_batch_size)`
micro-batches per rank (the last one can be short) and the stream runs on across epoch
boundaries, so an optimizer step may take its micro-batches from two epochs. `train.epochs: E`
makes the run `ceil(E x micro-batches per epoch / accumulation)` optimizer steps
(`steps_for_epochs`), and every step records the passes made so far (`passes`, fractional).
"""

from __future__ import annotations

import itertools
import math

from longft.config.sections import LONGFT_PACKED_KERNELS

PASSES_BOUNDARIES = (*LONGFT_PACKED_KERNELS, "flash_attention_2")
"""Resolved kernels.packed_attention values whose kernels read the document boundaries."""


def micro_batches_per_epoch(rows: int, world: int, micro_batch_size: int) -> int:
    """Micro-batches one rank draws from one pass over `rows` prepared rows (DistributedSampler
    with drop_last, DataLoader keeping the short last batch)."""
    return math.ceil((rows // world) / micro_batch_size)


def steps_for_epochs(epochs: float, rows: int, world: int, micro_batch_size: int,
                     accum: int) -> int:
    """Optimizer steps that make `epochs` passes over the data (rounded up to a whole step, at
    least 1)."""
    per_epoch = micro_batches_per_epoch(rows, world, micro_batch_size)
    # a hair below the exact product first, so that 2 epochs of 6 micro-batches are 12, not 13
    return max(1, math.ceil(epochs * per_epoch / accum - 1e-9))


def passes(step: int, rows: int, world: int, micro_batch_size: int, accum: int) -> float:
    """Passes over the data made after optimizer step `step` (1.0 = one epoch)."""
    return step * accum / micro_batches_per_epoch(rows, world, micro_batch_size)


def real_tokens(input_ids, labels, pad_id: int) -> int:
    """Positions that are not tail padding (pad id with no label, at the end of each row)."""
    import torch

    pad = (input_ids == pad_id) & (labels == -100)
    tail = torch.cumprod(pad.flip(-1).int(), dim=-1).sum()
    return int(input_ids.numel() - tail)


class SkipFirst:
    """A sampler that drops the first `skip` indices of the next epoch it yields, once: on resume
    the micro-batches the checkpointed run already trained on are skipped without being loaded."""

    def __init__(self, base):
        self.base, self.skip = base, 0

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.base), skip, None)

    def __len__(self) -> int:
        return len(self.base)


def micro_batches(loader, sampler: SkipFirst, start: int = 0):
    """Micro-batches, epoch after epoch (each reshuffled: set_epoch), from micro-batch `start` on
    (only the last batch of an epoch can be short, so the first `start % per_epoch` of its epoch
    are whole batches)."""
    epoch, within = divmod(start, len(loader))
    sampler.skip = within * loader.batch_size
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def doc_kwargs(batch: dict, pad_id: int, device, packed: bool) -> tuple[dict, int]:
    """The document boundaries for the model (once per micro-batch; {} for one document a row or
    an attention that takes none) and sum(L_i^2) over the micro-batch's documents' real tokens
    (the tail padding, which continues the last document's positions, left out), for the
    attention FLOPs, counted per document."""
    from longft.model import packed_attention

    pos = batch["position_ids"]
    kw = packed_attention.batch_kwargs(pos) if packed else {}
    kw = {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in kw.items()}
    sq = 0
    for r in range(pos.shape[0]):
        lengths = packed_attention.document_lengths(pos[r:r + 1])
        pad = pos.shape[1] - real_tokens(batch["input_ids"][r:r + 1], batch["labels"][r:r + 1], pad_id)
        lengths[-1] -= pad
        sq += sum(n * n for n in lengths)
    return kw, sq
