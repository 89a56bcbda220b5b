"""Calibration features (``darts-bench collect``): the stage's functions
(:mod:`darts_bench.collect.features`) and the feature format they write and ``surgery`` and the
workers read (:mod:`darts_bench.collect.store`)."""

from darts_bench.collect.features import CalibrationSet, FeatureSet, collect_calibration, collect_merged

__all__ = ["CalibrationSet", "FeatureSet", "collect_calibration", "collect_merged"]
