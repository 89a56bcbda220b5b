"""darts-bench: merge decoder experts, correct with Surgery / DARTS, evaluate, report."""

__version__ = "0.1.0"
