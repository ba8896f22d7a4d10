"""Measurements taken while a run runs: host RSS / GPU samplers and the GPU inventory (`monitor`),
the per-rank run log (`runlog`), and the per-layer progress bar (`progress`)."""
