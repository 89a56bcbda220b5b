"""Baseline merges through mergekit's Python API (no home-made merge code)."""

from darts_bench.merge.mergekit_merge import build_merges, merge_config_dict, run_one_merge

__all__ = ["build_merges", "merge_config_dict", "run_one_merge"]
