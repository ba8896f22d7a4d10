"""Running the pipeline: the patch stage's work (`patch_stage`: plan.json and ds_config.json),
starting the ranks (`launch`, after the host-RAM check in `preflight`), running the stages in
order (`pipeline`), `longft max-context --confirm` (`confirm`) and sweeps (`sweep`)."""
