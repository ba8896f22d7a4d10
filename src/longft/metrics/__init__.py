"""From a run's raw measurements to DVC metrics (`summary`), plots and the memory timeline
(`plots`), and the cross-run results table of `longft report` (`report`)."""
