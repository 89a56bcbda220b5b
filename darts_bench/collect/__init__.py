"""Calibration features (``darts-bench collect``)."""

from darts_bench.collect.features import CalibrationSet, FeatureSet, collect_calibration, collect_merged

__all__ = ["CalibrationSet", "FeatureSet", "collect_calibration", "collect_merged"]
