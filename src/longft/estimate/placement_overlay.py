"""The params overlay of a placement candidate: what `longft placement` writes for a user to merge
onto their params.yaml (cli/overlay_file.py writes it with its header)."""

from __future__ import annotations

from longft.estimate.placement import OFFLOADS, Candidate, Tuning, copy_back_for


def overlay(c: Candidate, gpus: int, model: dict | None = None, nvme_path: str | None = None) -> dict:
    """The params overlay for a candidate (merge onto the base params): what the plan chose, the
    rest of the base params left alone. `model` only when given (the plan was for another model
    than the base params' one), data only by its length; lora.rank, lora.quantize, sparse.blocks,
    optim.name, zero.copy_back and the global batch (with the candidate's accumulation) always, so
    that the merge trains what was planned (LoRA over params that train sparse blocks sets 0 blocks)."""
    s = c.setup
    opt, param = OFFLOADS[c.offload]
    return {
        **({"model": model} if model else {}),
        # packed or not: per-document attention needs no mask (kernels.packed_attention)
        "data": {"max_seq_length": s.seq_len},
        "hardware": {"num_gpus": gpus},
        # both always written: the overlay is merged onto the user's params, whose values would
        # otherwise survive where the plan chose none
        "checkpointing": {"mode": s.checkpointing, "gpu_layers": s.gpu_layers, "keep_attention": s.keep_attention},
        "zero": {"stage": s.zero_stage, "offload_optimizer": s.offload_device,
                 "offload_param": "cpu" if param else "none", "offload_ratio": s.offload_ratio,
                 "optimizer_states": s.optimizer_states, "host_grad_buffer": s.host_grad_buffer,
                 # auto where it resolves to the candidate's copy (a chunked in the base params
                 # would be refused where it cannot apply); deepspeed where the params chose it
                 "copy_back": "auto" if s.copy_back == copy_back_for(s) else s.copy_back,
                 **({"nvme_path": nvme_path, "sub_group_size": s.sub_group_size} if s.nvme
                    else {"nvme_path": None})},
        "lora": {"rank": s.lora_rank, "quantize": Tuning.of(s).quantize},
        "sparse": {"blocks": s.sparse_blocks, **({"block_size": s.sparse_block_size} if s.sparse_blocks else {})},
        "optim": {"name": s.optimizer},
        "train": {"micro_batch_size": s.micro_batch, "global_batch_size": s.micro_batch * s.world_size * s.grad_accum},
    }
