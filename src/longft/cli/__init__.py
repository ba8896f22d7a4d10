"""The `longft` console script (`main`) and its estimator commands (`estimate`)."""

from longft.cli.main import main

__all__ = ["main"]
