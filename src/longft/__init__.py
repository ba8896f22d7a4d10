"""longft: long-context finetuning on small GPUs (ZeRO-3 offload, offloaded checkpoints, Liger)."""

__version__ = "0.1.0"
