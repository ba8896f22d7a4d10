"""Measurements taken while a run runs: host RSS / GPU samplers and the GPU inventory (`monitor`),
the per-rank run log (`runlog`), the per-layer progress bar (`progress`), and the time split of
profiled steps (`time_split`, on the interval arithmetic of `intervals`; output.profile_steps)."""
