"""The model: its architecture numbers (`architecture`: head_dim and K/V heads filled in; not
re-exported here, so that the prepare stage, which imports this package, does not depend on it),
loading it (`loading`: architecture configs, tokenizers, random init or from_pretrained) and what
longft changes in it (`patches` applies Liger, the attention kernel,
the tiled MLP (`tiled_mlp`), kept attention outputs (`keep_attention`) and checkpoints offloaded
to the host (`checkpoint_offload`))."""

from longft.model.loading import (
                                  ModelError,
                                  build_model,
                                  check_vocab,
                                  load_model_config,
                                  load_tokenizer,
                                  shipped_architectures,
)

__all__ = ["ModelError", "build_model", "check_vocab", "load_model_config", "load_tokenizer",
           "shipped_architectures"]
