"""The `longft` console script (`main`) and its estimator commands (`estimate`)."""
