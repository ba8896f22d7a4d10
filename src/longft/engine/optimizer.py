"""The optimizer DeepSpeed wraps: its own Adam (named in the DeepSpeed config, CPU Adam with
offload) or bitsandbytes' 8-bit AdamW (`optim.name`), handed to `deepspeed.initialize` as a
callable over the parameter groups, so ZeRO partitions its states as it does Adam's."""

from __future__ import annotations

from longft.config.params import Config


def client_optimizer(cfg: Config):
    """None (DeepSpeed builds the Adam its config names) or a callable params -> bitsandbytes'
    8-bit AdamW with optim.* (paged: its states in CUDA unified memory, which spill to the host
    under memory pressure instead of failing)."""
    o = cfg.optim
    if o.name == "adamw":
        return None
    import bitsandbytes as bnb

    cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}[o.name]

    def make(params):
        return cls(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)

    return make
