"""hardware.sequence_parallel N > 1: DeepSpeed's Ulysses sequence parallelism for Hugging Face
models (deepspeed.runtime.sequence_parallel.ulysses_sp, the ALST recipe), not a home-made one.

- `register` puts DeepSpeed's `UlyssesSPAttentionHF` in front of the model's attention function
  (`register_with_transformers`) and returns DeepSpeed's sequence-parallel `mpu`, which
  `deepspeed.initialize(mpu=...)` takes: ZeRO then reduces gradients over all ranks and averages
  them over the data-parallel groups only (the ranks of one sequence add their parts).
- `shard` wraps the rank's micro-batch stream in `UlyssesSPDataLoaderAdapter`: the N ranks of a
  group exchange the rows they loaded, and each micro-step every rank trains its 1/N slice of one
  of them (so a loaded row is N micro-steps; ds_config's gradient accumulation counts them).
  Labels arrive pre-shifted as `shift_labels` (the next token of the whole row, also across the
  slice edges).
- `SequenceParallel.forward` runs one micro-step: each rank's part is the sum of its slice's token
  losses divided by the token count of the *whole* row (an all-reduce of the counts); the parts
  are added by a differentiable all-reduce (ALST's loss aggregation), so every rank
  backpropagates the row's exact mean loss, and ZeRO-3's reduce-scatter (which divides by the
  whole world) leaves exactly the gradients of one rank training the whole row.
- Packed rows: after the all-to-all each rank holds the whole row (heads / N of the heads); the
  position ids DeepSpeed all-gathers there give the document boundaries, from which longft's
  per-document attention (model/packed_attention.py) or flash-attn's variable-length path (which
  reads the position ids itself) keeps documents apart.
- Evaluation (engine.eval()) bypasses the all-to-all (`disable_in_eval`): each rank evaluates its
  own whole rows, as without sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from longft.compat import transformers as tf_compat
from longft.engine.batches import real_tokens
from longft.model import packed_attention

TOKENS, DOC_SQ = "longft_real_tokens", "longft_doc_sq"
"""Per-row counts worked out on the whole row before the adapter slices it (non-tensor entries:
the adapter hands them to every rank of the group)."""


def _positions_give_documents(base):
    """longft's packed attention, reading the document boundaries from the whole row's position
    ids (which Ulysses gathers before the attention) instead of per-slice keyword arguments."""
    def forward(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(k, None)
        if position_ids is not None:
            kwargs.update(packed_attention.batch_kwargs(position_ids))
        return base(module, query, key, value, attention_mask, *args, position_ids=position_ids,
                    **kwargs)
    return forward


def register(model, size: int, micro_batch_size: int, seq_length: int):
    """DeepSpeed's Ulysses attention in front of the model's attention implementation; DeepSpeed's
    sequence-parallel mpu (its process groups). Call after the process group and the patches."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface

    impl = tf_compat.attn_implementation(model.config)
    if impl == packed_attention.NAME:
        AttentionInterface.register(impl, _positions_give_documents(tf_compat.attention_function(impl)))
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=impl, sequence_parallel_size=size,
        micro_batch_size=micro_batch_size, seq_length=seq_length, seq_length_is_variable=False,
        disable_in_eval=True)


def _with_counts(batches, pad_id: int):
    """Each micro-batch with its rows' real (non-tail-padding) token counts and sum(L_i^2) over
    their documents, from the whole rows (engine/batches.py)."""
    from longft.engine.batches import doc_kwargs

    for b in batches:
        b = dict(b)
        b[TOKENS] = [real_tokens(b["input_ids"][r:r + 1], b["labels"][r:r + 1], pad_id)
                     for r in range(b["input_ids"].shape[0])]
        b[DOC_SQ] = doc_kwargs(b, pad_id, "cpu", False)[1]
        yield b


@dataclass
class SequenceParallel:
    """One rank's part of a sequence-parallel group (DeepSpeed's mpu)."""

    mpu: Any
    size: int
    rank: int

    @classmethod
    def of(cls, mpu) -> SequenceParallel:
        return cls(mpu, mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank())

    def shard(self, batches, pad_id: int, device):
        """This rank's slices of the group's rows (DeepSpeed's UlyssesSPDataLoaderAdapter)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        return UlyssesSPDataLoaderAdapter(_with_counts(batches, pad_id), sp_rank=self.rank,
                                          sp_group=self.mpu.get_sequence_parallel_group(),
                                          sp_world_size=self.size, device=device)

    def counts(self, batch: dict, seq_len: int) -> tuple[int, int]:
        """(real tokens in this rank's slice, its share of sum(L_i^2)): real tokens are a prefix
        of each row, so the slices' counts add up to the row's; the squares go to rank 0's share
        but for the even split (they add up exactly)."""
        chunk = seq_len // self.size
        lo = chunk * self.rank
        tokens = sum(min(max(t - lo, 0), chunk) for t in batch[TOKENS])
        sq = int(batch[DOC_SQ])
        share = sq // self.size + (sq % self.size if self.rank == 0 else 0)
        return tokens, share

    def forward(self, engine, batch: dict):
        """(the loss to backpropagate, the whole row's mean loss as a float) for one micro-step:
        each rank's part is its slice's summed token losses / the whole row's token count."""
        import torch
        import torch.distributed as dist
        import torch.distributed.nn.functional  # noqa: F401

        b = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()
             if torch.is_tensor(v)}
        labels = b["shift_labels"]
        count = (labels != -100).sum().to(torch.int64).reshape(1)
        dist.all_reduce(count, group=self.mpu.get_sequence_parallel_group())
        count = count.clamp(min=1)
        part = engine(input_ids=b["input_ids"], labels=labels, shift_labels=labels,
                      position_ids=b["position_ids"], num_items_in_batch=count[0]).loss
        # The row's mean on every rank, through a differentiable all-reduce (ALST's weighted
        # loss aggregation): its backward hands each rank N x its slice's gradient, which is what
        # ZeRO-3 expects: it reduce-scatters with a pre-division by the whole world
        # (deepspeed/runtime/comm/coalesced_collectives.py reduce_scatter_coalesced, "pre-divide";
        # stage3.py __avg_scatter_grads), not by the data-parallel world.
        loss = torch.distributed.nn.functional.all_reduce(
            part, group=self.mpu.get_sequence_parallel_group())
        return loss, float(loss.detach().float().item())
