"""Results tables, bootstrap confidence intervals, plots and the run manifest."""
